"""The first page-cache fetch right after a store opens against a fetch once the warm slab's
prefault is done (issue 31 item 7), with the prefault paced (the code), unpaced (as before:
64 MiB calls alongside the fetch) and off, interleaved within one run.

    python3 tools/bench_prefault.py [--store DIR] [--opens 24]

A disk store of 8 x 32 blocks of 2 MiB is made once (and read into the page cache); each open
has a 512 MiB warm tier and fetches 64 MiB three times: right after the open, right after
that, and once the prefault is done and 0.3 s later ("steady"). Prints the median times and
first/steady per mode.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

import kvstore.tiers.slab as slab_mod
from kvstore import KVLayout, open_store

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                  block_tokens=16)  # 2 MiB blocks
BLOCKS, GROUPS = 32, 8


class _Off:
    def __init__(self, data: torch.Tensor, **_: object) -> None:
        self.done = threading.Event()
        self.done.set()
        self.error = None

    def pace(self, busy: object) -> None:
        pass

    def stop(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default="/tmp/kvstore-bench-prefault")
    ap.add_argument("--opens", type=int, default=24, help="opens per mode")
    a = ap.parse_args()
    kw = dict(layout=LAYOUT, model_id="bench-prefault", device="cpu", cpu_capacity="512MiB")

    def keys(s, g):
        return s.block_keys(list(range(g * 1000, g * 1000 + BLOCKS * 16)))

    with open_store(a.store, **kw) as s:
        for g in range(GROUPS):
            if s.lookup(keys(s, g)) < BLOCKS:
                s.put(keys(s, g), torch.randn(LAYOUT.batch_shape(BLOCKS)).to(LAYOUT.dtype)).wait()
        s.flush()
    with open_store(a.store, **kw) as s:  # into the page cache
        for g in range(GROUPS):
            s.fetch(keys(s, g)).wait()
    real, real_pace, chunk = slab_mod.Prefault, slab_mod.Prefault.pace, slab_mod._PREFAULT_CHUNK
    modes = ("paced", "unpaced", "off")
    times: dict[str, list[list[float]]] = {m: [[], [], []] for m in modes}
    for i in range(a.opens):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            slab_mod.Prefault = _Off if mode == "off" else real  # type: ignore[misc]
            unpaced = mode == "unpaced"
            slab_mod._PREFAULT_CHUNK = 64 << 20 if unpaced else chunk
            real.pace = (lambda self, busy: None) if unpaced else real_pace  # type: ignore[method-assign]
            with open_store(a.store, **kw) as s:
                for j in range(3):
                    if j == 2:
                        s.state.warm.slab.prefault.done.wait()
                        time.sleep(0.3)
                    t0 = time.perf_counter()
                    s.fetch(keys(s, (3 * i + j) % GROUPS)).wait()
                    times[mode][j].append(time.perf_counter() - t0)
                    s.flush()
    slab_mod.Prefault, real.pace, slab_mod._PREFAULT_CHUNK = real, real_pace, chunk
    gib = BLOCKS * LAYOUT.block_nbytes / 2**30
    for mode, ts in times.items():
        first, second, steady = (statistics.median(t) for t in ts)
        print(f"{mode:8s} first {gib / first:5.2f} GiB/s, second {gib / second:5.2f}, steady "
              f"{gib / steady:5.2f}: first/steady {steady / first:.2f}x")


if __name__ == "__main__":
    main()
