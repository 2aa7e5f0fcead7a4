"""Benchmark section ``packs``: ``kvstore export`` and ``kvstore import`` of a prefix pack
against ``cp`` of the same bytes, interleaved in one run (goal 0.8).

* export (read the segments, verify every block, write and fsync the pack) vs ``cp`` of the
  segment files holding those blocks;
* import (verify the whole pack, then write the segments, fsync, one index commit) into an
  empty store vs ``cp`` of the pack file. Its writing is the disk tier's ``write_blocks``
  (temp file, fsync, link, directory fsync, synchronous LMDB commit), whose own ratio to a raw
  write + fsync the ``disk`` section measures: that bounds this one.

The peers are the ``cp`` binary followed by an fsync of what it wrote (ours are durable when
they return; a bare ``cp`` leaves dirty pages behind and is noted beside each row). Sources
are warm in the page cache for both, as after a fresh export or download.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from kvstore.bench import BenchOptions, BenchRow, throughput_row
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

SECTION = "packs"
_MiB = 1 << 20


def _fsync_tree(d: str) -> None:
    for root, _dirs, names in os.walk(d):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _cp(srcs: list[str], dst_dir: str, *, sync: bool) -> float:
    """Seconds for ``cp`` of ``srcs`` into ``dst_dir`` (then fsync of the copies)."""
    os.makedirs(dst_dir)
    t0 = time.perf_counter()
    subprocess.run(["cp", *srcs, dst_dir], check=True)
    if sync:
        _fsync_tree(dst_dir)
    dt = time.perf_counter() - t0
    shutil.rmtree(dst_dir)
    return dt


def _write_blocks(store: str, ns: Namespace, blocks: torch.Tensor,
                  keys: list[bytes]) -> float:
    """Seconds for the disk tier's ``write_blocks`` of ``blocks`` (one batch) into ``store``."""
    from kvstore.tiers.disk import DiskTier, DiskWrite

    t = DiskTier(store, capacity_bytes=1 << 50)
    try:
        t.register_namespace(ns)
        items = [DiskWrite(k, keys[i - 1] if i else None, ns.id, blocks[i])
                 for i, k in enumerate(keys)]
        t0 = time.perf_counter()
        t.write_blocks(items)
        return time.perf_counter() - t0
    finally:
        t.close()


def _build(base: str, layout: KVLayout, ns: Namespace, n: int) -> tuple[str, torch.Tensor,
                                                                         list[bytes]]:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (n, layout.block_nbytes), dtype=torch.uint8, generator=gen)
    keys = [os.urandom(32) for _ in range(n)]
    store = os.path.join(base, "P")
    _write_blocks(store, ns, blocks, keys)
    return store, blocks, keys


def run(opts: BenchOptions) -> list[BenchRow]:
    from kvstore.packs import export_pack, import_pack
    from kvstore.tiers.disk import DiskTier

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                      block_tokens=16)  # Llama-3-8B: 2 MiB per block
    total = (32 if opts.quick else 256) * _MiB
    n = total // layout.block_nbytes
    ns = Namespace.create("bench/packs", layout)
    base = tempfile.mkdtemp(prefix="kvstore-bench-packs-", dir=opts.workdir)
    reps = 2 if opts.quick else 5
    times: dict[str, list[float]] = {k: [] for k in
                                     ("export", "cp_seg", "cp_seg_nosync", "import", "cp_pack",
                                      "cp_pack_nosync", "write_blocks")}
    try:
        store, blocks, keys = _build(base, layout, ns, n)
        segdir = os.path.join(store, "segments")
        segs = [os.path.join(segdir, f) for f in sorted(os.listdir(segdir))]
        pack = os.path.join(base, "p.kvpack")
        for r in range(reps):  # interleaved: each peer right before or after ours
            times["cp_seg"].append(_cp(segs, os.path.join(base, f"cs{r}"), sync=True))
            if os.path.exists(pack):
                os.unlink(pack)
            t0 = time.perf_counter()
            export_pack(store, ns.id.hex(), pack)
            times["export"].append(time.perf_counter() - t0)
            times["cp_seg_nosync"].append(_cp(segs, os.path.join(base, f"cn{r}"), sync=False))
            times["cp_pack"].append(_cp([pack], os.path.join(base, f"cp{r}"), sync=True))
            q = os.path.join(base, f"Q{r}")
            DiskTier(q, capacity_bytes=0).close()  # an empty store, as on a fresh host
            t0 = time.perf_counter()
            res = import_pack(pack, q)
            times["import"].append(time.perf_counter() - t0)
            assert res.imported == n
            shutil.rmtree(q)
            times["cp_pack_nosync"].append(_cp([pack], os.path.join(base, f"cq{r}"), sync=False))
            w = os.path.join(base, f"W{r}")
            times["write_blocks"].append(_write_blocks(w, ns, blocks, keys))
            shutil.rmtree(w)
        med = {k: statistics.median(v) for k, v in times.items()}
        seg_bytes = sum(os.path.getsize(s) for s in segs)
        pack_bytes = os.path.getsize(pack)
        note = (f"{n} x {layout.block_nbytes // _MiB} MiB blocks; median of {reps}, interleaved; "
                "every block verified; fsynced")
        return [
            throughput_row(SECTION, "export (read + verify + write pack)", total, med["export"],
                           "cp of the segment files + fsync", med["cp_seg"] * total / seg_bytes,
                           goal=0.8, note=f"{note}; bare cp (no fsync) "
                           f"{seg_bytes / med['cp_seg_nosync'] / 1e9:.2f} GB/s"),
            throughput_row(SECTION, "import (verify + write segments + commit)", total,
                           med["import"], "cp of the pack + fsync",
                           med["cp_pack"] * total / pack_bytes, goal=0.8,
                           note=f"{note}; bare cp (no fsync) "
                           f"{pack_bytes / med['cp_pack_nosync'] / 1e9:.2f} GB/s"),
            throughput_row(SECTION, "import (verify + write segments + commit)", total,
                           med["import"], "write_blocks of the same blocks from memory",
                           med["write_blocks"],
                           note="for information: what import adds to the disk tier's own "
                           "durable write (verification, mapping the pack)"),
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
