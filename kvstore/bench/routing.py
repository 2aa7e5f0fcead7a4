"""Routing across engines: prefix-aware routing against round-robin and first-blocks hashing
on the Mooncake conversation trace (4 engines at 2% and 5% of its unique blocks, all three
routers in the same run), simulated over LRU engines and replayed through 4 real stores
(``kvstore replay --engines 4``: LRU stores, the issue's setup, and the store's default
policy), and the router's decision time for a 128k-token prompt.

The trace is ``$KVSTORE_TRACE``, else ``../shared/traces/mooncake_conversation.jsonl`` beside
the checkout; without it only the decision-time rows are measured.
"""

from __future__ import annotations

import hashlib
import os
import random
import statistics
import sys
import time
from pathlib import Path

from kvstore.bench import BenchOptions, BenchRow, time_row
from kvstore.events.types import BlockStored
from kvstore.keys import block_keys
from kvstore.routing.index import PrefixIndex
from kvstore.routing.router import Router
from kvstore.routing.simulate import load_trace, simulate

SECTION = "routing"
ENGINES = 4
PROMPT_TOKENS = 131_072
BLOCK_TOKENS = 16
DECISION_GOAL_S = 50e-6


def _trace_path() -> Path | None:
    env = os.environ.get("KVSTORE_TRACE")
    p = Path(env) if env else (Path(__file__).resolve().parents[2].parent / "shared" / "traces"
                               / "mooncake_conversation.jsonl")
    return p if p.is_file() else None


def _trace_rows(opts: BenchOptions) -> list[BenchRow]:
    path = _trace_path()
    if path is None:
        print("routing: no trace (set KVSTORE_TRACE); trace rows skipped", file=sys.stderr)
        return []
    trace = load_trace(path)
    if opts.quick:  # a smoke run: the goals are about the whole trace
        trace = trace[:3000]
    rows = []
    for share in (0.02, 0.05):
        r = {p: simulate(trace, p, engines=ENGINES, capacity_share=share, block_tokens=512)
             for p in ("round-robin", "hash", "prefix")}
        what = f"{ENGINES} engines at {share:.0%} of the unique blocks, {len(trace)} requests"
        pre = r["prefix"]
        note = (f"{what}; max/mean load: prefix {pre.max_over_mean:.3f}, round-robin "
                f"{r['round-robin'].max_over_mean:.3f}, hash {r['hash'].max_over_mean:.3f}")
        for peer, goal in (("round-robin", 2.2), ("hash", 1.0)):
            rows.append(BenchRow(SECTION, f"prefix routing hit ratio ({share:.0%})",
                                 pre.hit_ratio, "ratio", f"{peer} hit ratio",
                                 r[peer].hit_ratio, pre.hit_ratio / r[peer].hit_ratio,
                                 None if opts.quick else goal, note))
        rows.append(BenchRow(SECTION, f"prefix routing max/mean load ({share:.0%})",
                             pre.max_over_mean, "x", "perfect balance", 1.0,
                             1.0 / pre.max_over_mean, None if opts.quick else 1 / 1.1,
                             "goal: max/mean <= 1.1"))
    return rows


def _fleet_rows(opts: BenchOptions) -> list[BenchRow]:
    path = _trace_path()
    if path is None:
        return []
    from kvstore.replay.fleet_report import FleetPlan, run_fleet_report
    from kvstore.replay.report import parse_capacity
    from kvstore.replay.trace import load_trace as load_replay_trace
    from kvstore.tiers.policy import DEFAULT_EVICTION

    trace = load_replay_trace(path, limit=3000 if opts.quick else None)
    caps = (parse_capacity("2%"), parse_capacity("5%"))
    rows = []
    for eviction in dict.fromkeys(("lru", DEFAULT_EVICTION)):
        rep = run_fleet_report(trace, FleetPlan(ENGINES, caps, policies=(eviction,)))
        for row in rep.rows:
            r = {x.router: x for x in row.results}
            pre = r["prefix"]
            what = (f"{ENGINES} real stores, eviction={eviction}, {row.capacity} of the unique "
                    f"blocks each")
            note = (f"{rep.requests} requests; max/mean load: prefix {pre.max_over_mean:.3f}, "
                    f"round-robin {r['round-robin'].max_over_mean:.3f}; mispredicted "
                    f"{pre.mispredicted}; {pre.seconds:.0f} s")
            goal = None if opts.quick else 2.2
            for peer, g in (("round-robin", goal), ("hash", 1.0 if goal else None)):
                rows.append(BenchRow(SECTION, f"prefix routing hit ratio ({what})",
                                     pre.hit_ratio, "ratio", f"{peer} hit ratio",
                                     r[peer].hit_ratio, pre.hit_ratio / r[peer].hit_ratio,
                                     g, note))
            rows.append(BenchRow(SECTION, f"prefix routing max/mean load ({what})",
                                 pre.max_over_mean, "x", "perfect balance", 1.0,
                                 1.0 / pre.max_over_mean, 1 / 1.1 if goal else None,
                                 "goal: max/mean <= 1.1"))
    return rows


def _decision_rows(opts: BenchOptions) -> list[BenchRow]:
    rng = random.Random(0)
    ns = hashlib.sha256(b"kvstore-bench/routing").digest()
    tokens = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    keys = block_keys(ns, tokens, BLOCK_TOKENS)
    idx = PrefixIndex()
    names = [f"engine-{i}" for i in range(ENGINES)]
    for i, name in enumerate(names):  # each holds a different share of this prompt
        idx.add_engine(name)
        n = len(keys) * (i + 1) // (ENGINES + 1)
        idx.apply(name, [BlockStored(tuple(keys[:n]), None, (), BLOCK_TOKENS, "CPU")])
    router = Router(names, idx, "prefix", block_tokens=BLOCK_TOKENS)
    loads = {n: 1000.0 * i for i, n in enumerate(names)}
    reps = 300 if opts.quick else 3000
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        router.route(keys, loads)
        times.append(time.perf_counter() - t0)
    p50 = statistics.median(times)
    t_keys = min(_timed(lambda: block_keys(ns, tokens, BLOCK_TOKENS)) for _ in range(5))
    held = idx._held  # the linear scan a plain per-block index would do, for scale
    t_scan = min(_timed(lambda: [held.get(k, 0) for k in keys]) for _ in range(5))
    what = f"{PROMPT_TOKENS // 1024}k-token prompt, {len(keys)} blocks, {ENGINES} engines"
    note = f"p50 of {reps}; p99 {sorted(times)[int(reps * 0.99)] * 1e6:.0f} us"
    return [
        time_row(SECTION, f"router decision p50 ({what})", p50, "the 50 us goal",
                 DECISION_GOAL_S, unit="us", goal=1.0, note=note),
        time_row(SECTION, f"router decision p50 ({what})", p50, "computing the prompt's keys",
                 t_keys, unit="us", note="the hashing any prefix router needs first"),
        time_row(SECTION, f"router decision p50 ({what})", p50, "one index probe per block",
                 t_scan, unit="us", note="bisection vs a linear scan of the prompt"),
    ]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(opts: BenchOptions) -> list[BenchRow]:
    return _decision_rows(opts) + _trace_rows(opts) + _fleet_rows(opts)
