"""Benchmarks: each figure printed beside its physical limit and a peer measured in the same run.

Every section module exposes ``run(opts: BenchOptions) -> list[BenchRow]``; ``tools/bench.py``
and ``kvstore bench`` run the sections, print a table and optionally write JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchOptions:
    quick: bool = False  # smaller sizes, for smoke tests
    workdir: str | None = None  # where disk benchmarks may write (default: a temp dir)


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One measured figure compared with a reference measured in the same run.

    ``ratio`` is oriented so that higher is better for us: for throughputs ``value / ref``,
    for times ``ref / value``.
    """

    section: str
    name: str
    value: float
    unit: str
    ref_name: str
    ref_value: float
    ratio: float
    goal: float | None = None
    note: str = ""

    @property
    def meets_goal(self) -> bool | None:
        return None if self.goal is None else self.ratio >= self.goal


def best_time(fn: Callable[[], object], *, repeat: int = 5, min_time: float = 0.0) -> float:
    """Best wall time of ``fn()`` over ``repeat`` runs (seconds)."""
    best = float("inf")
    t_end = time.perf_counter() + min_time
    i = 0
    while i < repeat or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        i += 1
    return best


def throughput_row(
    section: str, name: str, nbytes: int, seconds: float, ref_name: str, ref_seconds: float,
    goal: float | None = None, note: str = "",
) -> BenchRow:
    """A GB/s figure against a reference moving the same bytes."""
    v = nbytes / seconds / 1e9
    r = nbytes / ref_seconds / 1e9
    return BenchRow(section, name, v, "GB/s", ref_name, r, v / r, goal, note)


def time_row(
    section: str, name: str, seconds: float, ref_name: str, ref_seconds: float, unit: str = "ms",
    goal: float | None = None, note: str = "",
) -> BenchRow:
    """A time figure (lower is better) against a reference; ratio = ref / ours."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[unit]
    return BenchRow(section, name, seconds * scale, unit, ref_name, ref_seconds * scale,
                    ref_seconds / seconds, goal, note)
