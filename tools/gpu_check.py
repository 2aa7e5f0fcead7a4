#!/usr/bin/env python
"""One prepared check of kvstore's CUDA paths, for a lent GPU machine (under 5 minutes).

    python tools/gpu_check.py            # prints a table last; JSON to $OUT/gpu_check.json

1. CuPy gather/scatter kernels (kvstore/paged_copy.cu) against the torch reference, on fresh
   random data (never zeros), several page sizes and dtypes.
2. H2D: ``fetch`` from the pinned warm tier into device memory vs a raw pinned ``copy_`` of
   the same bytes; D2H: ``put`` of device tensors into the warm tier (hot tier disabled) vs
   a raw device -> pinned ``copy_``.
3. Layer-wise overlap: ``load_into`` on the copy engine's stream while a matmul stream runs;
   reports how much of the load was hidden behind compute.

Needs torch with CUDA; CuPy optional (the kernel rows are skipped without it). Needs no
lmdb/zstandard: it uses memory tiers only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from kvstore import KVLayout, open_store

ROWS: list[dict] = []


def row(check: str, value: float, unit: str, ref: str, ref_value: float, ratio: float,
        goal: float | None, ok: bool | None, note: str = "") -> None:
    ROWS.append(dict(check=check, value=value, unit=unit, ref=ref, ref_value=ref_value,
                     ratio=ratio, goal=goal, ok=ok, note=note))


def cuda_time(fn, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def check_kernels() -> None:
    from kvstore import kernels
    from kvstore.paged import gather_layer, paged_geometry, scatter_layer

    if not kernels.cuda_kernels_available():
        row("kernels", 0, "", "torch reference", 0, 0, None, None, "CuPy not importable: skipped")
        return
    g = torch.Generator(device="cuda").manual_seed(1234)
    checked = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for ps in (1, 4, 8, 16):
            lay = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype=dtype, block_tokens=16)
            n, num_pages = 7, 97
            pages = [torch.randn(2, num_pages, ps, 8, 128, device="cuda", generator=g).to(dtype) + 1
                     for _ in range(2)]
            geo = paged_geometry(lay, pages)
            ids = torch.randperm(num_pages, device="cuda", generator=g)[: n * geo.pages_per_block]
            blocks = torch.randn(n, 2, 16, 8, 128, device="cuda", generator=g).to(dtype) + 1
            ref, got = pages[0].clone(), pages[0].clone()
            scatter_layer(lay, geo, blocks, ref, ids)
            kernels.scatter_pages(lay, geo, blocks, got, ids)
            torch.cuda.synchronize()
            assert torch.equal(ref, got), f"scatter mismatch dtype={dtype} ps={ps}"
            out_ref = torch.empty_like(blocks)
            out_got = torch.empty_like(blocks)
            gather_layer(lay, geo, pages[1], ids, out_ref)
            kernels.gather_pages(lay, geo, pages[1], ids, out_got)
            torch.cuda.synchronize()
            assert torch.equal(out_ref, out_got), f"gather mismatch dtype={dtype} ps={ps}"
            checked += 1
    row("kernels == torch reference", checked, "cases", "torch index_copy_/index_select",
        checked, 1.0, 1.0, True, "bf16/fp16/fp32 x page sizes 1,4,8,16, random data")


def check_bandwidth() -> None:
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    n = 256  # 512 MiB
    nbytes = n * lay.block_nbytes
    host = torch.randn(lay.batch_shape(n)).to(lay.dtype).pin_memory()
    dev = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device="cuda")
    t_raw_h2d = cuda_time(lambda: dev.copy_(host, non_blocking=True))
    t_raw_d2h = cuda_time(lambda: host.copy_(dev, non_blocking=True))
    with open_store(None, layout=lay, model_id="gpu-check", device="cuda:0", gpu_capacity=0,
                    cpu_capacity=2 * nbytes) as s:
        keys = s.block_keys(list(range(n * 16)))
        s.put(keys, host).wait()
        out = torch.empty_like(dev)
        s.fetch(keys, out=out).wait()
        t_fetch = cuda_time(lambda: s.fetch(keys, out=out).wait())
        assert torch.equal(out.cpu(), host.cpu())
        devkv = host.cuda()

        def put_fresh() -> None:
            s.evict()
            s.put(keys, devkv).wait()

        t_put = cuda_time(put_fresh, repeat=3)
    for name, t, ref, goal in (("fetch warm->GPU (H2D)", t_fetch, t_raw_h2d, 0.9),
                               ("put GPU->warm (D2H)", t_put, t_raw_d2h, None)):
        v, r = nbytes / t / 1e9, nbytes / ref / 1e9
        row(name, v, "GB/s", "raw pinned copy_", r, v / r, goal, None if goal is None else v / r >= goal,
            f"{nbytes >> 20} MiB")


def check_overlap() -> None:
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    n = 128
    with open_store(None, layout=lay, model_id="gpu-overlap", device="cuda:0", gpu_capacity=0,
                    cpu_capacity=2 * n * lay.block_nbytes) as s:
        keys = s.block_keys(list(range(n * 16)))
        s.put(keys, torch.randn(lay.batch_shape(n)).to(lay.dtype)).wait()
        pages = [torch.empty(2, n, 16, 8, 128, dtype=lay.dtype, device="cuda") for _ in range(32)]
        ids = list(range(n))
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        compute = torch.cuda.Stream()

        def matmuls() -> None:
            with torch.cuda.stream(compute):
                for _ in range(20):
                    a @ a

        t_load = cuda_time(lambda: s.load_into(keys, pages, ids).wait(), repeat=3)
        t_mm = cuda_time(matmuls, repeat=3)

        def both() -> None:
            t = s.load_into(keys, pages, ids)
            matmuls()
            t.wait()

        t_both = cuda_time(both, repeat=3)
    hidden = max(0.0, (t_load + t_mm - t_both) / t_load)
    row("load_into overlapped with matmul", hidden * 100, "% hidden", "serial load+matmul",
        (t_load + t_mm) * 1e3, t_mm / t_both if t_both else 0, None, None,
        f"load {t_load * 1e3:.1f} ms, matmul {t_mm * 1e3:.1f} ms, both {t_both * 1e3:.1f} ms")


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    failed = False
    for check in (check_kernels, check_bandwidth, check_overlap):
        try:
            check()
        except Exception as e:  # report every check
            failed = True
            row(check.__name__, 0, "", "", 0, 0, None, False, f"FAILED: {e!r}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.json").write_text(json.dumps(ROWS, indent=2))
    print(f"\n{'check':40} {'value':>12} {'reference':>32} {'ratio':>7} {'goal':>6} ok")
    for r in ROWS:
        print(f"{r['check']:40} {r['value']:10.2f} {r['unit']:<6} {r['ref'][:22]:>22} "
              f"{r['ref_value']:8.2f} {r['ratio']:6.2f}× {'' if r['goal'] is None else r['goal']:>6} "
              f"{'' if r['ok'] is None else ('yes' if r['ok'] else 'NO')}  {r['note']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
