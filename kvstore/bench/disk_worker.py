"""The disk benchmark's fork server: every measured operation runs in a fresh process.

Run as a script (``python disk_worker.py BLOCK_NBYTES NBLOCKS SEED``) by
:mod:`kvstore.bench.disk_harness`, under this interpreter for kvstore and the raw peers and
under LMCache's own virtual environment for LMCache (which cannot import kvstore, so this file
imports neither kvstore nor lmcache at module level). It makes the benchmark's blocks once
(numpy only: no torch thread pool is started before a fork), prints ``{"ready": true}``, then
reads one JSON command a line from stdin, forks a child per command, and answers one JSON line
per command. The child starts with the blocks in memory (shared copy-on-write) and nothing
else: no store open, no slab touched, no file descriptor of an earlier run. That is a fresh
process as an engine restarting is, without paying the interpreter's start-up per operation.

A command ``{"op": NAME, "dir": PATH, ...}`` runs ``OPS[NAME]``; with ``"die": true`` the
child SIGKILLs itself right after answering (a writer killed after ``flush`` returned).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import signal
import sys
import time
import traceback

import numpy as np

_MiB = 1 << 20
_POOL_BYTES = 64 * _MiB
_CHUNK = 64 * _MiB


def make_blocks(n: int, nbytes: int, seed: int) -> np.ndarray:
    """``n`` blocks of ``nbytes``: random rows of a 64 MiB pool, each stamped with its index
    in its first 8 bytes (so a block read from the wrong place never compares equal)."""
    rng = np.random.default_rng(seed)
    rows = max(1, min(n, _POOL_BYTES // nbytes))
    pool = rng.integers(0, 256, size=(rows, nbytes), dtype=np.uint8)
    blocks = np.empty((n, nbytes), dtype=np.uint8)
    for i in range(n):
        blocks[i] = pool[i % rows]
        blocks[i, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return blocks


def settled() -> int:
    """Put the process in the state of an engine's after its start-up, right before a clock
    starts (every method, every operation): vLLM collects and freezes its heap once warm
    (``freeze_gc_heap``), so serving does not pay full collections of the objects its imports
    made. Without it a 1 GiB fetch of 512 blocks in a fresh process paid a 60-90 ms
    generation-2 collection of torch's ~170k objects (a third of the read), by chance of
    where the allocation counters stood."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _touched(shape: tuple[int, ...]):
    """A destination buffer whose pages are resident (an engine's KV memory is)."""
    import torch

    dst = torch.empty(shape, dtype=torch.uint8)
    dst.fill_(1)
    return dst


def _same(blocks: np.ndarray, got) -> int:
    """How many leading blocks of ``got`` equal ``blocks`` (checked after the clock stops)."""
    import torch

    ref = torch.from_numpy(blocks)
    n = 0
    for i in range(min(len(ref), len(got))):
        if not torch.equal(ref[i], got[i]):
            break
        n += 1
    return n


# -- raw peers: the physical limit -----------------------------------------------------------

def raw_write(blocks: np.ndarray, cmd: dict) -> dict:
    path = os.path.join(cmd["dir"], "raw.bin")
    os.makedirs(cmd["dir"], exist_ok=True)
    view = memoryview(blocks).cast("B")
    frozen = settled()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < len(view):
            off += os.write(fd, view[off: off + _CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"seconds": time.perf_counter() - t0, "heap_frozen": frozen}


def raw_read(blocks: np.ndarray, cmd: dict) -> dict:
    dst = _touched(blocks.shape)
    view = memoryview(dst.numpy()).cast("B")
    frozen = settled()
    t0 = time.perf_counter()
    with open(os.path.join(cmd["dir"], "raw.bin"), "rb", buffering=0) as f:
        off = 0
        while off < len(view):
            n = f.readinto(view[off: off + _CHUNK])
            if not n:
                break
            off += n
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "blocks_ok": _same(blocks, dst), "heap_frozen": frozen}


# -- kvstore through its public API ---------------------------------------------------------

def _kv_open(blocks: np.ndarray, cmd: dict):
    import torch

    from kvstore import KVLayout, open_store

    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                   block_tokens=cmd["block_tokens"])  # Llama-3-8B shaped
    if lay.block_nbytes != blocks.shape[1]:
        raise ValueError(f"layout block is {lay.block_nbytes} B, the blocks {blocks.shape[1]} B")
    total = blocks.nbytes
    store = open_store(cmd["dir"], layout=lay, model_id="bench/disk", device="cpu",
                       gpu_capacity=0, cpu_capacity=total + 64 * _MiB,
                       disk_capacity=4 * total + _CHUNK)
    keys = store.block_keys(list(range(len(blocks) * lay.block_tokens)))
    return store, lay, keys


def kvstore_write(blocks: np.ndarray, cmd: dict) -> dict:
    """``put`` in engine-sized pieces (``put_bytes``), then ``flush``: durable on return."""
    import torch

    t_open = time.perf_counter()
    store, lay, keys = _kv_open(blocks, cmd)
    opened = time.perf_counter() - t_open
    kv = torch.from_numpy(blocks).view(lay.dtype).view(lay.batch_shape(len(blocks)))
    step = max(1, cmd.get("put_bytes", 32 * _MiB) // lay.block_nbytes)
    frozen = settled()
    t0 = time.perf_counter()
    for i in range(0, len(blocks), step):
        store.put(keys[i: i + step], kv[i: i + step])
    store.flush()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "open_seconds": opened, "heap_frozen": frozen}


def kvstore_read(blocks: np.ndarray, cmd: dict) -> dict:
    """One ``fetch`` of the whole chain into the caller's (resident) tensor."""
    t_open = time.perf_counter()
    store, lay, keys = _kv_open(blocks, cmd)
    opened = time.perf_counter() - t_open
    dst = _touched((len(blocks), lay.block_nbytes))
    out = dst.view(lay.dtype).view(lay.batch_shape(len(blocks)))
    frozen = settled()
    t0 = time.perf_counter()
    got = store.fetch(keys, out=out).wait()
    seconds = time.perf_counter() - t0
    n = len(got)
    return {"seconds": seconds, "open_seconds": opened, "blocks_found": n,
            "blocks_ok": _same(blocks[:n], dst[:n]), "heap_frozen": frozen}


OPS = {
    "raw.write": raw_write, "raw.read": raw_read,
    "kvstore.write": kvstore_write, "kvstore.read": kvstore_read,
}


def _load_lmcache_ops() -> None:
    """LMCache's operations live beside this file; loaded by path (this runs as a script in
    LMCache's environment, where ``kvstore`` is not importable)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disk_lmcache.py")
    spec = importlib.util.spec_from_file_location("kvstore_bench_disk_lmcache", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.settled = settled
    mod.preload()  # imported once here, not in every child
    OPS.update(mod.OPS)


def _child(blocks: np.ndarray, cmd: dict, w: int) -> None:
    try:
        res = {"ok": True, "result": OPS[cmd["op"]](blocks, cmd)}
    except BaseException as e:  # reported to the parent, which decides
        traceback.print_exc()
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with os.fdopen(w, "w") as f:
        f.write(json.dumps(res))
    sys.stdout.flush()
    sys.stderr.flush()
    if cmd.get("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)


def serve(blocks: np.ndarray) -> None:
    """Answer commands until stdin closes (see the module docstring)."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the protocol
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(blocks, cmd, w)
        os.close(w)
        with os.fdopen(r) as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        try:
            res = json.loads(data)
        except ValueError:
            res = {"ok": False, "error": f"child died without an answer (wait status {status})"}
        proto.write(json.dumps(res) + "\n")
        proto.flush()


def main(argv: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))  # no sibling shadows a library's module
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    nbytes, n, seed = (int(a) for a in argv[:3])
    if "--lmcache" in argv:
        try:
            _load_lmcache_ops()
        except Exception as e:  # not installed, or an incompatible release: a skip, said why
            print(json.dumps({"ready": False, "error": f"LMCache is not importable here "
                              f"({type(e).__name__}: {e})"}), flush=True)
            return
    else:
        import kvstore.store  # imported once here, not in every child
        import kvstore.tiers.disk  # noqa: F401
    serve(make_blocks(n, nbytes, seed))


if __name__ == "__main__":  # pragma: no cover - run by the harness as a script
    main(sys.argv[1:])
