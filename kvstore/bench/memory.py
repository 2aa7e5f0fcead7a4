"""Warm-tier fetch/put bandwidth against memcpy (``copy_`` into a ready buffer) and ``clone()``."""

from __future__ import annotations

import torch

from kvstore.bench import BenchOptions, BenchRow, best_time, throughput_row, time_row
from kvstore.layout import KVLayout
from kvstore.store import open_store

SECTION = "memory"


def run(opts: BenchOptions) -> list[BenchRow]:
    # Llama-3-8B geometry: 2 MiB per 16-token block
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    nblocks = 32 if opts.quick else 128  # 64 MiB / 256 MiB
    nbytes = nblocks * lay.block_nbytes
    repeat = 3 if opts.quick else 7
    kv = torch.randn(lay.batch_shape(nblocks)).to(lay.dtype)
    ready = torch.empty_like(kv)
    ready.copy_(kv)  # fault the pages in before timing
    t_memcpy = best_time(lambda: ready.copy_(kv), repeat=repeat)
    t_clone = best_time(lambda: kv.clone(), repeat=repeat)
    rows: list[BenchRow] = []
    with open_store(None, layout=lay, model_id="bench/memory", device="cpu", gpu_capacity=0,
                    cpu_capacity=2 * nbytes) as store:
        keys = store.block_keys(list(range(nblocks * lay.block_tokens)))
        store.put(keys, kv).wait()
        out = torch.empty_like(kv)
        store.fetch(keys, out=out).wait()
        t_fetch_out = best_time(lambda: store.fetch(keys, out=out).wait(), repeat=repeat)
        t_fetch_alloc = best_time(lambda: store.fetch(keys).wait(), repeat=repeat)
        assert torch.equal(out, kv)

        def put_fresh() -> None:
            store.evict()
            store.put(keys, kv).wait()

        t_put = best_time(put_fresh, repeat=repeat)
    mib = nbytes // 2**20
    rows.append(throughput_row(SECTION, f"fetch {mib} MiB warm->out=", nbytes, t_fetch_out,
                               "copy_ into ready buffer (memcpy)", t_memcpy, goal=0.7))
    rows.append(throughput_row(SECTION, f"fetch {mib} MiB warm->new tensor", nbytes, t_fetch_alloc,
                               "clone()", t_clone, goal=0.9))
    rows.append(throughput_row(SECTION, f"put {mib} MiB ->warm", nbytes, t_put,
                               "copy_ into ready buffer (memcpy)", t_memcpy,
                               note="includes evicting the previous copy"))
    rows.append(_full_tier_row(opts))
    return rows


def _full_tier_row(opts: BenchOptions) -> BenchRow:
    """Puts into a tier that is full (every new block evicts an old one: LRU, leaf first)
    against the same puts into a tier with room. Small blocks and many of them, where the
    per-block bookkeeping (not the copy) decides."""
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, block_tokens=4)
    capacity = 10_000 if opts.quick else 100_000
    batch = 1024
    kv = torch.randn(lay.batch_shape(batch)).to(lay.dtype)

    def put_time(fill: bool) -> float:
        with open_store(None, layout=lay, model_id="bench/full", device="cpu", gpu_capacity=0,
                        cpu_capacity=(capacity if fill else 2 * capacity) * lay.block_nbytes) as store:
            chain = 0

            def put_new() -> None:
                nonlocal chain
                start = chain * 10_000_000
                chain += 1
                store.put(store.block_keys(list(range(start, start + batch * 4))), kv).wait()

            while store.stats().blocks + batch <= capacity:
                put_new()
            return best_time(put_new, repeat=5)

    t_room, t_full = put_time(False), put_time(True)
    return time_row(
        SECTION, f"put {batch:,} blocks into a full {capacity:,}-block warm tier", t_full,
        "the same put into a tier with room", t_room, unit="ms",
        note=f"{t_full / batch * 1e6:.1f} us per block, each evicting an old one; before new "
             "chains entered the LRU order leaf first: 1.4-4 s per put")
