"""``kvstore ls / inspect / rm / prune / verify / compact / stats``: see what a store holds and
clean it without stopping the engines. Thin over :mod:`kvstore.admin`; see ``docs/cli.md``.

Exit status: 0 ok; 1 findings (verify), refused or declined (rm, prune, verify --fix), targets
not found (rm); 2 usage or store error, or a daemon serves the store (prune, verify --fix,
compact).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
_SCHEMA = "kvstore.{}/1"


# -- shared plumbing ---------------------------------------------------------------------------

def _out_console():
    from rich.console import Console

    c = Console(file=sys.stdout, highlight=False, soft_wrap=False)
    if not c.is_terminal:
        c = Console(file=sys.stdout, highlight=False, soft_wrap=False, width=220)
    return c


def _err_console():
    from rich.console import Console

    return Console(file=sys.stderr, highlight=False)


def _error(cmd: str, msg: str) -> int:
    print(f"kvstore {cmd}: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def _emit_json(cmd: str, obj: Any, *, indent: int | None = 2) -> None:
    from kvstore.admin import to_jsonable

    data = {"schema": _SCHEMA.format(cmd), **to_jsonable(obj)}
    print(json.dumps(data, indent=indent))


def _guard(cmd: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Map library errors to exit status 2 with a one-line message."""

    def run(args: argparse.Namespace) -> int:
        from kvstore.errors import KVStoreError

        try:
            return fn(args)
        except KVStoreError as e:
            return _error(cmd, str(e))
        except OSError as e:
            return _error(cmd, f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        except KeyboardInterrupt:
            print(f"kvstore {cmd}: interrupted", file=sys.stderr)
            return 130

    return run


def _confirm(cmd: str, question: str, *, yes: bool, stdin_used: bool = False) -> bool:
    """True to go ahead. Without ``-y`` asks on the terminal; refuses without one."""
    if yes:
        return True
    if stdin_used or not sys.stdin.isatty():
        why = "targets were read from stdin" if stdin_used else "stdin is not a terminal"
        print(f"kvstore {cmd}: refusing to go ahead without confirmation ({why}); pass -y "
              "(--yes) to confirm, or --dry-run to only see what would happen", file=sys.stderr)
        return False
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        print("Nothing changed.", file=sys.stderr)
        return False
    return True


def _size(n: int | None) -> str:
    from kvstore.sizes import format_size

    return "unknown" if n is None else format_size(n)


def _short(h: str | None, n: int = 12) -> str:
    return "-" if h is None else h[:n]


def _add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", metavar="PATH",
                   help="store directory (default: $KVSTORE_PATH or ~/.cache/kvstore)")


def _add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=["table", "json"], default="table",
                   help="human table (default) or JSON for scripts (docs/cli.md has the schema)")


# -- ls ----------------------------------------------------------------------------------------

def _table(cols, rows, *, wrap=(), title: str | None = None, width: int | None = None,
           drop=()):
    """An aligned table without borders. Columns not in ``wrap`` never wrap nor shrink below
    their widest cell; those in ``wrap`` fold when the terminal is narrow. When the table
    cannot fit ``width``, the columns in ``drop`` are left out, in that order, until it does
    (``--format json`` has everything)."""
    from rich.table import Table

    rows = [list(r) for r in rows]
    widths = [max([len(c[0])] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    want = [min(w, 24) if cols[i][0] in wrap else w for i, w in enumerate(widths)]
    keep = list(range(len(cols)))
    if width is not None:
        for name in drop:
            if sum(want[i] for i in keep) + 2 * (len(keep) - 1) <= width:
                break
            keep = [i for i in keep if cols[i][0] != name]
    t = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
    for i in keep:
        name, just = cols[i]
        if name in wrap:
            t.add_column(name, justify=just, overflow="fold")
        else:
            t.add_column(name, justify=just, no_wrap=True, min_width=widths[i])
    for r in rows:
        t.add_row(*[r[i] for i in keep])
    return t


def _namespace_table(items, now: float, title: str | None = None,
                     width: int | None = None):
    from kvstore.admin import format_age

    cols = [("ID", "left"), ("MODEL", "left"), ("REVISION", "left"), ("LAYOUT", "left"),
            ("BLOCKS", "right"), ("SIZE", "right"), ("TIERS", "left"),
            ("LAST ACCESSED", "left"), ("HITS", "right")]
    rows = [(e.namespace_id[:12], e.model_id or "?", e.model_revision or "-", e.layout,
             str(e.blocks), _size(e.stored_bytes), ",".join(e.tiers) or "-",
             format_age(e.last_accessed, now), str(e.hits)) for e in items]
    drop = ("REVISION", "TIERS", "HITS", "BLOCKS")
    return _table(cols, rows, wrap=("MODEL", "REVISION", "LAYOUT"), title=title, width=width,
                  drop=drop)


def _block_table(items, now: float, width: int | None = None):
    from kvstore.admin import format_age

    cols = [("KEY", "left"), ("NAMESPACE", "left"), ("MODEL", "left"), ("PARENT", "left"),
            ("STORED", "right"), ("RAW", "right"), ("CODEC", "left"), ("SEGMENT", "right"),
            ("CREATED", "left"), ("LAST ACCESSED", "left"), ("HITS", "right")]
    rows = [(e.key[:16], e.namespace_id[:12], e.model_id or "?", _short(e.parent, 16),
             _size(e.stored_bytes), _size(e.raw_bytes), e.codec, f"{e.segment:x}",
             format_age(e.created, now), format_age(e.last_accessed, now), str(e.hits))
            for e in items]
    drop = ("CREATED", "RAW", "NAMESPACE", "CODEC", "SEGMENT", "HITS", "PARENT")
    return _table(cols, rows, wrap=("MODEL",), width=width, drop=drop)


def _run_ls(args: argparse.Namespace) -> int:
    from kvstore.admin import list_blocks, list_namespaces

    now = time.time()
    if args.blocks:
        res = list_blocks(args.store, filters=args.filter or (), sort=args.sort,
                          limit=args.limit, now=now)
    else:
        res = list_namespaces(args.store, filters=args.filter or (), sort=args.sort,
                              limit=args.limit, include_empty=args.all, now=now)
    if args.quiet:
        for i in res.ids:
            print(i)
        return EXIT_OK
    if args.format == "json":
        _emit_json("ls", res)
        return EXIT_OK
    con = _out_console()
    what = "block" if args.blocks else "namespace"
    if not res.items:
        if res.total == 0:
            con.print(f"The store at {res.store} holds no blocks.")
        else:
            con.print(f"No {what}s match ({res.total} in the store).")
        return EXIT_OK
    con.print(_block_table(res.items, now, con.width) if args.blocks
              else _namespace_table(res.items, now, width=con.width))
    shown = "" if len(res.items) == res.matched else f", {len(res.items)} shown"
    if args.blocks:
        con.print(f"\nFound {res.matched} block(s){shown}: {_size(res.stored_bytes)} on disk.")
    else:
        blocks = sum(e.blocks for e in res.items)
        con.print(f"\nFound {res.matched} namespace(s){shown}: {blocks} block(s), "
                  f"{_size(res.stored_bytes)} on disk.")
    return EXIT_OK


# -- inspect -----------------------------------------------------------------------------------

def _run_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    from kvstore.admin import inspect_store

    s = inspect_store(args.store)
    if args.format == "json":
        _emit_json("inspect", s)
        return EXIT_OK
    now = time.time()
    con = _out_console()
    d = s.tiers[0]
    f = s.fragmentation
    kv = Table.grid(padding=(0, 2))
    kv.add_column(style="bold", no_wrap=True)
    kv.add_column()
    kv.add_row("store", s.path)
    kv.add_row("format", f"disk format version {s.format_version}")
    kv.add_row("disk tier", f"{d.blocks} blocks, {_size(d.used_bytes)} stored "
               f"({_size(d.raw_bytes)} raw); capacity not recorded in the store "
               "(the engines' disk_capacity setting)")
    kv.add_row("disk files", f"{_size(d.file_bytes)} (segments + index); filesystem "
               f"{_size(d.filesystem_free_bytes)} free of {_size(d.filesystem_bytes)}")
    kv.add_row("memory tiers", "held by the processes that have the store open: "
               "kvstore stats --socket S for a daemon's")
    kv.add_row("segments", f"{f.segments} files, {_size(f.segment_bytes)}: "
               f"{_size(f.live_bytes)} live, {_size(f.dead_bytes)} dead "
               f"({f.live_fraction:.1%} live)")
    kv.add_row("fragmentation", f"{f.sparse_segments} segment(s) below "
               f"{f.sparse_threshold:.0%} live, {_size(f.reclaimable_bytes)} reclaimable "
               "(kvstore compact)")
    kv.add_row("leftovers", f"{f.temp_files} temp file(s), {f.unreferenced_segments} "
               f"unreferenced segment(s) ({_size(f.unreferenced_bytes)}) (kvstore prune; "
               "recent ones may be writes in flight)")
    kv.add_row("index", f"{s.index.path}: {_size(s.index.file_bytes)}, {s.index.blocks} "
               f"blocks, {s.index.namespaces} namespace(s)")
    misses = "counted only while running (kvstore stats --socket S)" if s.counters.misses is None \
        else str(s.counters.misses)
    kv.add_row("counters", f"{s.counters.hits} hits persisted on blocks; misses {misses}")
    con.print(kv)
    if s.namespaces:
        con.print()
        con.print(_namespace_table(s.namespaces, now, width=con.width))
    return EXIT_OK


# -- rm ----------------------------------------------------------------------------------------

def _run_rm(args: argparse.Namespace) -> int:
    from kvstore.admin import execute_removal, plan_removal
    from kvstore.admin.common import serving_socket
    from kvstore.admin.maintenance import preview_removal

    targets: list[str] = []
    stdin_used = False
    for t in args.targets:
        if t == "-":
            if not stdin_used:
                targets.extend(sys.stdin.read().split())
                stdin_used = True
        else:
            targets.extend(t.split())
    plan = plan_removal(args.store, targets)
    err = _err_console()
    for t in plan.not_found:
        print(f"kvstore rm: no namespace or block matches {t!r} (already removed?)",
              file=sys.stderr)
    status = EXIT_FINDINGS if plan.not_found else EXIT_OK
    human = args.format != "json"
    con = _out_console() if human else err
    # a serving daemon may hold blocks of a named namespace that are not on disk yet
    daemon = serving_socket(args.store) if plan.keys or plan.namespaces else None
    if not plan.keys and daemon is None:
        if human:
            con.print("Nothing to remove.")
        else:
            _emit_json("rm", preview_removal(plan, dry_run=args.dry_run))
        return status
    if human:
        if plan.namespaces:
            t = _table([("ID", "left"), ("MODEL", "left"), ("BLOCKS", "right"),
                        ("SIZE", "right")],
                       [(n.namespace_id[:12], n.model_id or "?", str(n.blocks),
                         _size(n.stored_bytes)) for n in plan.namespaces],
                       wrap=("MODEL",), title="namespaces (all their blocks)")
            con.print(t)
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
        con.print(f"{'Would remove' if args.dry_run else 'Will remove'} {len(plan.keys)} "
                  f"block(s): {_size(plan.stored_bytes)} ({_size(plan.raw_bytes)} raw).")
        if daemon is not None:
            con.print(f"The kvstore daemon at {daemon} serves this store: the removal goes "
                      "through it, so its memory drops the blocks too (also those of the "
                      "named namespaces that are not on disk yet).")
    if args.dry_run:
        if not human:
            _emit_json("rm", preview_removal(plan))
        return status
    what = f"{len(plan.keys)} block(s) ({_size(plan.stored_bytes)})"
    if not _confirm("rm", f"Remove {what}{' through the daemon' if daemon else ''}?",
                    yes=args.yes, stdin_used=stdin_used):
        return EXIT_FINDINGS
    res = execute_removal(plan)
    if not human:
        _emit_json("rm", res)
        return status
    late = (f" (including {res.late_descendants} written meanwhile under removed blocks)"
            if res.late_descendants else "")
    via = (f" through the daemon at {res.daemon} (from its memory and the disk)"
           if res.daemon else "")
    con.print(f"Removed {res.removed_blocks} block(s){late}{via}, {_size(res.freed_bytes)} on "
              f"disk; {_size(res.released_bytes)} of segment files released now.")
    if res.dead_bytes:
        con.print(f"{_size(res.dead_bytes)} of dead bytes remain in partly used segments: "
                  "'kvstore compact' reclaims them.")
    return status


# -- prune / verify findings -------------------------------------------------------------------

#: at most this many ``unreachable`` rows in a human table (a lost root can orphan a whole
#: tree; ``--format json`` lists every one)
_UNREACHABLE_ROWS = 20


def _findings_table(findings, *, show_fixed: bool, show_action: bool = False):
    cols = [("KIND", "left"), ("WHERE", "left"), ("SIZE", "right")]
    if show_action:
        cols.append(("ACTION", "left"))
    cols.append(("DETAIL", "left"))
    if show_fixed:
        cols.append(("FIXED", "left"))
    rows = []
    unreachable = [f for f in findings if f.kind == "unreachable"]
    shown = findings
    if len(unreachable) > _UNREACHABLE_ROWS:
        skip = {id(f) for f in unreachable[_UNREACHABLE_ROWS:]}
        shown = [f for f in findings if id(f) not in skip]
    for f in shown:
        where = f"block {f.key[:16]}" if f.key else f.path
        row = [f.kind, where, _size(f.nbytes) if f.nbytes else "-"]
        if show_action:
            row.append(f.action)
        row.append(f.detail)
        if show_fixed:
            row.append("yes" if f.fixed else "no")
        rows.append(row)
    more = len(findings) - len(shown)
    if more:
        n = more + _UNREACHABLE_ROWS
        row = ["unreachable", f"+ {more} more", _size(sum(f.nbytes for f in unreachable[
            _UNREACHABLE_ROWS:]))]
        if show_action:
            row.append("drop")
        row.append(f"{n} unreachable block(s) in all; --format json lists every one")
        if show_fixed:
            fixed = sum(1 for f in unreachable if f.fixed)
            row.append(f"{fixed} of {n}")
        rows.append(row)
    return _table(cols, rows, wrap=("WHERE", "DETAIL"))


def _grace(text: str) -> float:
    """``--grace``: seconds, a number >= 0 (argparse type: a usage error otherwise)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v >= 0:  # also NaN
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds >= 0 (got {text}): files and blocks younger than "
            "this are left alone because another process may be writing them")
    return v


def _refuse_if_served(cmd: str, store: str | None, what: str) -> int | None:
    """Exit status 2 with a one-line message when a daemon serves the store, else None."""
    from kvstore.admin.common import StoreServedError, refuse_if_served

    try:
        refuse_if_served(store, what)
    except StoreServedError as e:
        return _error(cmd, str(e))
    return None


def _run_prune(args: argparse.Namespace) -> int:
    from kvstore.admin import prune

    if not args.dry_run and (rc := _refuse_if_served("prune", args.store, "pruning")) is not None:
        return rc
    human = args.format != "json"
    con = _out_console() if human else _err_console()
    if args.dry_run or not args.yes:
        preview = prune(args.store, dry_run=True, grace_s=args.grace)
        act = [f for f in preview.findings if f.action != "none"]
        if human:
            if preview.findings:
                con.print(_findings_table(preview.findings, show_fixed=False))
            if not act:
                con.print("Nothing to prune.")
            else:
                con.print(f"{'Would remove' if args.dry_run else 'Will remove'} {len(act)} "
                          f"item(s): {_prune_items(preview)} (files younger than "
                          f"{args.grace:g} s are left alone: they may be writes in flight).")
            _young_note(con, preview.young_unreachable, args.grace)
        if args.dry_run or not act:
            if not human:
                _emit_json("prune", preview)
            return EXIT_OK
        if not _confirm("prune", f"Prune {len(act)} item(s)?", yes=args.yes):
            return EXIT_FINDINGS
    res = prune(args.store, dry_run=False, grace_s=args.grace)
    if not human:
        _emit_json("prune", res)
        return EXIT_OK
    if args.yes and res.findings:
        con.print(_findings_table(res.findings, show_fixed=True))
    con.print(f"Pruned {res.removed} item(s): {_prune_items(res, fixed_only=True)}."
              if res.removed else "Nothing pruned.")
    left = [f for f in res.findings if not f.fixed]
    if left:
        con.print(f"{len(left)} item(s) left alone (see above; unknown files are never "
                  "touched).")
    if args.yes:
        _young_note(con, res.young_unreachable, args.grace)
    return EXIT_OK


def _prune_items(res, *, fixed_only: bool = False) -> str:
    """``freed 9.3 KiB of files, 5 unreachable block(s) (5.0 KiB), 2 record(s) without
    payload`` for a prune result."""
    fs = [f for f in res.findings if f.action != "none" and (f.fixed or not fixed_only)]
    files = [f for f in fs if f.kind in ("orphan_segment", "temp_file")]
    recs = [f for f in fs if f.key is not None and f.kind != "unreachable"]
    parts = []
    if files or not fs:
        verb = "freed " if fixed_only else ""
        parts.append(f"{verb}{_size(sum(f.nbytes for f in files))} of files")
    if recs:
        parts.append(f"{len(recs)} record(s) without usable payload "
                     f"({_size(sum(f.nbytes for f in recs))})")
    if res.unreachable:
        parts.append(f"{res.unreachable} unreachable block(s) "
                     f"({_size(res.unreachable_bytes)}; their parent is gone, so no lookup "
                     "can reach them)")
    if any(f.action == "rebuild" for f in fs):
        parts.append("side indexes rebuilt" if fixed_only else "side indexes to rebuild")
    return ", ".join(parts)


def _young_note(con, young: int, grace: float) -> None:
    if young:
        con.print(f"{young} unreachable block(s) written less than {grace:g} s ago are left "
                  "alone (their parent may be a write in flight elsewhere); --grace 0 "
                  "includes them.")


def _progress(err, what: str):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[extra]}"), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err, transient=True,
                    disable=not err.is_terminal)


def _plan_summary(plan, *, verb: str) -> str:
    """``Will drop 1 damaged block(s) (1.0 KiB; they become misses), ...`` of a RepairPlan."""
    parts = []
    if plan.drop_blocks:
        parts.append(f"drop {plan.drop_blocks} damaged block(s) ({_size(plan.drop_bytes)}; "
                     "they become misses)")
    if plan.unreachable_blocks:
        parts.append(f"drop {plan.unreachable_blocks} unreachable block(s) "
                     f"({_size(plan.unreachable_bytes)}; below a missing or dropped block)")
    if plan.repair_blocks:
        parts.append(f"repair {plan.repair_blocks} intact block(s) ({_size(plan.repair_bytes)}) "
                     f"of {plan.repair_segments} segment(s) with a damaged header, rewriting "
                     "them into a fresh segment")
    if plan.remove_files:
        parts.append(f"remove {plan.remove_files} orphan or temp file(s) "
                     f"({_size(plan.remove_file_bytes)})")
    if plan.rebuild_index:
        parts.append("rebuild the side indexes")
    return f"{verb} " + "; ".join(parts) + "."


def _run_verify(args: argparse.Namespace) -> int:
    from kvstore.admin.maintenance import repair, verify

    fix = args.fix or args.dry_run
    if args.fix and not args.dry_run and (
            rc := _refuse_if_served("verify", args.store, "fixing it")) is not None:
        return rc
    err = _err_console()
    with _progress(err, "verifying blocks") as bar:
        task = bar.add_task("verify", total=None, extra="")

        def tick(done: int, total: int, done_b: int, total_b: int) -> None:
            bar.update(task, completed=done, total=total,
                       extra=f"{_size(done_b)} / {_size(total_b)}")

        res = verify(args.store, grace_s=args.grace, progress=tick)  # read-only: the plan
    human = args.format != "json"
    con = _out_console() if human else err
    head = (f"Verified {res.blocks_checked} block(s) ({_size(res.bytes_checked)}) in "
            f"{res.segments_checked} segment(s)")
    if not fix or res.plan.empty:
        if not human:
            _emit_json("verify", res)
        else:
            if res.findings:
                con.print(_findings_table(res.findings, show_fixed=True, show_action=True))
            if not res.findings:
                con.print(f"{head}: no problems found.")
            else:
                hint = "" if res.plan.empty else (
                    " 'kvstore verify --fix' shows what it would change and asks first "
                    "(damaged blocks are dropped and become misses; intact blocks of a "
                    "damaged segment header are rewritten).")
                con.print(f"{head}: {len(res.findings)} problem(s), 0 fixed, {res.unfixed} "
                          f"left.{hint}")
            _young_note(con, res.plan.young_unreachable, args.grace)
        return EXIT_OK if res.ok else EXIT_FINDINGS
    # --fix: show the plan, ask, carry it out (with -y the result's table shows it all)
    if human:
        if not args.yes or args.dry_run:
            con.print(_findings_table(res.findings, show_fixed=False, show_action=True))
        con.print(f"{head}: {len(res.findings)} problem(s).")
        con.print(_plan_summary(res.plan, verb="Would" if args.dry_run else "Will"))
        _young_note(con, res.plan.young_unreachable, args.grace)
    if args.dry_run:
        if not human:
            _emit_json("verify", res)
        return EXIT_FINDINGS
    n = len([f for f in res.findings if f.action != "none"])
    if not _confirm("verify", f"Fix {n} problem(s) as listed?", yes=args.yes):
        if not human:
            _emit_json("verify", res)
        return EXIT_FINDINGS
    done = repair(res)
    status = EXIT_OK if done.ok else EXIT_FINDINGS
    if not human:
        _emit_json("verify", done)
        return status
    left = [f for f in done.findings if not f.fixed]
    if args.yes or left:  # asked: the plan is on the screen already; show what is left
        con.print(_findings_table(done.findings if args.yes else left, show_fixed=True,
                                  show_action=True))
    fixed = len(done.findings) - done.unfixed
    con.print(f"Fixed {fixed} of {len(done.findings)} problem(s), {done.unfixed} left."
              + (" Unknown files are never touched: remove them yourself." if any(
                  f.kind == "unknown_file" for f in done.findings) else ""))
    return status


# -- compact -----------------------------------------------------------------------------------

def _run_compact(args: argparse.Namespace) -> int:
    from kvstore.admin import compact

    if (rc := _refuse_if_served("compact", args.store, "compacting it")) is not None:
        return rc
    err = _err_console()
    with _progress(err, "compacting segments") as bar:
        task = bar.add_task("compact", total=None, extra="")

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        res = compact(args.store, threshold=args.threshold, progress=tick)
    if args.format == "json":
        _emit_json("compact", res)
        return EXIT_OK
    con = _out_console()
    if not res.segments_rewritten:
        con.print(f"Nothing to compact: no segment is below {res.threshold:.0%} live "
                  f"({_size(res.dead_bytes_after)} dead in total).")
        return EXIT_OK
    con.print(f"Rewrote {res.segments_rewritten} segment(s), moved {res.blocks_moved} "
              f"block(s): {_size(res.bytes_before)} -> {_size(res.bytes_after)}, reclaimed "
              f"{_size(res.reclaimed_bytes)} in {res.seconds:.1f} s.")
    con.print(f"Segment files {_size(res.segment_bytes_before)} -> "
              f"{_size(res.segment_bytes_after)}; dead bytes {_size(res.dead_bytes_before)} -> "
              f"{_size(res.dead_bytes_after)}.")
    return EXIT_OK


# -- stats -------------------------------------------------------------------------------------

def _kv_grid(rows):
    from rich.table import Table

    kv = Table.grid(padding=(0, 2))
    kv.add_column(style="bold", no_wrap=True)
    kv.add_column(justify="right", no_wrap=True)
    for name, val in rows:
        kv.add_row(name, val)
    return kv


def _stats_renderable(res):
    from rich.console import Group
    from rich.table import Table

    from kvstore.admin import PathStats

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(res.time))
    if isinstance(res, PathStats):
        kv = _kv_grid((("blocks", str(res.blocks)), ("stored", _size(res.stored_bytes)),
                       ("raw", _size(res.raw_bytes)), ("segments", str(res.segments)),
                       ("segment files", _size(res.segment_bytes)),
                       ("dead", _size(res.dead_bytes)), ("hits (persisted)", str(res.hits))))
        t = Table(box=None, header_style="bold", pad_edge=False)
        for c, j in (("NAMESPACE", "left"), ("MODEL", "left"), ("BLOCKS", "right"),
                     ("SIZE", "right"), ("HITS", "right")):
            t.add_column(c, justify=j, no_wrap=True)
        for n in res.namespaces:
            t.add_row(n.namespace_id[:12], n.model_id or "?", str(n.blocks),
                      _size(n.stored_bytes), str(n.hits))
        return Group(f"[bold]{res.store}[/bold] at {stamp}", kv, "", t)
    parts: list[Any] = [f"[bold]daemon {res.socket}[/bold] at {stamp}"]
    for n in res.namespaces:
        st = n.stats
        parts += ["", f"[bold]{n.model_id}[/bold] {n.layout} (namespace {n.namespace_id[:12]})"]
        rows = [("lookups", str(st.lookups)), ("hits / misses (blocks)",
                                              f"{st.hits} / {st.misses}"),
                ("hit rate", f"{n.hit_rate:.1%}"), ("fetched blocks", str(st.fetched_blocks)),
                ("put blocks", str(st.put_blocks)), ("put dropped", str(st.put_dropped)),
                ("damaged", str(st.damaged)), ("pinned blocks", str(st.pinned_blocks)),
                ("dirty blocks", str(st.dirty_blocks))]
        if n.server is not None:
            sv = n.server
            rows += [("connections (daemon)", str(sv.connections)),
                     ("leases", str(sv.leases)),
                     ("free warm slots", f"{sv.free_warm_slots} of {sv.warm_slots}")]
        parts.append(_kv_grid(rows))
        t = Table(box=None, header_style="bold", pad_edge=False)
        for c, j in (("TIER", "left"), ("DEVICE", "left"), ("USED", "right"),
                     ("CAPACITY", "right"), ("BLOCKS", "right"), ("EVICTIONS", "right")):
            t.add_column(c, justify=j, no_wrap=True)
        for tier in st.tiers:
            t.add_row(tier.name, tier.device, _size(tier.used_bytes), _size(tier.capacity_bytes),
                      str(tier.blocks), str(tier.evictions))
        parts.append(t)
    return Group(*parts)


def _run_stats(args: argparse.Namespace) -> int:
    from kvstore.admin import daemon_stats, store_stats

    filters = args.filter or ()

    def sample():
        if args.socket:
            return daemon_stats(args.socket, args.store, filters=filters)
        return store_stats(args.store, filters=filters)

    if args.watch is None:
        res = sample()
        if args.format == "json":
            _emit_json("stats", res)
        else:
            _out_console().print(_stats_renderable(res))
        return EXIT_OK
    interval = max(0.1, float(args.watch))
    n = 0
    con = _out_console()
    while True:
        res = sample()
        if args.format == "json":
            _emit_json("stats", res, indent=None)
            sys.stdout.flush()
        else:
            if con.is_terminal:
                con.clear()
            else:
                con.rule()
            con.print(_stats_renderable(res))
        n += 1
        if args.count is not None and n >= args.count:
            return EXIT_OK
        time.sleep(interval)


# -- registration ------------------------------------------------------------------------------

_LS_EPILOG = """\
filters (-f, repeatable, all must match): KEY OP VALUE
  namespaces: id model revision dtype layout blocks size raw hits accessed created tier
  blocks:     key namespace model parent size raw codec segment hits accessed created tier
  operators:  = != (all)   ~ !~ (text: substring)   > >= < <= (sizes, counts, ages)
  examples:   size>1GB  accessed>7d (older than)  accessed<1h  model=meta-llama/Llama-3.1-8B
              model~llama  tier=disk  hits>=3  parent=none
sort: KEY[:asc|desc] (sizes/counts/ages default to desc: largest / most recent first)
"""


def register(sub: argparse._SubParsersAction) -> None:
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("ls", help="list namespaces (or blocks) in a store",
                       description="List the namespaces of a store (model, revision, layout, "
                       "blocks, bytes, tiers, last access, hits) or, with --blocks, its blocks.",
                       epilog=_LS_EPILOG, formatter_class=raw)
    _add_store(p)
    p.add_argument("--blocks", action="store_true", help="list blocks instead of namespaces")
    p.add_argument("-f", "--filter", action="append", metavar="FILTER",
                   help="KEY OP VALUE, e.g. 'size>1GB', 'accessed>7d' (repeatable)")
    p.add_argument("--sort", metavar="KEY[:asc|desc]", help="sort key, e.g. size, accessed:asc")
    p.add_argument("--limit", type=int, metavar="N", help="show at most N entries")
    p.add_argument("-a", "--all", action="store_true",
                   help="also list namespaces that hold no blocks")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only ids (namespace ids, or block keys with --blocks), one per line")
    _add_format(p)
    p.set_defaults(func=_guard("ls", _run_ls))

    p = sub.add_parser("inspect", help="summary of a store: format, use, fragmentation, index",
                       description="Summarize a store: format version, disk use and free "
                       "space, namespaces, segment fragmentation, index size, counters.")
    _add_store(p)
    _add_format(p)
    p.set_defaults(func=_guard("inspect", _run_inspect))

    p = sub.add_parser("rm", help="remove namespaces or blocks (with their descendants)",
                       description="Remove namespaces (all their blocks) or blocks. A removed "
                       "block's descendants on disk go too, so the store stays prefix-closed. "
                       "Asks for confirmation unless -y; refuses without a terminal.")
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="namespace id or block key, in full or a unique prefix (>= 4 hex "
                   "digits); '-' reads whitespace-separated targets from stdin")
    _add_store(p)
    p.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    _add_format(p)
    p.set_defaults(func=_guard("rm", _run_rm))

    p = sub.add_parser("prune", help="remove orphan segments, temp files, records without payload",
                       description="Remove segment files no record points at, temp files of "
                       "interrupted writes (both only when older than --grace), records whose "
                       "segment is missing or cut off, and undecodable records; rebuild "
                       "inconsistent side indexes. Reads no block data (see verify).")
    _add_store(p)
    p.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--grace", type=_grace, default=60.0, metavar="SECONDS",
                   help="leave files and unreachable blocks younger than this alone: another "
                   "process may be writing them (default: 60)")
    _add_format(p)
    p.set_defaults(func=_guard("prune", _run_prune))

    p = sub.add_parser("verify", help="check every block's checksum and the index/segments",
                       description="Read every block back and check its checksum, and check "
                       "the index against the segment files and for blocks no lookup can "
                       "reach. Exit status 1 when problems are found (and not fixed). --fix "
                       "shows what it would change and asks first (refuses without a "
                       "terminal unless -y).")
    _add_store(p)
    p.add_argument("--fix", action="store_true",
                   help="fix what was found, after showing the plan and asking: drop damaged "
                   "and unreachable blocks (they become misses), rewrite intact blocks of a "
                   "damaged segment header into a fresh segment, remove orphans, rebuild "
                   "indexes")
    p.add_argument("--dry-run", action="store_true",
                   help="only show what --fix would change")
    p.add_argument("-y", "--yes", action="store_true",
                   help="with --fix: do not ask for confirmation")
    p.add_argument("--grace", type=_grace, default=60.0, metavar="SECONDS",
                   help="unreferenced files and unreachable blocks younger than this are not "
                   "findings (default: 60)")
    _add_format(p)
    p.set_defaults(func=_guard("verify", _run_verify))

    p = sub.add_parser("compact", help="rewrite fragmented segments, reclaiming dead bytes",
                       description="Rewrite the segments whose live fraction is below the "
                       "threshold into new ones; readers elsewhere keep working.")
    _add_store(p)
    p.add_argument("--threshold", type=float, metavar="F",
                   help="rewrite segments less than this fraction live (0..1, default 0.5; "
                   "1.0 rewrites every segment with any dead byte)")
    _add_format(p)
    p.set_defaults(func=_guard("compact", _run_compact))

    p = sub.add_parser("stats", help="counters of a store path or a live daemon",
                       description="Counters of a store (disk totals, per-namespace counts) "
                       "or, with --socket, of a running daemon (lookups, hits, misses, memory "
                       "tiers), per namespace of the daemon's store (--store).")
    p.add_argument("--store", metavar="PATH",
                   help="store directory (default: $KVSTORE_PATH or ~/.cache/kvstore); with "
                   "--socket, the daemon's --path, whose namespaces are asked about")
    p.add_argument("--socket", metavar="S", help="Unix socket of a running 'kvstore serve'")
    p.add_argument("-f", "--filter", action="append", metavar="FILTER",
                   help="only namespaces passing this 'kvstore ls' filter (repeatable)")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                   help="repeat every SECONDS (default 2) until interrupted; JSON: one object "
                   "per line")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N samples")
    _add_format(p)
    p.set_defaults(func=_guard("stats", _run_stats))
