"""The ``kvstore`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvstore.demo import TinyTransformer, default_store_path, open_demo_store, run_demo
    from kvstore.sizes import format_size

    console = Console(stderr=args.format == "json")
    path = Path(args.store).expanduser() if args.store else default_store_path()
    with open_demo_store(path) as store:
        model = TinyTransformer(store.layout, seed=args.seed)
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"demo: {args.workload}", total=24)
            res = run_demo(store, model, args.workload, seed=args.seed,
                           progress=lambda: bar.advance(task))
        st = store.stats()
    if args.format == "json":
        print(json.dumps({"store": str(path), "workload": args.workload, **{
            k: getattr(res, k) for k in res.__dataclass_fields__}}))
        return 0 if res.identical else 1
    t = Table(title=f"kvstore demo — {args.workload} workload, store {path}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("requests", str(res.requests))
    t.add_row("prompt tokens", f"{res.prompt_tokens:,}")
    t.add_row("tokens reused from the cache", f"{res.reused_tokens:,} ({res.reused_tokens / max(res.prompt_tokens, 1):.0%})")
    t.add_row("block hit rate", f"{res.hit_rate:.0%}")
    t.add_row("prefill time with kvstore", f"{res.cached_seconds:.2f} s")
    t.add_row("prefill time without", f"{res.uncached_seconds:.2f} s")
    t.add_row("speed-up", f"{res.uncached_seconds / max(res.cached_seconds, 1e-9):.1f}×")
    t.add_row("blocks cached", f"{st.blocks} ({format_size(st.blocks * st.block_nbytes)})")
    t.add_row("outputs identical to uncached", "[green]yes[/green]" if res.identical else "[red]NO[/red]")
    console.print(t)
    return 0 if res.identical else 1


def _cmd_bench(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description="Persistent, tiered KV prefix cache for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run a shared-prefix workload through an embedded store")
    d.add_argument("--store", help="store path (default: ~/.cache/kvstore/demo)")
    d.add_argument("--workload", choices=["chat", "docqa"], default="chat")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--format", choices=["table", "json"], default="table")
    d.set_defaults(func=_cmd_demo)

    b = sub.add_parser("bench", help="benchmarks against memcpy, raw disk and peers")
    b.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    b.add_argument("--section", action="append", help="run only this section (repeatable)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    b.add_argument("--workdir", help="directory for disk benchmarks (default: a temp dir)")
    b.add_argument("--format", choices=["table", "json"], default="table")
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
