"""``kvstore ls / inspect / rm / prune / verify / compact / stats``: see what a store holds and
clean it without stopping the engines. The argparse tables; the commands themselves live in
:mod:`~kvstore.commands.listing`, :mod:`~kvstore.commands.removal`,
:mod:`~kvstore.commands.upkeep` and :mod:`~kvstore.commands.stats`, thin over
:mod:`kvstore.admin`; see ``docs/cli.md``.

Exit status: 0 ok; 1 findings (verify), refused or declined (rm, prune, verify --fix), targets
not found (rm); 2 usage or store error, or a daemon serves the store (prune, verify --fix,
compact).
"""

from __future__ import annotations

import argparse

from kvstore.commands import args as a
from kvstore.commands.output import EXIT_ERROR, EXIT_FINDINGS, EXIT_OK, guard

__all__ = ["EXIT_ERROR", "EXIT_FINDINGS", "EXIT_OK", "register"]

_LS_EPILOG = """\
filters (-f, repeatable, all must match): KEY OP VALUE
  namespaces: id model revision dtype layout blocks size raw hits accessed created tier
  blocks:     key namespace model parent size raw codec segment hits accessed created tier
  operators:  = != (all)   ~ !~ (text: substring)   > >= < <= (sizes, counts, ages)
  examples:   size>1GB  accessed>7d (older than)  accessed<1h  model=meta-llama/Llama-3.1-8B
              model~llama  tier=disk  hits>=3  parent=none
sort: KEY[:asc|desc] (sizes/counts/ages default to desc: largest / most recent first)
"""


def _parser(sub, name: str, help: str, description: str, epilog: str):
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=a.Formatter)


def _register_listing(sub) -> None:
    from kvstore.commands.listing import run_inspect, run_ls

    p = _parser(sub, "ls", "list namespaces (or blocks) in a store",
                "List the namespaces of a store (model, revision, layout, blocks, bytes, "
                "tiers, last access, hits) or, with --blocks, its blocks.",
                a.examples("kvstore ls --store ~/.cache/kvstore",
                           "kvstore ls --blocks -f 'size>1MiB' --sort accessed:asc --limit 20",
                           "kvstore ls -q -f 'accessed>30d' | kvstore rm - -y",
                           extra=_LS_EPILOG))
    a.add_store(p)
    p.add_argument("--blocks", action="store_true", help="list blocks instead of namespaces")
    p.add_argument("-f", "--filter", action="append", metavar="FILTER",
                   help="KEY OP VALUE, e.g. 'size>1GB', 'accessed>7d' (repeatable)")
    p.add_argument("--sort", metavar="KEY[:asc|desc]", help="sort key, e.g. size, accessed:asc")
    p.add_argument("--limit", type=a.integer(minimum=0), metavar="N",
                   help="show at most N entries")
    p.add_argument("-a", "--all", action="store_true",
                   help="also list namespaces that hold no blocks")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="print only ids (namespace ids, or block keys with --blocks), one per line")
    a.add_format(p)
    p.set_defaults(func=guard("ls", run_ls))

    p = _parser(sub, "inspect", "summary of a store, or every field of a namespace or block",
                "Summarize a store: format version, disk use and free space, namespaces, "
                "segment fragmentation, index size, counters. With TARGET: every field of the "
                "namespaces and blocks it names.",
                a.examples("kvstore inspect --store ~/.cache/kvstore",
                           "kvstore inspect --format json | jq .fragmentation",
                           "kvstore inspect 74e27a29a9ec  # a namespace (or block) by id prefix"))
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help="namespace id or block key, in full or a unique prefix (>= 4 hex "
                   "digits), or a model id: show every field of what it names")
    a.add_store(p)
    a.add_format(p)
    p.set_defaults(func=guard("inspect", run_inspect))


def _register_rm(sub) -> None:
    from kvstore.commands.removal import run_rm

    p = _parser(sub, "rm", "remove namespaces or blocks (with their descendants)",
                "Remove namespaces (all their blocks) or blocks. A removed block's descendants "
                "on disk go too, so the store stays prefix-closed. Asks for confirmation "
                "unless -y; refuses without a terminal. When a daemon serves the store the "
                "removal goes through it.",
                a.examples("kvstore rm 3f9a2c --dry-run",
                           "kvstore rm meta-llama/Llama-3.1-8B -y",
                           "kvstore ls -q -f 'accessed>30d' | kvstore rm - -y"))
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="namespace id or block key, in full or a unique prefix (>= 4 hex "
                   "digits); a model id (every namespace of that model); '-' reads "
                   "whitespace-separated targets from stdin")
    a.add_store(p)
    p.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    a.add_format(p)
    p.set_defaults(func=guard("rm", run_rm))


def _register_upkeep(sub) -> None:
    from kvstore.commands.upkeep import run_compact, run_prune, run_verify

    p = _parser(sub, "prune", "remove orphan segments, temp files, records without payload",
                "Remove segment files no record points at, temp files of interrupted writes "
                "(both only when older than --grace), records whose segment is missing or cut "
                "off, and undecodable records; rebuild inconsistent side indexes. Reads no "
                "block data (see verify).",
                a.examples("kvstore prune --dry-run", "kvstore prune -y --grace 300"))
    a.add_store(p)
    p.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--grace", type=a.grace, default=60.0, metavar="SECONDS",
                   help="leave files and unreachable blocks younger than this alone: another "
                   "process may be writing them (default: 60)")
    a.add_format(p)
    p.set_defaults(func=guard("prune", run_prune))

    p = _parser(sub, "verify", "check every block's checksum and the index/segments",
                "Read every block back and check its checksum, and check the index against "
                "the segment files and for blocks no lookup can reach. Exit status 1 when "
                "problems are found (and not fixed). --fix shows what it would change and "
                "asks first (refuses without a terminal unless -y).",
                a.examples("kvstore verify", "kvstore verify --fix --dry-run",
                           "kvstore verify --namespace meta-llama/Llama-3.1-8B",
                           "kvstore verify --fix -y --format json"))
    a.add_store(p)
    p.add_argument("--namespace", metavar="NS",
                   help="check only this namespace's blocks (an id, a unique prefix of >= 4 "
                   "hex digits, or a model id with one namespace); store-wide findings "
                   "(orphan files, side indexes) are left to a whole-store verify")
    p.add_argument("--fix", action="store_true",
                   help="fix what was found, after showing the plan and asking: drop damaged "
                   "and unreachable blocks (they become misses), rewrite intact blocks of a "
                   "damaged segment header into a fresh segment, remove orphans, rebuild "
                   "indexes")
    p.add_argument("--dry-run", action="store_true", help="only show what --fix would change")
    p.add_argument("-y", "--yes", action="store_true",
                   help="with --fix: do not ask for confirmation")
    p.add_argument("--grace", type=a.grace, default=60.0, metavar="SECONDS",
                   help="unreferenced files and unreachable blocks younger than this are not "
                   "findings (default: 60)")
    a.add_format(p)
    p.set_defaults(func=guard("verify", run_verify))

    p = _parser(sub, "compact", "rewrite fragmented segments, reclaiming dead bytes",
                "Rewrite the segments whose live fraction is below the threshold into new "
                "ones; readers elsewhere keep working. Refused while a daemon serves the "
                "store.",
                a.examples("kvstore compact", "kvstore compact --threshold 0.8"))
    a.add_store(p)
    p.add_argument("--threshold", type=float, metavar="F",  # checked by compact(): exit 2
                   help="rewrite segments less than this fraction live (0..1, default 0.5; "
                   "1.0 rewrites every segment with any dead byte)")
    a.add_format(p)
    p.set_defaults(func=guard("compact", run_compact))


def _register_stats(sub) -> None:
    from kvstore.commands.stats import run_stats

    p = _parser(sub, "stats", "counters of a store path or a live daemon",
                "Counters of a store (disk totals, per-namespace counts) or, with --socket, of "
                "a running daemon (lookups, hits, misses, memory tiers), per namespace of the "
                "store the daemon serves.",
                a.examples("kvstore stats --store ~/.cache/kvstore",
                           "kvstore stats --socket /run/kvstore/kvstore.sock --watch 5",
                           "kvstore stats --socket S -f model~llama --format json"))
    a.add_store(p, help="store directory (default: $KVSTORE_PATH or ~/.cache/kvstore); with "
                "--socket, the one the daemon serves (found from the socket when omitted)")
    p.add_argument("--socket", metavar="S", help="Unix socket of a running 'kvstore serve'")
    p.add_argument("-f", "--filter", action="append", metavar="FILTER",
                   help="only namespaces passing this 'kvstore ls' filter (repeatable)")
    p.add_argument("--watch", nargs="?", type=a.seconds(positive=True), const=2.0,
                   metavar="SECONDS", help="repeat every SECONDS (default 2) until "
                   "interrupted; JSON: one object per line")
    p.add_argument("--count", type=a.integer(minimum=1), metavar="N",
                   help="with --watch: stop after N samples")
    a.add_format(p)
    p.set_defaults(func=guard("stats", run_stats))


def register(sub: argparse._SubParsersAction) -> None:
    _register_listing(sub)
    _register_rm(sub)
    _register_upkeep(sub)
    _register_stats(sub)
