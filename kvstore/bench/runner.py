"""Run benchmark sections, print a table, optionally write JSON."""

from __future__ import annotations

import dataclasses
import importlib
import json
import platform
import time
from collections.abc import Sequence

import torch

from kvstore.bench import BenchOptions, BenchRow

#: section name -> module; a module whose import fails (optional pieces) is reported, not fatal
SECTIONS = {
    "hashing": "kvstore.bench.hashing",
    "memory": "kvstore.bench.memory",
    "promotion": "kvstore.bench.promotion",
    "disk": "kvstore.bench.disk",
    "remote": "kvstore.bench.remote",
    "prefill": "kvstore.bench.prefill",
    "daemon": "kvstore.bench.daemon",
}


def run_sections(names: Sequence[str], opts: BenchOptions) -> tuple[list[BenchRow], list[str]]:
    rows: list[BenchRow] = []
    problems: list[str] = []
    for name in names:
        if name not in SECTIONS:
            raise SystemExit(f"unknown benchmark section {name!r}; choose from {', '.join(SECTIONS)}")
        try:
            mod = importlib.import_module(SECTIONS[name])
        except ImportError as e:
            problems.append(f"{name}: not available ({e})")
            continue
        rows.extend(mod.run(opts))
    return rows, problems


def render(rows: Sequence[BenchRow], problems: Sequence[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvstore benchmarks (ratio: higher is better for kvstore)")
    for col in ("section", "figure", "value", "reference", "ref value", "ratio", "goal"):
        table.add_column(col, justify="right" if col in ("value", "ref value", "ratio", "goal") else "left")
    for r in rows:
        goal = "" if r.goal is None else (f"≥{r.goal:g} " + ("✓" if r.meets_goal else "✗"))
        table.add_row(r.section, r.name + (f"\n[dim]{r.note}[/dim]" if r.note else ""),
                      f"{r.value:.3g} {r.unit}", r.ref_name, f"{r.ref_value:.3g} {r.unit}",
                      f"{r.ratio:.2f}×", goal)
    import sys

    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for p in problems:
        console.print(f"[yellow]skipped[/yellow] {p}")


def to_json(rows: Sequence[BenchRow], problems: Sequence[str]) -> str:
    return json.dumps(
        {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "torch": torch.__version__, "cuda": torch.cuda.is_available()},
            "rows": [dataclasses.asdict(r) | {"meets_goal": r.meets_goal} for r in rows],
            "skipped": list(problems),
        },
        indent=2,
    )
