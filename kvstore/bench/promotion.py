"""Benchmark section ``promotion``: fetch promoting blocks warm -> hot and disk -> hot.

Against the limits measured in the same run: ``copy_`` of the same bytes into a ready buffer
(memcpy) for warm -> hot, and a cold raw ``readinto`` of the same bytes for disk -> hot
(goal 0.7 each on this machine). On a CPU-only machine the hot tier runs on ``cpu``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from kvstore.bench import BenchOptions, BenchRow, best_time, throughput_row
from kvstore.bench.disk_harness import drop_cache
from kvstore.layout import KVLayout
from kvstore.store import open_store

SECTION = "promotion"


def _raw_write(path: str, data: torch.Tensor) -> None:
    """``data`` (uint8) to a new file, fsynced: the cold-read reference's bytes."""
    with open(path, "wb") as f:
        f.write(memoryview(data.numpy()))
        f.flush()
        os.fsync(f.fileno())


def _raw_read(path: str, buf: torch.Tensor) -> float:
    """Seconds to ``readinto`` the whole file at ``path`` into ``buf`` (uint8)."""
    view = memoryview(buf.numpy())
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return time.perf_counter() - t0


def run(opts: BenchOptions) -> list[BenchRow]:
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    nblocks = 32 if opts.quick else 128
    nbytes = nblocks * lay.block_nbytes
    repeat = 3 if opts.quick else 5
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kv = torch.randn(lay.batch_shape(nblocks)).to(lay.dtype)
    dst = torch.empty_like(kv, device=device)
    dst.copy_(kv)
    t_memcpy = best_time(lambda: dst.copy_(kv), repeat=repeat)
    tmp = tempfile.mkdtemp(prefix="kvstore-bench-promo-", dir=opts.workdir)
    rows: list[BenchRow] = []
    try:
        os.makedirs(os.path.join(tmp, "raw"))
        raw = os.path.join(tmp, "raw", "raw.bin")
        _raw_write(raw, kv.view(torch.uint8).reshape(-1))
        raw_buf = torch.empty(nbytes, dtype=torch.uint8)
        t_raw = float("inf")

        def raw_cold() -> float:
            drop_cache(os.path.dirname(raw))
            return _raw_read(raw, raw_buf)
        with open_store(os.path.join(tmp, "store"), layout=lay, model_id="bench/promotion",
                        device=device, gpu_capacity=2 * nbytes, cpu_capacity=2 * nbytes,
                        disk_capacity=4 * nbytes) as s:
            keys = s.block_keys(list(range(nblocks * lay.block_tokens)))
            s.put(keys, kv).wait()
            s.flush()

            def warm_to_hot() -> float:
                s.flush()  # earlier promotions settled
                s.evict(keys, tier="hot")  # blocks now only in warm (and on disk)
                return best_time(lambda: s.fetch(keys, out=dst).wait(), repeat=1)

            t_warm = min(warm_to_hot() for _ in range(repeat))
            assert torch.equal(dst.cpu(), kv)

            def disk_to_hot() -> float:
                s.flush()
                s.evict(keys, tier="hot")
                s.evict(keys, tier="warm")
                drop_cache(os.path.join(tmp, "store", "segments"))
                return best_time(lambda: s.fetch(keys, out=dst).wait(), repeat=1)

            # alternate with the raw read, so both see the same disk (a cloud disk's speed
            # drifts from one second to the next)
            t_disk = float("inf")
            for _ in range(repeat):
                s.flush()  # the last fetch's promotion is not running behind the raw read
                t_raw = min(t_raw, raw_cold())
                t_disk = min(t_disk, disk_to_hot())
            assert torch.equal(dst.cpu(), kv)
        mib = nbytes >> 20
        rows.append(throughput_row(SECTION, f"fetch {mib} MiB warm->{device} (promote)", nbytes,
                                   t_warm, "copy_ into ready buffer (memcpy)", t_memcpy, goal=0.7))
        rows.append(throughput_row(SECTION, f"fetch {mib} MiB disk->{device} (cold, promote)",
                                   nbytes, t_disk, "raw readinto, cold", t_raw, goal=0.7,
                                   note="page cache dropped with posix_fadvise(DONTNEED)"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows
