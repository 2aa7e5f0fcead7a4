"""``kvstore bench``: benchmarks against memcpy, raw disk and peers, as ratios."""

from __future__ import annotations

import argparse
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from kvstore.bench import BenchOptions
    from kvstore.bench.runner import SECTIONS, render, run_sections, to_json

    sections = args.section or list(SECTIONS)
    rows, problems = run_sections(sections, BenchOptions(quick=args.quick, workdir=args.workdir))
    if args.json:
        Path(args.json).write_text(to_json(rows, problems))
    if args.format == "json":
        print(to_json(rows, problems))
    else:
        render(rows, problems)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks against memcpy, raw disk and peers")
    b.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    b.add_argument("--section", action="append", help="run only this section (repeatable)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    b.add_argument("--workdir", help="directory for disk benchmarks (default: a temp dir)")
    b.add_argument("--format", choices=["table", "json"], default="table")
    b.set_defaults(func=run)
