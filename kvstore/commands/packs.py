"""``kvstore export`` / ``kvstore import``: prefix packs (``docs/cli.md``, ``docs/operations.md``).

Exit status: 0 done (also: every block was already there); 1 the pack was refused (not a
pack, truncated, altered, another namespace than expected: nothing imported); 2 usage or
store error (no store, a namespace that matches nothing, nothing to export, the output
exists).
"""

from __future__ import annotations

import argparse

EXIT_OK, EXIT_REFUSED, EXIT_ERROR = 0, 1, 2

_EXPORT_EPILOG = """\
examples:
  kvstore export --store /var/cache/kvstore --namespace meta-llama/Llama-3.1-8B -o llama.kvpack
  kvstore export --namespace 74e27a29a9ec --prefix-of system_prompt.json -o sys.kvpack
"""
_IMPORT_EPILOG = """\
examples:
  kvstore import sys.kvpack --store /var/cache/kvstore
  kvstore import sys.kvpack --store /var/cache/kvstore --create \\
      --model meta-llama/Llama-3.1-8B --layout 'bfloat16 L32 P2 T16 H8 D128'
  kvstore import sys.kvpack --dry-run     # verify only
"""


def _bar(what: str):
    """A progress bar in MiB on stderr and its ``tick(done_bytes, total_bytes)``."""
    from kvstore.commands import output as o

    bar = o.progress(o.err_console(), what)
    task = bar.add_task(what, total=None, extra="MiB")

    def tick(done: int, total: int) -> None:
        bar.update(task, completed=done >> 20, total=max(1, total >> 20))

    return bar, tick


def _run_export(args: argparse.Namespace) -> int:
    from kvstore.admin.prompt_input import read_tokens
    from kvstore.commands import output as o
    from kvstore.packs import export_pack

    prefixes = [read_tokens(f) for f in args.prefix_of or ()]
    bar, tick = _bar("exporting")
    with bar:
        res = export_pack(args.store, args.namespace, args.output, prefixes=prefixes,
                          salt=args.salt, overwrite=args.force, progress=tick)
    if args.format == "json":
        o.emit_json("export", res)
        return EXIT_OK
    con = o.out_console()
    rate = res.data_bytes / res.seconds if res.seconds else 0
    con.print(f"Exported {res.blocks} block(s) of namespace {res.namespace_id[:12]} "
              f"({res.model_id}, {res.layout}) to {res.pack}: {o.size(res.pack_bytes)} in "
              f"{res.seconds:.2f} s ({o.size(int(rate))}/s).")
    if res.prompts:
        con.print(f"{res.prompts} prompt(s)" + (
            f"; {res.prompt_blocks_missing} of their full blocks are not in the store (not "
            "exported: 'kvstore explain' says why)" if res.prompt_blocks_missing else
            ": every full block exported") + ".")
    if res.unreachable:
        con.print(f"{res.unreachable} unreachable block(s) left out (their parent is not on "
                  "disk, so no lookup can reach them).")
    if res.damaged:
        con.print(f"{res.damaged} damaged block(s) left out with their descendants "
                  "('kvstore verify' finds them).")
    con.print(f"Next: copy it to each host and run 'kvstore import {res.pack} --store PATH'.")
    return EXIT_OK


def _expected(args: argparse.Namespace):
    from kvstore.admin.common import AdminError
    from kvstore.commands.args import namespace_fields_of

    if args.expect_namespace is not None:
        if args.model or args.layout:
            raise AdminError("give either --expect-namespace or --model/--layout, not both")
        return args.expect_namespace
    if args.model or args.layout:
        if not (args.model and args.layout):
            raise AdminError("--model and --layout go together (the namespace the engines "
                             "open the store with)")
        return namespace_fields_of(args)
    return None


def _run_import(args: argparse.Namespace) -> int:
    from kvstore.commands import output as o
    from kvstore.packs import PackError, import_pack

    expect = _expected(args)
    bar, tick = _bar("verifying")

    def phase(what: str, done: int, total: int) -> None:
        if what == "verify":
            tick(done, total)

    try:
        with bar:
            res = import_pack(args.pack, args.store, expect=expect, create=args.create,
                              dry_run=args.dry_run, progress=phase)
    except PackError as e:
        if e.kind in ("exists", "empty", "missing"):
            raise
        o.error("import", f"{e} (refused: {e.kind})")
        return EXIT_REFUSED
    if args.format == "json":
        o.emit_json("import", res)
        return EXIT_OK
    con = o.out_console()
    what = f"namespace {res.namespace_id[:12]} ({res.model_id}, {res.layout})"
    if res.dry_run:
        con.print(f"{res.pack} verified: {res.blocks} block(s) of {what}, "
                  f"{o.size(res.data_bytes)}; {res.blocks - res.present} would be imported "
                  f"into {res.store}, {res.present} are there already. Nothing written.")
        return EXIT_OK
    made = " (store created)" if res.created_store else ""
    con.print(f"Verified and imported {res.imported} block(s) of {what} into {res.store}"
              f"{made}; {res.present} were there already. {o.size(res.data_bytes)} in "
              f"{res.seconds:.2f} s.")
    return EXIT_OK


def _namespace_args(p: argparse.ArgumentParser) -> None:
    from kvstore.commands.args import add_namespace_fields

    g = p.add_argument_group("expected namespace (refuse a pack of any other)")
    g.add_argument("--expect-namespace", metavar="ID|MODEL",
                   help="namespace id (prefix, >= 4 hex digits) or model id the pack must hold")
    add_namespace_fields(g, model_help="the model_id the engines pass")


def register(sub: argparse._SubParsersAction) -> None:
    from kvstore.commands.args import Formatter, add_format, add_store
    from kvstore.commands.output import guard

    p = sub.add_parser(
        "export", help="write a namespace's blocks (or a prompt's prefix) as a pack file",
        description="Write the blocks of one namespace — all of them, or with --prefix-of "
        "the leading blocks of given prompts — to a self-describing, checksummed pack (one "
        "safetensors file) that 'kvstore import' loads into another store. Read-only on the "
        "store: safe while engines run.", epilog=_EXPORT_EPILOG, formatter_class=Formatter)
    add_store(p)
    p.add_argument("--namespace", required=True, metavar="ID|MODEL",
                   help="namespace id (or unique prefix, >= 4 hex digits) or exact model id")
    p.add_argument("--prefix-of", action="append", metavar="FILE",
                   help="only the blocks of this prompt (token ids as JSON, like 'kvstore "
                   "explain --tokens-file'; repeatable, shared prefixes stored once)")
    p.add_argument("--salt", metavar="SALT", help="with --prefix-of: the prompts' cache salt")
    p.add_argument("-o", "--output", required=True, metavar="PACK", help="pack file to write")
    p.add_argument("--force", action="store_true", help="replace PACK if it exists")
    add_format(p)
    p.set_defaults(func=guard("export", _run_export))

    p = sub.add_parser(
        "import", help="verify a pack and load its blocks into a store",
        description="Verify a pack completely (header, length, manifest, every block's "
        "checksum; and the namespace, when --model/--layout or --expect-namespace say which "
        "it must be), then publish all its blocks at once: a refused pack imports nothing "
        "and exits 1. Engines and daemons using the store see the blocks at their next "
        "lookup.", epilog=_IMPORT_EPILOG, formatter_class=Formatter)
    p.add_argument("pack", metavar="PACK", help="pack file written by 'kvstore export'")
    add_store(p)
    p.add_argument("--create", action="store_true",
                   help="create the store if the path does not exist (or is an empty directory)")
    p.add_argument("--dry-run", action="store_true",
                   help="verify the pack and count what would be imported; write nothing")
    _namespace_args(p)
    add_format(p)
    p.set_defaults(func=guard("import", _run_import))
