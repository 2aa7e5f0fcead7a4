"""``kvstore bench``: benchmarks against memcpy, raw disk and peers, as ratios.

Exit status: 0 every section ran (or was not available here); 1 a section failed (the others
still ran; the table and the JSON name it); 2 usage error.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from kvstore.bench import BenchOptions
    from kvstore.bench.runner import SECTIONS, render, run_sections, to_json

    sections = args.section or list(SECTIONS)
    res = run_sections(sections, BenchOptions(quick=args.quick, workdir=args.workdir))
    if args.json:
        Path(args.json).write_text(to_json(res))
    if args.format == "json":
        print(to_json(res))
    else:
        render(res)
    return 0 if res.ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    from kvstore.bench.runner import SECTIONS, sections_help
    from kvstore.commands.args import Formatter, examples

    b = sub.add_parser(
        "bench", help="benchmarks against memcpy, raw disk and peers",
        description="Measure kvstore against its physical limits (memcpy, raw file I/O) and "
        "peers (raw redis-py, a vLLM-style hash chain, no cache), each figure beside its "
        "reference measured in the same run, as a ratio (higher is better for kvstore). "
        "docs/benchmarks.md explains every row.",
        formatter_class=Formatter,
        epilog=examples("kvstore bench --quick", "kvstore bench --section disk --section "
                        "daemon --json bench.json", "kvstore bench --format json > bench.json",
                        extra=sections_help()))
    b.add_argument("--quick", action="store_true", help="smaller sizes (a smoke test: minutes, "
                   "not figures to quote)")
    b.add_argument("--section", action="append", choices=list(SECTIONS), metavar="NAME",
                   help="run only this section (repeatable; names below)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    b.add_argument("--workdir", metavar="DIR",
                   help="directory for disk benchmarks (default: a temp dir)")
    b.add_argument("--format", choices=["table", "json"], default="table",
                   help="table (default) or the JSON document on stdout")
    b.set_defaults(func=run)
