"""LMCache 0.5.6 as a peer of the disk benchmark: its ``LocalDiskBackend`` and its
``FSL2Adapter``, each through its own public calls. Loaded by path by
:mod:`kvstore.bench.disk_worker` running in LMCache's virtual environment (never imported
by kvstore: this environment has no kvstore).

* ``LocalDiskBackend``: ``submit_put_task`` per block (one file each, written without fsync),
  ``batched_get_blocking`` (a thread pool of ``readinto``) into memory objects of its CPU
  backend. Its index is a dict in memory: a restarted process finds nothing, so its writes,
  cold read and page-cache read run in one process (``lmcache_disk.all``) and a fresh process
  only counts what it finds (``lmcache_disk.survive``).
* ``FSL2Adapter``: ``submit_store_task`` / ``submit_load_task`` of the whole batch (one file
  per block, names encoding the key, so a fresh process finds them): writes and reads in
  fresh processes like kvstore's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import numpy as np
import torch

_LAYERS, _HEADS, _HEAD_DIM = 32, 8, 128


def settled() -> None:
    """Replaced by the loader with ``disk_worker.settled`` (collect and freeze the heap before
    a clock starts, as for every method): this file cannot import kvstore."""
    raise RuntimeError("disk_lmcache runs under kvstore.bench.disk_worker, which sets settled")


def preload() -> None:
    """Import what the operations use (raises ImportError when LMCache is not there)."""
    import lmcache.v1.distributed.l2_adapters.fs_l2_adapter
    import lmcache.v1.storage_backend.local_disk_backend  # noqa: F401

    _quiet()


def _quiet() -> None:
    logging.disable(logging.WARNING)
    for name in ("lmcache",):
        logging.getLogger(name).setLevel(logging.ERROR)


def _shape(cmd: dict) -> torch.Size:
    return torch.Size([2, _LAYERS, cmd["block_tokens"], _HEADS * _HEAD_DIM])  # KV_2LTD


def _same(blocks: np.ndarray, tensors: list) -> int:
    ref = torch.from_numpy(blocks)
    n = 0
    for i, t in enumerate(tensors):
        if t is None or not torch.equal(ref[i], t.reshape(-1).view(torch.uint8)):
            break
        n += 1
    return n


def _drop_cache(d: str) -> None:
    for name in os.listdir(d):
        fd = os.open(os.path.join(d, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- LocalDiskBackend ---------------------------------------------------------------------------

def _local_disk(cmd: dict, n: int):
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    _quiet()
    os.makedirs(cmd["dir"], exist_ok=True)
    nbytes = 2 * _LAYERS * cmd["block_tokens"] * _HEADS * _HEAD_DIM * 2
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=cmd["block_tokens"], local_disk=cmd["dir"],
        max_local_disk_size=(4 * n * nbytes) / (1 << 30) + 1.0, local_cpu=False,
        max_local_cpu_size=1.0)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cpu = LocalCPUBackend(cfg, memory_allocator=AdHocMemoryAllocator(device="cpu"))
    disk = LocalDiskBackend(cfg, loop, cpu, dst_device="cpu")
    keys = [CacheEngineKey("bench/disk", 1, 0, i, torch.bfloat16) for i in range(n)]
    return cpu, disk, keys


def _local_put(cpu, disk, keys, blocks: np.ndarray, shape) -> float:
    from lmcache.v1.memory_management import MemoryFormat

    src = torch.from_numpy(blocks)
    left = [len(keys)]
    lock, done = threading.Lock(), threading.Event()

    def written(_key) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    settled()
    t0 = time.perf_counter()
    for i, key in enumerate(keys):
        obj = cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        obj.tensor.view(-1).view(torch.uint8).copy_(src[i])
        disk.submit_put_task(key, obj, on_complete_callback=written)
        obj.ref_count_down()
    if not done.wait(600):
        raise TimeoutError("LMCache's disk writes did not complete in 600 s")
    return time.perf_counter() - t0


def _local_get(disk, keys, blocks: np.ndarray) -> tuple[float, int]:
    settled()
    t0 = time.perf_counter()
    got = disk.batched_get_blocking(keys)
    seconds = time.perf_counter() - t0
    ok = _same(blocks, [None if g is None else g.tensor for g in got])
    for g in got:
        if g is not None:
            g.ref_count_down()
    return seconds, ok


def local_all(blocks: np.ndarray, cmd: dict) -> dict:
    """Write, then cold read (its files fsynced and dropped from the page cache), then a
    page-cache read, all in this one process (its index lives only here)."""
    cpu, disk, keys = _local_disk(cmd, len(blocks))
    put_s = _local_put(cpu, disk, keys, blocks, _shape(cmd))
    _drop_cache(cmd["dir"])
    cold_s, cold_ok = _local_get(disk, keys, blocks)
    warm_s, warm_ok = _local_get(disk, keys, blocks)
    return {"seconds": put_s, "cold_seconds": cold_s, "cold_ok": cold_ok,
            "warm_seconds": warm_s, "warm_ok": warm_ok}


def local_survive(blocks: np.ndarray, cmd: dict) -> dict:
    """What a restarted process finds of what an earlier one wrote."""
    _cpu, disk, keys = _local_disk(cmd, len(blocks))
    return {"seconds": 0.0, "blocks_found": sum(1 for k in keys if disk.contains(k))}


# -- FSL2Adapter ------------------------------------------------------------------------------

def _fsl2(cmd: dict, n: int):
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2Adapter, FSL2AdapterConfig

    _quiet()
    adapter = FSL2Adapter(FSL2AdapterConfig(base_path=cmd["dir"]))
    keys = [ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name="bench-disk", kv_rank=0)
            for i in range(n)]
    return adapter, keys


def _objects(cmd: dict, n: int) -> list:
    from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat

    alloc = AdHocMemoryAllocator(device="cpu")
    return [alloc.allocate(_shape(cmd), torch.bfloat16, fmt=MemoryFormat.KV_2LTD)
            for _ in range(n)]


def _wait(poll, task_id: int, what: str):
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        got = poll(task_id)
        if got is not None:
            return got
        time.sleep(0.0005)
    raise TimeoutError(f"FSL2Adapter {what} task did not complete in 600 s")


def fsl2_write(blocks: np.ndarray, cmd: dict) -> dict:
    adapter, keys = _fsl2(cmd, len(blocks))
    src = torch.from_numpy(blocks)
    try:
        settled()
        t0 = time.perf_counter()
        objs = _objects(cmd, len(blocks))
        for i, o in enumerate(objs):
            o.tensor.view(-1).view(torch.uint8).copy_(src[i])
        tid = adapter.submit_store_task(keys, objs)
        res = _wait(lambda t: adapter.pop_completed_store_tasks().get(t), tid, "store")
        seconds = time.perf_counter() - t0
    finally:
        adapter.close()
    return {"seconds": seconds, "stored": bool(getattr(res, "success", res))}


def fsl2_read(blocks: np.ndarray, cmd: dict) -> dict:
    adapter, keys = _fsl2(cmd, len(blocks))
    try:
        objs = _objects(cmd, len(blocks))
        settled()
        t0 = time.perf_counter()
        tid = adapter.submit_load_task(keys, objs)
        bitmap = _wait(adapter.query_load_result, tid, "load")
        seconds = time.perf_counter() - t0
        found = sum(1 for i in range(len(keys)) if bitmap.test(i))
    finally:
        adapter.close()
    return {"seconds": seconds, "blocks_found": found,
            "blocks_ok": _same(blocks, [o.tensor for o in objs])}


OPS = {
    "lmcache_disk.all": local_all, "lmcache_disk.survive": local_survive,
    "lmcache_fsl2.write": fsl2_write, "lmcache_fsl2.read": fsl2_read,
}
