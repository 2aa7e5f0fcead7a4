"""Benchmark section ``disk``: the disk tier against the physical limit and peers, same bytes,
same run.

* ``write_blocks`` (fsync, one batch) vs a raw sequential file write + fsync (goal 0.7);
* cold ``read_many`` vs a raw ``readinto`` of the same bytes from one file (goal 0.8);
* cold ``read_many`` vs per-block ``torch.save`` files, per-block safetensors files and
  ``diskcache`` when importable (goal 2.0 against the best of them);
* reopen of a store whose index holds 1,000,000 records (100,000 with ``quick``), cold index
  pages, plus a first ``leading_run`` (goal < 2 s).

Cold reads: the page cache of the files read is dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)``
(after an fsync, so the pages are clean and really dropped); the global
``/proc/sys/vm/drop_caches`` is not touched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from kvstore.bench import BenchOptions, BenchRow, throughput_row, time_row
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

SECTION = "disk"
_MiB = 1 << 20


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files_under(d: str) -> list[str]:
    out = []
    for root, _dirs, names in os.walk(d):
        out.extend(os.path.join(root, n) for n in names)
    return out


def _raw_write(path: str, blocks: torch.Tensor) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(blocks.numpy()).cast("B")
        off = 0
        while off < len(view):
            off += os.write(fd, view[off: off + (256 * _MiB)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _raw_read(path: str, out: torch.Tensor) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view = memoryview(out.numpy()).cast("B")
        off = 0
        while off < len(view):
            n = f.readinto(view[off:])
            if not n:
                raise RuntimeError("raw file is short")
            off += n
    return time.perf_counter() - t0


def run(opts: BenchOptions) -> list[BenchRow]:
    from kvstore.bench.fake_index import populate_fake_index
    from kvstore.tiers.disk import DiskTier, DiskWrite, ReadStatus

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                      block_tokens=16)  # Llama-3-8B: 2 MiB per block
    nb = layout.block_nbytes
    total = (32 if opts.quick else 256) * _MiB
    n = total // nb
    ns = Namespace.create("bench/disk", layout)
    base = tempfile.mkdtemp(prefix="kvstore-bench-disk-", dir=opts.workdir)
    rows: list[BenchRow] = []
    try:
        gen = torch.Generator().manual_seed(0)
        blocks = torch.randint(0, 256, (n, nb), dtype=torch.uint8, generator=gen)
        keys = [os.urandom(32) for _ in range(n)]

        # -- write: one batch with fsync vs one raw file with fsync ------------------------
        reps = 1 if opts.quick else 3
        best_raw = best_ours = float("inf")
        raw_path = os.path.join(base, "raw.bin")
        store = ""
        for r in range(reps):
            best_raw = min(best_raw, _raw_write(raw_path, blocks))
            store = os.path.join(base, f"store{r}")
            t = DiskTier(store, capacity_bytes=1 << 50)
            t.register_namespace(ns)
            items = [DiskWrite(k, keys[i - 1] if i else None, ns.id, blocks[i])
                     for i, k in enumerate(keys)]
            t0 = time.perf_counter()
            assert len(t.write_blocks(items)) == n
            best_ours = min(best_ours, time.perf_counter() - t0)
            t.close()
            if r + 1 < reps:
                shutil.rmtree(store)
        rows.append(throughput_row(
            SECTION, "write_blocks (1 batch, fsync)", total, best_ours,
            "raw sequential write+fsync", best_raw, goal=0.7,
            note=f"{n} x {nb // _MiB} MiB blocks; segment temp+fsync+rename+dir fsync+LMDB commit; "
                 f"best of {reps}"))
        # small batches, for information
        small = os.path.join(base, "store-small")
        t = DiskTier(small, capacity_bytes=1 << 50)
        t.register_namespace(ns)
        t0 = time.perf_counter()
        for i in range(0, n, 8):
            t.write_blocks([DiskWrite(os.urandom(32), None, ns.id, blocks[j])
                            for j in range(i, min(n, i + 8))])
        small_s = time.perf_counter() - t0
        t.close()
        shutil.rmtree(small)
        t0 = time.perf_counter()
        for i in range(0, n, 8):
            _raw_write(os.path.join(base, f"raw-small-{i}"), blocks[i: i + 8])
        raw_small_s = time.perf_counter() - t0
        rows.append(throughput_row(
            SECTION, "write_blocks (8-block batches)", total, small_s,
            "raw write+fsync, one file per 8 blocks", raw_small_s,
            note="one durable commit (4 fsyncs) per 16 MiB batch; for information"))

        # -- cold read: ours vs raw readinto -----------------------------------------------
        dsts = torch.empty((n, nb), dtype=torch.uint8)
        t = DiskTier(store, capacity_bytes=1 << 50)
        seg_files = _files_under(os.path.join(store, "segments"))
        best_read = best_rawr = float("inf")
        for _ in range(reps):
            _drop_cache(seg_files)
            t0 = time.perf_counter()
            st = t.read_many(keys, list(dsts))
            best_read = min(best_read, time.perf_counter() - t0)
            assert st == [ReadStatus.OK] * n
            _drop_cache([raw_path])
            best_rawr = min(best_rawr, _raw_read(raw_path, dsts))
        _drop_cache(seg_files)
        t0 = time.perf_counter()
        for k, d in zip(keys, dsts, strict=True):
            t.read_into(k, d)
        serial = time.perf_counter() - t0
        t.close()
        cold_note = "page cache dropped with posix_fadvise(DONTNEED) per file"
        rows.append(throughput_row(
            SECTION, "cold read_many (preadv + xxh3 verify)", total, best_read,
            "raw readinto of one file", best_rawr, goal=0.8,
            note=f"{cold_note}; serial read_into loop: {total / serial / 1e9:.2f} GB/s"))

        # -- cold read vs peers -------------------------------------------------------------
        peers: dict[str, float] = {}
        tdir = os.path.join(base, "torchsave")
        os.makedirs(tdir)
        tpaths = []
        for i in range(n):
            p = os.path.join(tdir, f"{i}.pt")
            torch.save(blocks[i].view(layout.dtype).view(layout.block_shape).clone(), p)
            tpaths.append(p)
        _drop_cache(tpaths)
        t0 = time.perf_counter()
        for i, p in enumerate(tpaths):
            dsts[i].view(layout.dtype).view(layout.block_shape).copy_(
                torch.load(p, weights_only=True))
        peers["per-block torch.save files"] = time.perf_counter() - t0
        shutil.rmtree(tdir)

        from safetensors.torch import load_file, save_file

        sdir = os.path.join(base, "safetensors")
        os.makedirs(sdir)
        spaths = []
        for i in range(n):
            p = os.path.join(sdir, f"{i}.safetensors")
            save_file({"kv": blocks[i].view(layout.dtype).view(layout.block_shape)}, p)
            spaths.append(p)
        _drop_cache(spaths)
        t0 = time.perf_counter()
        for i, p in enumerate(spaths):
            dsts[i].view(layout.dtype).view(layout.block_shape).copy_(load_file(p)["kv"])
        peers["per-block safetensors files"] = time.perf_counter() - t0
        shutil.rmtree(sdir)

        dc_note = "diskcache not installed"
        try:
            import diskcache  # type: ignore[import-not-found]
        except ImportError:
            diskcache = None
        if diskcache is not None:
            ddir = os.path.join(base, "diskcache")
            cache = diskcache.Cache(ddir)
            for i in range(n):
                cache.set(i, blocks[i].numpy().tobytes())
            cache.close()
            cache = diskcache.Cache(ddir)
            _drop_cache(_files_under(ddir))
            t0 = time.perf_counter()
            for i in range(n):
                dsts[i].copy_(torch.frombuffer(bytearray(cache.get(i)), dtype=torch.uint8))
            peers["diskcache"] = time.perf_counter() - t0
            cache.close()
            dc_note = "diskcache measured"
        best_name = min(peers, key=peers.__getitem__)
        others = ", ".join(f"{k}: {total / v / 1e9:.2f} GB/s" for k, v in peers.items())
        rows.append(throughput_row(
            SECTION, "cold read_many vs best peer", total, best_read, best_name, peers[best_name],
            goal=2.0, note=f"{cold_note}; {others}; {dc_note}"))

        # -- reopen with many records ----------------------------------------------------
        nrec = 100_000 if opts.quick else 1_000_000
        big = os.path.join(base, "big")
        t0 = time.perf_counter()
        populate_fake_index(big, nrec, ns)
        build_s = time.perf_counter() - t0
        probe = DiskTier(big, capacity_bytes=1 << 50)
        some = [r.key for _, r in zip(range(16), probe.records(), strict=False)]
        probe.close()
        _drop_cache(_files_under(os.path.join(big, "index")))
        t0 = time.perf_counter()
        t = DiskTier(big, capacity_bytes=1 << 50)
        s = t.stats()
        got = t.leading_run(some)
        reopen_s = time.perf_counter() - t0
        t.close()
        assert s.blocks == nrec and got >= 1
        rows.append(time_row(
            SECTION, f"reopen with {nrec:,} records (cold index)", reopen_s, "goal 2 s", 2.0,
            unit="ms", goal=1.0,
            note=f"open + stats + first leading_run; index built in {build_s:.1f} s "
                 f"({os.path.getsize(os.path.join(big, 'index', 'data.mdb')) / _MiB:.0f} MiB)"))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


if __name__ == "__main__":  # pragma: no cover
    import sys

    for row in run(BenchOptions(quick="--quick" in sys.argv)):
        print(f"{row.name:45s} {row.value:10.3f} {row.unit:5s} vs {row.ref_name:30s} "
              f"{row.ref_value:10.3f}  ratio {row.ratio:5.2f}  goal {row.goal}  {row.note}")
