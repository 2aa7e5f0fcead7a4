"""``kvstore recover``: rebuild a store's disk index from its segment files (``docs/cli.md``).

Exit status: 0 the index was rebuilt with every block of every segment (or it is intact:
nothing to do); 1 rebuilt, but some blocks or segments could not be recovered (listed); 2
usage or store error (no store, the store is open elsewhere).
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def _run(args: argparse.Namespace) -> int:
    from kvstore.admin.common import resolve_store_path
    from kvstore.commands import output as a
    from kvstore.tiers.disk.recover import recover

    store = resolve_store_path(args.store)
    err = a.err_console()
    with a.progress(err, "verifying segments") as bar:
        task = bar.add_task("recover", total=None, extra="")

        def tick(done_b: int, total_b: int, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total,
                       extra=f"{a.size(done_b)} / {a.size(total_b)}")

        res = recover(store, dry_run=args.dry_run, force=args.force, threads=args.threads,
                      progress=tick)
    status = EXIT_OK if res.ok else EXIT_FINDINGS
    if args.format == "json":
        a.emit_json("recover", res)
        return status
    con = a.out_console()
    if res.index_state == "intact":
        con.print(f"The index of {res.store} is intact ({res.segments} segment file(s)): "
                  "nothing to recover. --force rebuilds it anyway (access times and hit "
                  "counts are lost, blocks removed since their segment was written come back).")
        return EXIT_OK
    shown = [f for f in res.findings if f.kind != "temp_file"]
    if shown:
        rows = [(f.kind, f"block {f.key[:16]}" if f.key else f.path, f.detail) for f in shown]
        con.print(a.table([("KIND", "left"), ("WHERE", "left"), ("DETAIL", "left")], rows,
                           wrap=("WHERE", "DETAIL")))
        con.print()
    why = f" ({res.index_problem})" if res.index_problem else ""
    con.print(f"Index: {res.index_state}{why}.")
    rate = res.read_bytes_per_s
    con.print(f"Segments: {res.segments} file(s), {res.segments_skipped} unreadable; read and "
              f"verified {a.size(res.bytes_read)} in {res.read_seconds:.2f} s"
              + (f" ({a.size(int(rate))}/s)." if rate else "."))
    verb = "Would recover" if res.dry_run else "Recovered"
    con.print(f"{verb} {res.blocks_recovered} block(s) ({a.size(res.stored_bytes)}) of "
              f"{res.blocks_found} in the segment headers: {res.blocks_bad} bad (not "
              f"recovered), {res.duplicates} duplicate copies left as dead bytes.")
    con.print(f"Namespaces: {res.namespaces} record(s) salvaged from the old index"
              + (f", {len(res.namespaces_missing)} lost (re-registered when an engine opens the "
                 "store with that model; until then do not run `kvstore prune` or "
                 "`verify --fix`)" if res.namespaces_missing else "") + ".")
    if res.done:
        where = (f"; the old index is in {res.damaged_index}" if res.damaged_index else "")
        con.print(f"New index in place (next segment id {res.next_segment}){where}. "
                  "'kvstore verify' checks it; engines can start again.")
    elif res.dry_run:
        con.print("Dry run: nothing written.")
    temps = sum(1 for f in res.findings if f.kind == "temp_file")
    if temps:
        con.print(f"{temps} temp file(s) of interrupted writes left alone ('kvstore prune' "
                  "removes them).")
    return status


def register(sub: argparse._SubParsersAction) -> None:
    from kvstore.commands.args import Formatter, add_format, add_store, examples, integer

    p = sub.add_parser(
        "recover", help="rebuild the disk index from the segment files",
        formatter_class=Formatter,
        epilog=examples("kvstore recover --store ~/.cache/kvstore --dry-run",
                        "kvstore recover --store ~/.cache/kvstore",
                        "kvstore recover --force --threads 2 --format json"),
        description="Rebuild a store's disk index from its segment files when the index is "
        "missing or damaged (the engines refuse to open such a store and name this command). "
        "Every block's bytes are read and verified; the old index is kept as "
        "index.damaged-<time>/. Stop every engine using the store first.")
    add_store(p)
    p.add_argument("--dry-run", action="store_true",
                   help="read and verify everything, write nothing")
    p.add_argument("--force", action="store_true",
                   help="rebuild even when the index is intact")
    p.add_argument("--threads", type=integer(minimum=1), metavar="N",
                   help="reading threads (default: the CPU count, at most 4)")
    add_format(p)

    def run(args: argparse.Namespace) -> int:
        from kvstore.commands.output import os_error_text
        from kvstore.errors import KVStoreError

        try:
            return _run(args)
        except KVStoreError as e:
            print(f"kvstore recover: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        except BrokenPipeError:
            raise  # the reader went away: kvstore.cli ends quietly
        except OSError as e:
            print(f"kvstore recover: error: {os_error_text(e)}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            print("kvstore recover: interrupted (the old index is untouched)", file=sys.stderr)
            return 130

    p.set_defaults(func=run)
