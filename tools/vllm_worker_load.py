"""The vLLM worker's load of blocks on disk, on the engine's thread, with and without the
scheduler's located records (issue 32): ``WorkerSide._load_direct`` of one run, interleaved.

An embedded store on a temporary directory holds ``--blocks`` blocks of the
``tools/vllm_bench.py --fp32-small`` geometry (8 layers, 2 KV heads of 64, float32,
block_size 32: 256 KiB a block) on disk only, page cache warm (or dropped before every load
with ``--dropped``). Each round loads them once as the worker did before (it locates every
block itself) and once with what the scheduler's lookup located (``BlockRun.located``: the
store re-checks the last block of the stretch), in alternating order. Needs no vLLM::

    .venv/bin/python tools/vllm_worker_load.py --blocks 128 --reps 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch

from kvstore import KVLayout, open_store
from kvstore.integrations.vllm.scheduler import located_window
from kvstore.integrations.vllm.stats import ConnectorStats
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.store import fetch as _fetch


def _drop_page_cache(root: str) -> None:
    for d, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=100, help="rounds (one load of each kind)")
    ap.add_argument("--dropped", action="store_true", help="page cache dropped before each load")
    a = ap.parse_args()
    n, layers = a.blocks, 8
    lay = KVLayout(num_layers=layers, num_kv_heads=2, head_dim=128, dtype="float32",
                   block_tokens=32, kv_planes=1)
    with tempfile.TemporaryDirectory(prefix="kvstore-load-") as d:
        store = open_store(d, layout=lay, model_id="load/bench", device="cpu",
                           cpu_capacity=(n + 16) * lay.block_nbytes, disk_capacity="4GiB")
        keys = list(store.block_keys(list(range(n * 32 + 1))))
        assert store.put(keys, torch.randn(lay.batch_shape(n))).wait() == n
        store.flush()
        store.evict(tier="warm")
        pages = [torch.zeros(n + 8, 2, 32, 128) for _ in range(layers)]
        w = WorkerSide(store, layout=lay, namespace_id=bytes(store.namespace_id),
                       page_kind="cpu", layerwise=False, max_model_len=1 << 20,
                       stats=ConnectorStats("worker", "embedded", None))
        w.register_kv_caches({f"model.layers.{i}.self_attn.attn": p for i, p in enumerate(pages)})
        found, stretches = store.zero_copy.placement(keys)
        assert found == n
        located = located_window([(s, t, list(h)) for s, t, h in stretches], 0, n)
        ids = list(range(4, 4 + n))
        runs = {"before: the worker locates": SimpleNamespace(
                    req_id="r", keys=keys, parent=None, block_ids=ids, located=[]),
                "after: the scheduler's records": SimpleNamespace(
                    req_id="r", keys=keys, parent=None, block_ids=ids, located=located)}
        disk = store.state.lower[0]
        located_keys: list[int] = []
        real_locate = disk.locate

        def locate(ks):
            located_keys.append(len(ks))
            return real_locate(ks)

        disk.locate = locate
        plan_ms: list[float] = []
        real_plan = _fetch.Fetcher.plan

        def plan(self, *args, **kw):
            t0 = time.perf_counter()
            try:
                return real_plan(self, *args, **kw)
            finally:
                plan_ms.append((time.perf_counter() - t0) * 1e3)

        _fetch.Fetcher.plan = plan  # type: ignore[method-assign]
        got: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "plan": [],
                                                      "keys": []} for k in runs}
        order = list(runs)
        for rep in range(a.reps + 3):
            for name in order if rep % 2 else order[::-1]:
                if a.dropped:
                    _drop_page_cache(d)
                located_keys.clear()
                plan_ms.clear()
                t0, c0 = time.perf_counter(), time.thread_time()
                w._load_direct(runs[name])
                c1, t1 = time.thread_time(), time.perf_counter()
                assert not w.get_block_ids_with_load_errors(), "a load came back short"
                if rep >= 3:  # the first rounds warm up
                    g = got[name]
                    g["wall"].append((t1 - t0) * 1e3)
                    g["cpu"].append((c1 - c0) * 1e3)
                    g["plan"].append(plan_ms[0])
                    g["keys"].append(sum(located_keys))
        store.close()
    print(f"{n} blocks ({n * lay.block_nbytes >> 20} MiB), {a.reps} rounds, page cache "
          f"{'dropped' if a.dropped else 'warm'}, load average {os.getloadavg()[0]:.1f}")
    print("| load | wall (median) | engine thread CPU (median) | Fetcher.plan (median) "
          "| keys located |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, g in got.items():
        print(f"| {name} | {statistics.median(g['wall']):.2f} ms | "
              f"{statistics.median(g['cpu']):.2f} ms | {statistics.median(g['plan']):.3f} ms | "
              f"{int(statistics.median(g['keys']))} |")


if __name__ == "__main__":
    main()
