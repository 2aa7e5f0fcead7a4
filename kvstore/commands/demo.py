"""``kvstore demo``: the main job — a shared-prefix workload, then again in a fresh process.

Every speed-up is the median of ``--repeat`` runs, shown with its spread; a phase where
kvstore was not faster says so, with the reason the figures give.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

COLD, RESTARTED = "first run (cold cache)", "fresh process, same store"

_COLUMNS = (
    f"Columns: \"{COLD}\" starts with nothing stored for this model; its requests share "
    "prefixes (a system prompt, earlier turns, a document), so later requests already reuse "
    f"the blocks earlier ones of the same run stored. \"{RESTARTED}\" is a new process "
    "opening the same store: memory empty, every block read back from disk.",
    "Rows: \"prefill time with kvstore\" sums over the requests: look up the cached prefix, "
    "load it, compute the rest, store the new blocks; \"without\" computes every token. "
    "Times and speed-ups are medians of {runs} runs (their range in brackets).",
)


def _phase(args: argparse.Namespace, path: Path, *, cold: bool, console: Any) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvstore.commands.demo_workload import run_phase, workload_size

    label = COLD if cold else RESTARTED
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(f"kvstore demo {args.workload}: loading model", total=None)

        def tick() -> None:
            bar.update(task, description=f"kvstore demo {args.workload}: {label}",
                       total=workload_size(args.workload, args.quick) * args.repeat)
            bar.advance(task)

        res = run_phase(path, args.workload, seed=args.seed, size=args.model_size,
                        engine=args.engine, cold=cold, quick=args.quick, repeat=args.repeat,
                        progress=tick)
    return res.as_dict()


def _rerun(args: argparse.Namespace, path: Path) -> subprocess.CompletedProcess:
    from kvstore.child import env, kvstore_argv

    cmd = kvstore_argv("demo", "--store", str(path), "--workload", args.workload,
                       "--model-size", args.model_size, "--engine", args.engine,
                       "--seed", str(args.seed), "--repeat", str(args.repeat),
                       "--phase", "rerun", *(["--quick"] if args.quick else []))
    return subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False, env=env())


def slower_reason(r: dict[str, Any], *, cold: bool, size: str) -> str | None:
    """Why kvstore was not faster in a phase (None when it was, in the median)."""
    if r["speedup"] >= 1.0:
        return None
    reasons = []
    if cold:
        reasons.append("the first run pays for storing every new block (put, then written "
                       "to disk) and reuses only what its own earlier requests stored")
    per_token = r["uncached_seconds"] / max(r["prompt_tokens"], 1)
    if r["reused_tokens"]:
        load = (r["cached_seconds"] - r["computed_tokens"] * per_token) / r["reused_tokens"]
        if load >= per_token:
            from kvstore.sizes import format_size

            reasons.append(
                f"this {size} model computes a token's K/V in about {per_token * 1e6:.0f} us, "
                f"no more than kvstore takes to look it up and load it ({load * 1e6:.0f} us "
                f"per reused token, {format_size(r['kv_bytes_per_token'])} of K/V): a cache "
                "pays off where compute per token is dear (--model-size small, a real model, "
                "long prompts)")
    if r["speedup_max"] >= 1.0:
        reasons.append(f"the runs disagree ({r['speedup_min']:.1f}x-{r['speedup_max']:.1f}x): "
                       "the machine is busy; --repeat more runs")
    return "; ".join(reasons) or "the estimate of compute vs load does not explain it"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvstore.commands.demo_workload import default_store_path

    path = Path(args.store).expanduser().absolute() if args.store else default_store_path()
    console = Console(stderr=True)
    if args.phase == "rerun":  # the second half, in a fresh process
        print(json.dumps(_phase(args, path, cold=False, console=console)))
        return 0
    t0 = time.perf_counter()
    first = _phase(args, path, cold=True, console=console)
    proc = _rerun(args, path)
    if proc.returncode != 0 or not proc.stdout.strip():
        console.print("[red]the restarted run failed[/red]")
        return 1
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    wall = time.perf_counter() - t0
    ok = bool(first["identical"] and second["identical"])
    for r, cold in ((first, True), (second, False)):
        r["slower_reason"] = slower_reason(r, cold=cold, size=args.model_size)
    look = f"kvstore ls --store {path}"
    if args.format == "json":
        print(json.dumps({"store": str(path), "next": look, "workload": args.workload,
                          "model_size": args.model_size, "engine": first["engine"],
                          "repeat": args.repeat, "identical": ok, "wall_seconds": wall,
                          "first": first, "restarted": second}))
        return 0 if ok else 1
    _print_table(args, path, first, second, wall)
    return 0 if ok else 1


def _spread(values: list[float], fmt: str) -> str:
    # escaped: rich would read "[0.2-1.8]" as markup
    return f" \\[{fmt.format(min(values))}-{fmt.format(max(values))}]" if len(values) > 1 else ""


def _print_table(args: argparse.Namespace, path: Path, first: dict, second: dict,
                 wall: float) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    from kvstore.sizes import format_size

    def pct(a: int, b: int) -> str:
        return f"{a:,} ({a / max(b, 1):.0%})"

    def speedup(r: dict) -> str:
        s = f"{r['speedup']:.1f}×" + _spread(r["speedups"], "{:.1f}")
        return s if r["slower_reason"] is None else f"[yellow]{s} (slower, see below)[/yellow]"

    t = Table(title=f"kvstore demo — {args.workload} workload, store {path}",
              caption=f"engine: {first['engine']}; {wall:.1f} s in all")
    t.add_column("")
    t.add_column(COLD, justify="right")
    t.add_column(RESTARTED, justify="right")

    def row(label: str, f: Any) -> None:
        t.add_row(label, f(first), f(second))

    row("requests", lambda r: str(r["requests"]))
    row("prompt tokens", lambda r: f"{r['prompt_tokens']:,}")
    row("tokens reused from the cache", lambda r: pct(r["reused_tokens"], r["prompt_tokens"]))
    row("block hit rate", lambda r: f"{r['hit_rate']:.0%}")
    row("prefill time with kvstore",
        lambda r: f"{r['cached_seconds']:.2f} s" + _spread(r["cached_runs"], "{:.2f}"))
    row("prefill time without",
        lambda r: f"{r['uncached_seconds']:.2f} s" + _spread(r["uncached_runs"], "{:.2f}"))
    row("speed-up (without / with)", speedup)
    if first.get("plan"):
        p = first["plan"]
        t.add_row("batch plan: tokens computed",
                  f"{p['planned_tokens']:,} vs {p['arrival_tokens']:,} arrival order, "
                  f"{p['naive_tokens']:,} naive", f"(budget {p['budget_blocks']} blocks)")
    row("on disk", lambda r: f"{r['blocks_on_disk']:,} blocks ({format_size(r['disk_bytes'])})")
    row("outputs identical to uncached",
        lambda r: "[green]yes[/green]" if r["identical"] else "[red]NO[/red]")
    con = Console(width=None if sys.stdout.isatty() else 120)
    con.print(t)
    for text in _COLUMNS:
        con.print(text.format(runs=args.repeat), highlight=False, markup=False)
    for r, name in ((first, COLD), (second, RESTARTED)):
        if r["slower_reason"] is not None:
            con.print(f"[yellow]Not faster in the {name} column[/yellow] "
                      f"({r['speedup']:.1f}×): {r['slower_reason']}.", highlight=False)
    con.print(f"\nThe blocks are in {path}. Look at them: [bold]kvstore ls --store {path}[/bold]"
              f" (then inspect, verify, rm with the same --store).", highlight=False)


def register(sub: argparse._SubParsersAction) -> None:
    from kvstore.commands.args import Formatter, examples, integer

    d = sub.add_parser(
        "demo", help="run a shared-prefix workload through an embedded store",
        formatter_class=Formatter,
        description="Run a workload whose prompts share prefixes through an embedded store, "
        "then again in a fresh process on the same store; compare every output and the "
        "prefill time against the same model without the cache. The model has random "
        "weights built from a config: nothing is downloaded.",
        epilog=examples("kvstore demo", "kvstore demo --workload batch --quick",
                        "kvstore demo --model-size small --repeat 5 --format json"))
    d.add_argument("--store", metavar="PATH",
                   help="store path (default: $XDG_CACHE_HOME/kvstore/demo, i.e. "
                   "~/.cache/kvstore/demo; the table ends with the 'kvstore ls' to run)")
    d.add_argument("--workload", choices=["chat", "docqa", "batch"], default="chat",
                   help="chat: multi-turn conversations; docqa: documents asked several "
                        "questions; batch: docqa planned by kvstore.batch")
    d.add_argument("--model-size", choices=["tiny", "small"], default="tiny",
                   help="tiny (4 layers, hidden 256) or small (8 layers, hidden 512)")
    d.add_argument("--engine", choices=["auto", "transformers", "toy"], default="auto",
                   help="auto: a transformers Llama-style model when transformers is "
                        "installed, else a toy torch decoder")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts and the weights")
    d.add_argument("--repeat", type=integer(minimum=1, maximum=50), default=3, metavar="N",
                   help="runs per phase; times and speed-ups are their median (default 3)")
    d.add_argument("--quick", action="store_true", help="a smaller workload (smoke test)")
    d.add_argument("--format", choices=["table", "json"], default="table",
                   help="table (default) or one JSON document")
    d.add_argument("--phase", choices=["all", "rerun"], default="all", help=argparse.SUPPRESS)
    d.set_defaults(func=run)
