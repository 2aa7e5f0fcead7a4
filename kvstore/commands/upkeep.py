"""``kvstore prune``, ``verify`` and ``compact``: keep a store clean (see ``docs/cli.md``)."""

from __future__ import annotations

import argparse

from kvstore.admin.findings import DEFAULT_GRACE_S
from kvstore.commands.output import (
    EXIT_FINDINGS,
    EXIT_OK,
    confirm,
    emit_json,
    err_console,
    out_console,
    progress,
    refuse_if_served,
    size,
    table,
)

#: at most this many ``unreachable`` (and ``loose_mode``) rows in a human table (a lost root
#: can orphan a whole tree; ``--format json`` lists every one)
_UNREACHABLE_ROWS = 20


def _finding_row(f, *, show_fixed: bool, show_action: bool) -> list[str]:
    where = f"block {f.key[:16]}" if f.key else f.path
    row = [f.kind, where, size(f.nbytes) if f.nbytes else "-"]
    if show_action:
        row.append(f.action)
    row.append(f.detail)
    if show_fixed:
        row.append("yes" if f.fixed else "no")
    return row


def findings_table(findings, *, show_fixed: bool, show_action: bool = False):
    cols = [("KIND", "left"), ("WHERE", "left"), ("SIZE", "right")]
    if show_action:
        cols.append(("ACTION", "left"))
    cols.append(("DETAIL", "left"))
    if show_fixed:
        cols.append(("FIXED", "left"))
    skip: set[int] = set()
    extra = []
    # a lost root can orphan a whole tree, an old store's modes every file: a few rows each
    for kind, action, what in (("unreachable", "drop", "unreachable block(s)"),
                               ("loose_mode", "chmod", "path(s) more open than promised")):
        many = [f for f in findings if f.kind == kind]
        if len(many) <= _UNREACHABLE_ROWS:
            continue
        skip.update(id(f) for f in many[_UNREACHABLE_ROWS:])
        more = len(many) - _UNREACHABLE_ROWS
        row = [kind, f"+ {more} more", size(sum(f.nbytes for f in many[_UNREACHABLE_ROWS:]))
               if kind == "unreachable" else "-"]
        if show_action:
            row.append(action)
        row.append(f"{len(many)} {what} in all; --format json lists every one")
        if show_fixed:
            row.append(f"{sum(1 for f in many if f.fixed)} of {len(many)}")
        extra.append(row)
    rows = [_finding_row(f, show_fixed=show_fixed, show_action=show_action)
            for f in findings if id(f) not in skip] + extra
    return table(cols, rows, wrap=("WHERE", "DETAIL"))


def young_note(con, young: int, grace: float) -> None:
    if not young:
        return
    if grace < DEFAULT_GRACE_S:  # kvstore.admin.reachability.unreachable_grace
        con.print(f"{young} unreachable block(s) written less than {DEFAULT_GRACE_S:g} s ago "
                  "are left alone: another process has the store open, and their parent may "
                  "still be in its memory on its way to disk; stop the engines (or wait) and "
                  "prune again to drop them.")
        return
    con.print(f"{young} unreachable block(s) written less than {grace:g} s ago are left "
              "alone (their parent may be a write in flight elsewhere); --grace 0 "
              "includes them.")


# -- prune -------------------------------------------------------------------------------------

def prune_items(res, *, fixed_only: bool = False) -> str:
    """``freed 9.3 KiB of files, 5 unreachable block(s) (5.0 KiB), 2 record(s) without
    payload`` for a prune result."""
    fs = [f for f in res.findings if f.action != "none" and (f.fixed or not fixed_only)]
    files = [f for f in fs if f.kind in ("orphan_segment", "temp_file")]
    recs = [f for f in fs if f.key is not None and f.kind != "unreachable"]
    parts = []
    if files or not fs:
        verb = "freed " if fixed_only else ""
        parts.append(f"{verb}{size(sum(f.nbytes for f in files))} of files")
    if recs:
        parts.append(f"{len(recs)} record(s) without usable payload "
                     f"({size(sum(f.nbytes for f in recs))})")
    if res.unreachable:
        parts.append(f"{res.unreachable} unreachable block(s) "
                     f"({size(res.unreachable_bytes)}; their parent is gone, so no lookup "
                     "can reach them)")
    if any(f.action == "rebuild" for f in fs):
        parts.append("side indexes rebuilt" if fixed_only else "side indexes to rebuild")
    return ", ".join(parts)


def _prune_preview(args: argparse.Namespace, con, human: bool):
    """Show what prune would do; the preview, and whether to stop here."""
    from kvstore.admin import prune

    preview = prune(args.store, dry_run=True, grace_s=args.grace)
    act = [f for f in preview.findings if f.action != "none"]
    if human:
        if preview.findings:
            con.print(findings_table(preview.findings, show_fixed=False))
        if not act:
            con.print("Nothing to prune.")
        else:
            con.print(f"{'Would remove' if args.dry_run else 'Will remove'} {len(act)} "
                      f"item(s): {prune_items(preview)} (files younger than "
                      f"{args.grace:g} s are left alone: they may be writes in flight).")
        young_note(con, preview.young_unreachable, args.grace)
    return preview, args.dry_run or not act, len(act)


def run_prune(args: argparse.Namespace) -> int:
    from kvstore.admin import prune

    if not args.dry_run and (rc := refuse_if_served("prune", args.store, "pruning")) is not None:
        return rc
    human = args.format != "json"
    con = out_console() if human else err_console()
    if args.dry_run or not args.yes:
        preview, stop, n = _prune_preview(args, con, human)
        if stop:
            if not human:
                emit_json("prune", preview)
            return EXIT_OK
        if not confirm("prune", f"Prune {n} item(s)?", yes=args.yes):
            return EXIT_FINDINGS
    res = prune(args.store, dry_run=False, grace_s=args.grace)
    if not human:
        emit_json("prune", res)
        return EXIT_OK
    if args.yes and res.findings:
        con.print(findings_table(res.findings, show_fixed=True))
    con.print(f"Pruned {res.removed} item(s): {prune_items(res, fixed_only=True)}."
              if res.removed else "Nothing pruned.")
    left = [f for f in res.findings if not f.fixed]
    if left:
        con.print(f"{len(left)} item(s) left alone (see above; unknown files are never "
                  "touched).")
    if args.yes:
        young_note(con, res.young_unreachable, args.grace)
    return EXIT_OK


# -- verify ------------------------------------------------------------------------------------

def plan_summary(plan, *, verb: str) -> str:
    """``Will drop 1 damaged block(s) (1.0 KiB; they become misses), ...`` of a RepairPlan."""
    parts = []
    if plan.drop_blocks:
        parts.append(f"drop {plan.drop_blocks} damaged block(s) ({size(plan.drop_bytes)}; "
                     "they become misses)")
    if plan.unreachable_blocks:
        parts.append(f"drop {plan.unreachable_blocks} unreachable block(s) "
                     f"({size(plan.unreachable_bytes)}; below a missing or dropped block)")
    if plan.repair_blocks:
        parts.append(f"repair {plan.repair_blocks} intact block(s) ({size(plan.repair_bytes)}) "
                     f"of {plan.repair_segments} segment(s) with a damaged header, rewriting "
                     "them into a fresh segment")
    if plan.remove_files:
        parts.append(f"remove {plan.remove_files} orphan or temp file(s) "
                     f"({size(plan.remove_file_bytes)})")
    if plan.rebuild_index:
        parts.append("rebuild the side indexes")
    if plan.chmod_paths:
        parts.append(f"set the modes of {plan.chmod_paths} file(s) or directory(ies) more "
                     "open than the store promises")
    return f"{verb} " + "; ".join(parts) + "."


def _verify_read(args: argparse.Namespace):
    from kvstore.admin import verify

    with progress(err_console(), "verifying blocks") as bar:
        task = bar.add_task("verify", total=None, extra="")

        def tick(done: int, total: int, done_b: int, total_b: int) -> None:
            bar.update(task, completed=done, total=total,
                       extra=f"{size(done_b)} / {size(total_b)}")

        return verify(args.store, grace_s=args.grace, progress=tick,  # read-only: the plan
                      namespace=args.namespace)


def _verify_report(args: argparse.Namespace, con, res, head: str) -> int:
    """Without --fix (or nothing to fix): the findings and what --fix would do."""
    if args.format == "json":
        emit_json("verify", res)
        return EXIT_OK if res.ok else EXIT_FINDINGS
    if not res.findings:
        con.print(f"{head}: no problems found.")
    else:
        con.print(findings_table(res.findings, show_fixed=True, show_action=True))
        hint = "" if res.plan.empty else (
            " 'kvstore verify --fix' shows what it would change and asks first "
            "(damaged blocks are dropped and become misses; intact blocks of a "
            "damaged segment header are rewritten).")
        con.print(f"{head}: {len(res.findings)} problem(s), 0 fixed, {res.unfixed} "
                  f"left.{hint}")
    young_note(con, res.plan.young_unreachable, args.grace)
    return EXIT_OK if res.ok else EXIT_FINDINGS


def _verify_fix(args: argparse.Namespace, con, res, head: str) -> int:
    """--fix: show the plan, ask, carry it out (with -y the result's table shows it all)."""
    from kvstore.admin import repair

    human = args.format != "json"
    if human:
        if not args.yes or args.dry_run:
            con.print(findings_table(res.findings, show_fixed=False, show_action=True))
        con.print(f"{head}: {len(res.findings)} problem(s).")
        con.print(plan_summary(res.plan, verb="Would" if args.dry_run else "Will"))
        young_note(con, res.plan.young_unreachable, args.grace)
    n = len([f for f in res.findings if f.action != "none"])
    if args.dry_run or not confirm("verify", f"Fix {n} problem(s) as listed?", yes=args.yes):
        if not human:
            emit_json("verify", res)
        return EXIT_FINDINGS
    done = repair(res)
    status = EXIT_OK if done.ok else EXIT_FINDINGS
    if not human:
        emit_json("verify", done)
        return status
    left = [f for f in done.findings if not f.fixed]
    if args.yes or left:  # asked: the plan is on the screen already; show what is left
        con.print(findings_table(done.findings if args.yes else left, show_fixed=True,
                                 show_action=True))
    fixed = len(done.findings) - done.unfixed
    con.print(f"Fixed {fixed} of {len(done.findings)} problem(s), {done.unfixed} left."
              + (" Unknown files are never touched: remove them yourself." if any(
                  f.kind == "unknown_file" for f in done.findings) else ""))
    return status


def run_verify(args: argparse.Namespace) -> int:
    if args.fix and not args.dry_run and (
            rc := refuse_if_served("verify", args.store, "fixing it")) is not None:
        return rc
    res = _verify_read(args)
    con = out_console() if args.format != "json" else err_console()
    head = (f"Verified {res.blocks_checked} block(s) ({size(res.bytes_checked)}) in "
            f"{res.segments_checked} segment(s)")
    if not (args.fix or args.dry_run) or res.plan.empty:
        return _verify_report(args, con, res, head)
    return _verify_fix(args, con, res, head)


# -- compact -----------------------------------------------------------------------------------

def run_compact(args: argparse.Namespace) -> int:
    from kvstore.admin import compact

    if (rc := refuse_if_served("compact", args.store, "compacting it")) is not None:
        return rc
    with progress(err_console(), "compacting segments") as bar:
        task = bar.add_task("compact", total=None, extra="")

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        res = compact(args.store, threshold=args.threshold, progress=tick)
    if args.format == "json":
        emit_json("compact", res)
        return EXIT_OK
    con = out_console()
    if not res.segments_rewritten:
        con.print(f"Nothing to compact: no segment is below {res.threshold:.0%} live "
                  f"({size(res.dead_bytes_after)} dead in total).")
        return EXIT_OK
    con.print(f"Rewrote {res.segments_rewritten} segment(s), moved {res.blocks_moved} "
              f"block(s): {size(res.bytes_before)} -> {size(res.bytes_after)}, reclaimed "
              f"{size(res.reclaimed_bytes)} in {res.seconds:.1f} s.")
    con.print(f"Segment files {size(res.segment_bytes_before)} -> "
              f"{size(res.segment_bytes_after)}; dead bytes {size(res.dead_bytes_before)} -> "
              f"{size(res.dead_bytes_after)}.")
    return EXIT_OK
