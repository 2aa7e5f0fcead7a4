"""Replaying real traffic: the default eviction policy against LRU on the Mooncake
conversation trace, through a real store (and the simulator beside it), at 2, 5 and 10 % of
the trace's unique blocks; the same on the synthetic multi-turn chat workload; and the
policy's bookkeeping per block on put and fetch against LRU's, interleaved in one run.

The trace is ``$KVSTORE_TRACE``, else ``../shared/traces/mooncake_conversation.jsonl``
beside the repository; without it only the chat and bookkeeping rows run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kvstore.bench import BenchOptions, BenchRow, time_row
from kvstore.layout import KVLayout
from kvstore.replay.driver import StoreSpec, replay, replay_namespace
from kvstore.replay.report import CapacityRow, ReplayPlan, parse_capacity, run_report
from kvstore.replay.simulate import simulate_belady, simulate_policy
from kvstore.replay.trace import Trace, facts, load_trace, store_keys
from kvstore.replay.workloads import ChatWorkload, chat_trace
from kvstore.store import open_store
from kvstore.tiers.policy import DEFAULT_EVICTION, make_policy

SECTION = "replay"
TRACE_NAME = "mooncake_conversation.jsonl"
SHARES = ("2%", "5%", "10%")
GOAL = 1.3  # the default's hit ratio vs LRU's at 2 % and 5 %
BUDGET_US = 2.0  # the default's extra bookkeeping per block


def find_trace() -> Path | None:
    """``$KVSTORE_TRACE`` (as the routing section), else the shared copy beside the repo."""
    env = os.environ.get("KVSTORE_TRACE")
    p = Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "traces" / TRACE_NAME
    return p if p.exists() else None


def _hit_row(name: str, row: CapacityRow, goal: float | None, through_store: bool) -> BenchRow:
    ours, lru = DEFAULT_EVICTION, "lru"
    sim_o, sim_l = row.sim(ours), row.sim(lru)
    bound, top = row.sim("belady"), row.sim("unbounded")
    assert sim_o and sim_l and bound and top
    st_o, st_l = row.store(ours), row.store(lru)
    v = st_o.hit_ratio if through_store and st_o else sim_o.hit_ratio
    r = st_l.hit_ratio if through_store and st_l else sim_l.hit_ratio
    where = "through the store" if through_store and st_o else "simulated"
    note = (f"{where}; simulated {sim_o.hit_ratio:.3f} vs LRU {sim_l.hit_ratio:.3f}; "
            f"Belady bound {bound.hit_ratio:.3f} ({v / bound.hit_ratio:.0%} of it, LRU "
            f"{r / bound.hit_ratio:.0%}); unbounded {top.hit_ratio:.3f}")
    if through_store and st_o and st_l:
        note += f"; {st_o.seconds:.0f} s / {st_l.seconds:.0f} s per replay"
    return BenchRow(SECTION, f"{name} at {row.capacity} of unique blocks: {ours} hit ratio",
                    v, "hit", "LRU", r, v / r if r else float("inf"), goal, note)


def trace_rows(trace: Trace, label: str, *, store: bool, goal: bool) -> list[BenchRow]:
    plan = ReplayPlan(capacities=tuple(parse_capacity(s) for s in SHARES),
                      policies=("lru", DEFAULT_EVICTION), store=store)
    rep = run_report(trace, plan)
    return [_hit_row(label, row, GOAL if goal and row.capacity in ("2%", "5%") else None, store)
            for row in rep.rows]


def chat_rows(quick: bool) -> list[BenchRow]:
    """The second workload, simulated (the tests check the simulator equals the store)."""
    trace = chat_trace(ChatWorkload(requests=2_000 if quick else 12_000))
    ns = replay_namespace(512).id
    blocks = store_keys(trace, ns, 512)
    fx = facts(blocks, 512)
    rows = []
    for share in SHARES:
        n = parse_capacity(share).blocks(fx, 1)
        ours = simulate_policy(blocks, n, DEFAULT_EVICTION).hit_ratio
        lru = simulate_policy(blocks, n, "lru").hit_ratio
        bound = simulate_belady(blocks, n).hit_ratio
        rows.append(BenchRow(
            SECTION, f"synthetic chat at {share}: {DEFAULT_EVICTION} hit ratio", ours, "hit",
            "LRU", lru, ours / lru if lru else float("inf"), None,
            f"simulated; Belady {bound:.3f}; multi-turn chat, shared system prompts and "
            "documents (kvstore.replay.workloads)"))
    return rows


def bookkeeping_rows(quick: bool) -> list[BenchRow]:
    """Per block: puts of new chains into a full warm tier (each block evicts one) and
    fetches of held chains, both policies interleaved round by round, best of the rounds."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, block_tokens=4)
    cap, batch, rounds = (5_000, 256, 8) if quick else (50_000, 512, 30)
    kv = torch.randn(lay.batch_shape(batch)).to(lay.dtype)
    names = ("lru", DEFAULT_EVICTION)
    stores = {e: open_store(None, layout=lay, model_id="bench/policy", device="cpu",
                            gpu_capacity=0, cpu_capacity=cap * lay.block_nbytes, eviction=e)
              for e in names}
    chains = dict.fromkeys(names, 0)
    put_t: dict[str, list[float]] = {e: [] for e in names}
    get_t: dict[str, list[float]] = {e: [] for e in names}

    def one(e: str, timed: bool) -> None:
        s = stores[e]
        c = chains[e]
        chains[e] += 1
        keys = s.block_keys(list(range(c * 10_000_000, c * 10_000_000 + batch * 4)))
        t0 = time.perf_counter()
        s.put(keys, kv).wait()
        t1 = time.perf_counter()
        s.fetch(keys).wait()
        t2 = time.perf_counter()
        if timed:
            put_t[e].append(t1 - t0)
            get_t[e].append(t2 - t1)

    try:
        for e in names:
            while stores[e].stats().blocks + batch <= cap:
                one(e, False)
        for _ in range(rounds):
            for e in names:
                one(e, True)
    finally:
        for s in stores.values():
            s.close()
    ours = DEFAULT_EVICTION
    per = {e: (min(put_t[e]) / batch, min(get_t[e]) / batch) for e in names}
    return [
        time_row(SECTION, f"{ours}: put per block into a full {cap:,}-block tier", per[ours][0],
                 "the same put under LRU", per["lru"][0], unit="us",
                 note="each block evicts one; includes the copy and the store's own work"),
        time_row(SECTION, f"{ours}: fetch per block (a touch of a held chain)", per[ours][1],
                 "the same fetch under LRU", per["lru"][1], unit="us"),
    ]


def policy_rows(quick: bool) -> list[BenchRow]:
    """The policies alone, on the calls a store makes per block of a put into a full tier
    (a touch of the chain, an eviction, an insert, the touch after) and of a fetch (a touch
    of a held chain): LRU and the default interleaved, best of the rounds; a big tier and a
    small one (small tiers sample more keys into their shadows)."""
    rows = _policy_rows(5_000 if quick else 50_000, quick)
    small = _policy_rows(1_000 if quick else 2_000, quick)
    return rows + [small[1]]


def _policy_rows(slots: int, quick: bool) -> list[BenchRow]:
    batch, rounds = (256, 10) if quick else (512, 40)
    batch = min(batch, slots // 4)
    names = ("lru", DEFAULT_EVICTION)
    pols = {e: make_policy(e, slots, probation=True) for e in names}  # as the tiers make them
    fresh = iter(range(10**12))
    for p in pols.values():
        for _ in range(slots):
            p.insert(next(fresh))
    best = dict.fromkeys(names, float("inf"))
    for _ in range(rounds):
        chain = [next(fresh) for _ in range(batch)]
        rev = chain[::-1]
        for e in names:
            p = pols[e]
            t0 = time.perf_counter()
            p.touch(rev)
            for _ in range(batch):
                p.remove(p.peek(), for_room=True)  # as the store's evict_one: peek first
            for k in chain:
                p.insert(k)
            p.touch(rev)
            p.touch(rev)  # a later fetch of the chain
            best[e] = min(best[e], time.perf_counter() - t0)
    us = {e: best[e] / batch * 1e6 for e in names}
    extra = us[DEFAULT_EVICTION] - us["lru"]
    return [
        time_row(SECTION, f"{DEFAULT_EVICTION} bookkeeping per block (put into a full "
                 f"{slots:,}-slot tier + fetch)", us[DEFAULT_EVICTION] / 1e6, "LRU's", us["lru"] / 1e6, unit="us",
                 note=f"{extra:.2f} us per block beyond LRU's (goal: at most {BUDGET_US:g})"),
        BenchRow(SECTION, f"{DEFAULT_EVICTION} bookkeeping beyond LRU's, per block, "
                 f"{slots:,}-slot tier",
                 max(extra, 0.0), "us", "budget", BUDGET_US, BUDGET_US / max(extra, 0.01), 1.0,
                 "ranks, ghost list and shadow caches; ratio = budget / extra"),
    ]


def run(opts: BenchOptions) -> list[BenchRow]:
    rows: list[BenchRow] = []
    path = find_trace()
    if path is not None:
        trace = load_trace(path, limit=2_000 if opts.quick else None)
        label = "Mooncake conversation" + (" (first 2,000 requests)" if opts.quick else "")
        rows += trace_rows(trace, label, store=True, goal=not opts.quick)
    rows += chat_rows(opts.quick)
    rows += policy_rows(opts.quick)
    rows += bookkeeping_rows(opts.quick)
    return rows


__all__ = ["StoreSpec", "find_trace", "replay", "run"]
