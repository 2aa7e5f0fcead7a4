"""``kvstore rm``: remove namespaces (by id or model id) or blocks, descendants included."""

from __future__ import annotations

import argparse
import sys

from kvstore.commands.output import (
    EXIT_FINDINGS,
    EXIT_OK,
    confirm,
    emit_json,
    err_console,
    out_console,
    size,
    table,
)

_HEX = frozenset("0123456789abcdef")


def read_targets(given: list[str]) -> tuple[list[str], bool]:
    """The targets, with ``-`` replaced by whitespace-separated ones read from stdin (once);
    and whether stdin was read."""
    targets: list[str] = []
    stdin_used = False
    for t in given:
        if t == "-":
            if not stdin_used:
                targets.extend(sys.stdin.read().split())
                stdin_used = True
        else:
            targets.extend(t.split())
    return targets, stdin_used


def expand_model_ids(store: str | None, targets: list[str]) -> tuple[list[str], list[str]]:
    """Targets that are not hex (``meta-llama/Llama-3.1-8B``) name every namespace of that
    model id: replaced by their ids. Returns the targets and the model ids matching none."""
    names = [t for t in targets if not set(t.strip().lower()) <= _HEX]
    if not names:
        return targets, []
    from kvstore.admin import list_namespaces

    items = list_namespaces(store, include_empty=True).items
    out: list[str] = []
    missing: list[str] = []
    for t in targets:
        if t not in names:
            out.append(t)
            continue
        ids = [e.namespace_id for e in items if e.model_id == t]
        if ids:
            out.extend(ids)
        else:
            missing.append(t)
    if missing:
        models = sorted({e.model_id for e in items if e.model_id and e.blocks})
        here = ", ".join(repr(m) for m in models[:8]) + (" ..." if len(models) > 8 else "")
        for t in missing:
            print(f"kvstore rm: no namespace of model {t!r} in the store"
                  + (f" (models here: {here})" if models else " (it holds none)"),
                  file=sys.stderr)
    return out, missing


def _show_plan(con, plan, *, dry_run: bool, daemon: str | None) -> None:
    if plan.namespaces:
        con.print(table([("ID", "left"), ("MODEL", "left"), ("BLOCKS", "right"),
                         ("SIZE", "right")],
                        [(n.namespace_id[:12], n.model_id or "?", str(n.blocks),
                          size(n.stored_bytes)) for n in plan.namespaces],
                        wrap=("MODEL",), title="namespaces (all their blocks)"))
    if plan.blocks:
        shown = plan.blocks[:20]
        more = len(plan.blocks) - len(shown)
        con.print(f"blocks named: {len(plan.blocks)}"
                  + (f" (first {len(shown)} listed)" if more else ""))
        for k in shown:
            con.print(f"  {k}")
    if plan.descendants:
        con.print(f"+ {plan.descendants} descendant block(s) of the named blocks, removed "
                  "too so the store stays prefix-closed (without their parent they could "
                  "never be looked up)")
    con.print(f"{'Would remove' if dry_run else 'Will remove'} {len(plan.keys)} "
              f"block(s): {size(plan.stored_bytes)} ({size(plan.raw_bytes)} raw).")
    if daemon is not None:
        con.print(f"The kvstore daemon at {daemon} serves this store: the removal goes "
                  "through it, so its memory drops the blocks too (also those of the "
                  "named namespaces that are not on disk yet).")


def _show_result(con, res) -> None:
    late = (f" (including {res.late_descendants} written meanwhile under removed blocks)"
            if res.late_descendants else "")
    via = (f" through the daemon at {res.daemon} (from its memory and the disk)"
           if res.daemon else "")
    con.print(f"Removed {res.removed_blocks} block(s){late}{via}, {size(res.freed_bytes)} on "
              f"disk; {size(res.released_bytes)} of segment files released now.")
    if res.dead_bytes:
        con.print(f"{size(res.dead_bytes)} of dead bytes remain in partly used segments: "
                  "'kvstore compact' reclaims them.")


def run_rm(args: argparse.Namespace) -> int:
    from kvstore.admin import execute_removal, plan_removal, preview_removal
    from kvstore.admin.common import serving_socket

    targets, stdin_used = read_targets(args.targets)
    targets, unknown_models = expand_model_ids(args.store, targets)
    plan = plan_removal(args.store, targets)
    for t in plan.not_found:
        print(f"kvstore rm: no namespace or block matches {t!r} (already removed?)",
              file=sys.stderr)
    status = EXIT_FINDINGS if plan.not_found or unknown_models else EXIT_OK
    human = args.format != "json"
    con = out_console() if human else err_console()
    # a serving daemon may hold blocks of a named namespace that are not on disk yet
    daemon = serving_socket(args.store) if plan.keys or plan.namespaces else None
    if not plan.keys and daemon is None:
        if human:
            con.print("Nothing to remove.")
        else:
            emit_json("rm", preview_removal(plan, dry_run=args.dry_run))
        return status
    if human:
        _show_plan(con, plan, dry_run=args.dry_run, daemon=daemon)
    if args.dry_run:
        if not human:
            emit_json("rm", preview_removal(plan))
        return status
    what = f"{len(plan.keys)} block(s) ({size(plan.stored_bytes)})"
    if not confirm("rm", f"Remove {what}{' through the daemon' if daemon else ''}?",
                   yes=args.yes, stdin_used=stdin_used):
        return EXIT_FINDINGS
    res = execute_removal(plan)
    if not human:
        emit_json("rm", res)
        return status
    _show_result(con, res)
    return status
