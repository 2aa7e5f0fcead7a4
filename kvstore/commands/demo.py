"""``kvstore demo``: the main job — a shared-prefix workload, then again in a fresh process."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _phase(args: argparse.Namespace, path: Path, *, cold: bool, console: Any) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvstore.demo import run_phase, workload_size

    label = "first run, cold cache" if cold else "fresh process, same store"
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(f"kvstore demo {args.workload}: loading model", total=None)

        def tick() -> None:
            bar.update(task, description=f"kvstore demo {args.workload}: {label}",
                       total=workload_size(args.workload, args.quick))
            bar.advance(task)

        res = run_phase(path, args.workload, seed=args.seed, size=args.model_size,
                        engine=args.engine, cold=cold, quick=args.quick, progress=tick)
    return res.as_dict()


def _rerun_cmd(args: argparse.Namespace, path: Path) -> list[str]:
    return [sys.executable, "-m", "kvstore.cli", "demo", "--store", str(path), "--workload",
            args.workload, "--model-size", args.model_size, "--engine", args.engine,
            "--seed", str(args.seed), "--phase", "rerun", *(["--quick"] if args.quick else [])]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvstore.demo import default_store_path

    path = Path(args.store).expanduser() if args.store else default_store_path()
    console = Console(stderr=True)
    if args.phase == "rerun":  # the second half, in a fresh process
        print(json.dumps(_phase(args, path, cold=False, console=console)))
        return 0
    t0 = time.perf_counter()
    first = _phase(args, path, cold=True, console=console)
    proc = subprocess.run(_rerun_cmd(args, path), stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0 or not proc.stdout.strip():
        console.print("[red]the restarted run failed[/red]")
        return 1
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    wall = time.perf_counter() - t0
    ok = bool(first["identical"] and second["identical"])
    if args.format == "json":
        print(json.dumps({"store": str(path), "workload": args.workload,
                          "model_size": args.model_size, "engine": first["engine"],
                          "identical": ok, "wall_seconds": wall, "first": first,
                          "restarted": second}))
        return 0 if ok else 1
    _print_table(args, path, first, second, wall)
    return 0 if ok else 1


def _print_table(args: argparse.Namespace, path: Path, first: dict, second: dict,
                 wall: float) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvstore.sizes import format_size

    def pct(a: int, b: int) -> str:
        return f"{a:,} ({a / max(b, 1):.0%})"

    def speedup(r: dict) -> str:
        return f"{r['uncached_seconds'] / max(r['cached_seconds'], 1e-9):.1f}×"

    t = Table(title=f"kvstore demo — {args.workload} workload, store {path}",
              caption=f"engine: {first['engine']}; {wall:.1f} s in all")
    t.add_column("")
    t.add_column("first run (cold cache)", justify="right")
    t.add_column("fresh process, same store", justify="right")

    def row(label: str, f: Any) -> None:
        t.add_row(label, f(first), f(second))

    row("requests", lambda r: str(r["requests"]))
    row("prompt tokens", lambda r: f"{r['prompt_tokens']:,}")
    row("tokens reused from the cache", lambda r: pct(r["reused_tokens"], r["prompt_tokens"]))
    row("block hit rate", lambda r: f"{r['hit_rate']:.0%}")
    row("prefill time with kvstore", lambda r: f"{r['cached_seconds']:.2f} s")
    row("prefill time without", lambda r: f"{r['uncached_seconds']:.2f} s")
    row("speed-up", speedup)
    if first.get("plan"):
        p = first["plan"]
        t.add_row("batch plan: tokens computed",
                  f"{p['planned_tokens']:,} vs {p['arrival_tokens']:,} arrival order, "
                  f"{p['naive_tokens']:,} naive", f"(budget {p['budget_blocks']} blocks)")
    row("on disk", lambda r: f"{r['blocks_on_disk']:,} blocks ({format_size(r['disk_bytes'])})")
    row("outputs identical to uncached",
        lambda r: "[green]yes[/green]" if r["identical"] else "[red]NO[/red]")
    Console(width=None if sys.stdout.isatty() else 120).print(t)


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("demo", help="run a shared-prefix workload through an embedded store")
    d.add_argument("--store", help="store path (default: ~/.cache/kvstore/demo)")
    d.add_argument("--workload", choices=["chat", "docqa", "batch"], default="chat",
                   help="chat: multi-turn conversations; docqa: documents asked several "
                        "questions; batch: docqa planned by kvstore.batch")
    d.add_argument("--model-size", choices=["tiny", "small"], default="tiny")
    d.add_argument("--engine", choices=["auto", "transformers", "toy"], default="auto",
                   help="auto: a transformers Llama-style model when transformers is "
                        "installed, else a toy torch decoder")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--quick", action="store_true", help="a smaller workload (smoke test)")
    d.add_argument("--format", choices=["table", "json"], default="table")
    d.add_argument("--phase", choices=["all", "rerun"], default="all", help=argparse.SUPPRESS)
    d.set_defaults(func=run)
