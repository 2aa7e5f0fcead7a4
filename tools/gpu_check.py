#!/usr/bin/env python
"""One prepared check of kvstore's CUDA paths, for a lent GPU machine (one command, < 10 min).

    python tools/gpu_check.py          # on the GPU; a Markdown table last, JSON to $OUT
    python tools/gpu_check.py --cpu    # every check it can on torch's CPU fallback (CI)

Checks (each in its own try: one failure never hides the others):

1. preflight: versions (torch, CUDA, CuPy, NVRTC) and compiling both kernels (NVRTC log).
2. kernels == torch reference on the real inputs: non-contiguous ``kv[:, layer]`` slices, 8-bit
   data, page sizes 1..16, enough pages for every id asked for.
3. race: a side stream sleeps then writes ``kv``; ``put``/``save_from`` with no sync; fetch
   back; ``torch.equal`` (CPU: the recording fake of kvstore.streams asserts the same order).
4. open: warm slab bytes (pinned on CUDA) and open time; the pinned bytes are exactly the
   slab's (cudaHostRegister on its own mapping, not torch's caching host allocator, which
   rounds up to a power of two) and are unpinned at close (CPU: through a fake registrar).
5. round trip with a hot tier (``gpu_capacity > 0``): hot hit, promotion, demotion,
   concurrent put and fetch; demotion overlap: a put that demotes a full hot tier returns
   before the hot -> warm copies land (they run on the d2h stream, not under the lock).
6. layer-wise loading: ``load_into`` + ``wait_layer`` on a non-default stream.
7. a forced device fault in a subprocess surfaces as an error, not a hang.
8. (GPU) H2D/D2H bandwidth against raw pinned copies, hot tier on.

Exit status 0 when every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS: list[dict] = []


def row(check: str, ok: bool | None, value: str, note: str = "") -> None:
    ROWS.append(dict(check=check, ok=ok, value=value, note=note))


class Ctx:
    def __init__(self, cpu: bool) -> None:
        import torch

        self.cpu = cpu
        self.torch = torch
        self.device = torch.device("cpu") if cpu else torch.device("cuda", 0)
        self.fake = None

    def sync(self) -> None:
        if not self.cpu:
            self.torch.cuda.synchronize()

    def store(self, hot_blocks: int, warm_blocks: int, lay):
        from kvstore import open_store

        return open_store(None, layout=lay, model_id="gpu-check", device=str(self.device),
                          gpu_capacity=hot_blocks * lay.block_nbytes,
                          cpu_capacity=warm_blocks * lay.block_nbytes)

    def use_fake(self):
        """On the CPU: stores opened from now on take the CUDA branches on the recording fake."""
        import kvstore.streams as streams

        if self.cpu:
            self.fake = streams.RecordingStreams()
            streams.streams_for = lambda device: self.fake
        return self.fake


def check_preflight(c: Ctx) -> None:
    from kvstore import kernels

    torch = c.torch
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    st = kernels.preflight(None if c.cpu else c.device)
    if c.cpu:
        row("preflight", True, versions, f"kernels: {st.reason or 'available'} (torch path)")
        return
    row("preflight", st.available, f"{versions}, CuPy {st.cupy or '-'}, NVRTC {st.nvrtc or '-'}",
        st.reason + (f": {st.log[:200]}" if st.log else ""))


def check_kernels(c: Ctx) -> None:
    from kvstore import KVLayout, kernels
    from kvstore.paged import gather_layer, paged_geometry, scatter_layer

    torch = c.torch
    g = torch.Generator(device=c.device).manual_seed(1234)
    checked = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.uint8):
        for ps in (1, 4, 8, 16):
            lay = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype=dtype, block_tokens=16)
            n = 7
            ppb = 16 // ps
            num_pages = n * ppb + 13  # every id asked for exists (randperm(97) gave 97 < 112)

            def rand(*shape, dtype=dtype):
                if dtype == torch.uint8:
                    return torch.randint(1, 255, shape, device=c.device, generator=g, dtype=dtype)
                return torch.randn(*shape, device=c.device, generator=g).to(dtype) + 1

            pages = [rand(2, num_pages, ps, 4, 64) for _ in range(2)]
            geo = paged_geometry(lay, pages)
            ids = torch.randperm(num_pages, device=c.device, generator=g)[: n * ppb]
            kv = rand(n, 2, 2, 16, 4, 64)  # [n, L, P, T, H, D]
            blocks = kv[:, 1]  # the real input: a non-contiguous layer slice
            ref, got = pages[0].clone(), pages[0].clone()
            scatter_layer(lay, geo, blocks, ref, ids)
            kernels.scatter_pages(lay, geo, blocks, got, ids)
            c.sync()
            assert torch.equal(ref, got), f"scatter mismatch dtype={dtype} ps={ps}"
            out = torch.empty_like(kv)
            out_ref = torch.empty_like(blocks)
            gather_layer(lay, geo, pages[1], ids, out_ref)
            kernels.gather_pages(lay, geo, pages[1], ids, out[:, 0])  # non-contiguous out
            c.sync()
            assert torch.equal(out_ref, out[:, 0]), f"gather mismatch dtype={dtype} ps={ps}"
            checked += 1
    path = "torch fallback" if c.cpu or not kernels.cuda_kernels_available(c.device) else "CuPy kernels"
    row("kernels == torch reference", True, f"{checked} cases",
        f"{path}; bf16/fp16/fp32/uint8 x page sizes 1,4,8,16, non-contiguous layer slices")


def _writer(c: Ctx, kv):
    """Write ``kv`` late on a side stream (GPU: after a sleep), as a forward would."""
    torch = c.torch
    if c.cpu:
        fwd = c.fake.new_stream("forward")
        c.fake.access(fwd, writes=[kv], what="forward")
        return c.fake.use(fwd)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the write lands after kv was made
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms of spinning before the write lands
        kv.fill_(3)
    return torch.cuda.stream(side)


def check_race(c: Ctx) -> None:
    from kvstore import KVLayout

    torch = c.torch
    c.use_fake()
    lay = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float16, block_tokens=16)
    with c.store(16, 32, lay) as s:
        keys = s.block_keys(list(range(4 * 16)))
        kv = torch.zeros(lay.batch_shape(4), dtype=lay.dtype, device=c.device)
        with _writer(c, kv):
            if c.cpu:
                kv.fill_(3)
            t = s.put(keys, kv)  # no sync: the put must wait for the side stream itself
        assert t.wait(60) == 4
        got = s.fetch(keys).wait(60)
        c.sync()
        same = bool(torch.equal(got.cpu(), torch.full_like(got, 3).cpu()))
        pages = [torch.zeros(2, 8, 16, 4, 64, dtype=lay.dtype, device=c.device) for _ in range(4)]
        with _writer(c, pages[0]):
            if c.cpu:
                pages[0].fill_(3)
            t2 = s.save_from(pages, [1, 2], s.block_keys(list(range(1000, 1032))))
        assert t2.wait(60) == 2
        back = s.fetch(s.block_keys(list(range(1000, 1032)))).wait(60)
        c.sync()
        same = same and bool((back[:, 0].cpu() == 3).all())
    bad = c.fake.violations if c.fake is not None else []
    row("race: put/save_from after a late write", same and not bad,
        "equal" if same else "WRONG KV", f"fake: {len(bad)} ordering violations" if c.cpu else "")
    assert same and not bad, bad[:3]


def check_open(c: Ctx) -> None:
    from kvstore import KVLayout

    torch = c.torch
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    warm = 256 if c.cpu else 2048  # 512 MiB / 4 GiB
    t0 = time.perf_counter()
    with c.store(0, warm, lay) as s:
        dt = time.perf_counter() - t0
        slab = s.state.warm.slab
        row("open: warm slab", True, f"{slab.nbytes >> 20} MiB in {dt * 1e3:.0f} ms",
            f"pinned={slab.pinned}")


def check_round_trip(c: Ctx) -> None:
    import threading

    from kvstore import KVLayout

    torch = c.torch
    c.use_fake()
    lay = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float16, block_tokens=16)
    with c.store(4, 32, lay) as s:
        kvs = [torch.randn(lay.batch_shape(4), device=c.device).to(lay.dtype) for _ in range(4)]
        chains = [s.block_keys(list(range(i * 1000, i * 1000 + 64))) for i in range(4)]
        assert s.put(chains[0], kvs[0]).wait(60) == 4
        assert torch.equal(s.fetch(chains[0]).wait(60), kvs[0])  # hot hit
        for ch, kv in zip(chains[1:], kvs[1:], strict=True):  # demotes chain 0 to warm
            assert s.put(ch, kv).wait(60) == 4
        assert torch.equal(s.fetch(chains[0]).wait(60), kvs[0])  # warm hit, promoted
        s.flush()
        errors: list[BaseException] = []

        def puts() -> None:
            try:
                for i in range(20):
                    kv = torch.randn(lay.batch_shape(2), device=c.device).to(lay.dtype)
                    s.put(s.block_keys(list(range(50_000 + i * 32, 50_000 + i * 32 + 32))), kv).wait(60)
            except BaseException as e:
                errors.append(e)

        th = threading.Thread(target=puts)
        th.start()
        for _ in range(20):
            for ch, kv in zip(chains, kvs, strict=True):
                got = s.fetch(ch).wait(60)
                assert torch.equal(got, kv[: got.shape[0]])
        th.join()
        assert not errors, errors
        st = s.stats()
    bad = c.fake.violations if c.fake is not None else []
    assert not bad, bad[:3]
    row("round trip with a hot tier", True, "hot hit, demotion, promotion, concurrent put+fetch",
        f"put_dropped {st.put_dropped}")


def check_pinned(c: Ctx) -> None:
    from kvstore import KVLayout
    from kvstore.memcheck import pinned_host_bytes
    from kvstore.tiers import slab as slab_mod

    torch = c.torch
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    blocks = 40 if c.cpu else 640  # 80 MiB / 1.25 GiB: not a power of two
    calls: list[tuple] = []
    real = slab_mod.REGISTRAR

    class Recording:
        def available(self) -> bool:
            return True if c.cpu else real.available()

        def register(self, ptr: int, nbytes: int) -> None:
            calls.append(("register", ptr, nbytes))
            if not c.cpu:
                real.register(ptr, nbytes)

        def unregister(self, ptr: int) -> None:
            calls.append(("unregister", ptr))
            if not c.cpu:
                real.unregister(ptr)

    slab_mod.REGISTRAR = Recording()
    try:
        before = pinned_host_bytes()
        host_before = _host_allocator_bytes(c)
        slab = slab_mod.Slab(lay, blocks * lay.block_nbytes, torch.device("cpu"), pin_memory=True)
        locked = pinned_host_bytes() - before
        grew = _host_allocator_bytes(c) - host_before
        ptr = slab.data.data_ptr()
        slab.close()
        after = pinned_host_bytes() - before
    finally:
        slab_mod.REGISTRAR = real
    ok = (calls == [("register", ptr, slab.nbytes), ("unregister", ptr)]
          and locked == slab.nbytes and after == 0 and grew == 0)
    row("pinned warm slab: exact bytes", ok,
        f"{locked >> 20} MiB locked for a {slab.nbytes >> 20} MiB slab, {after} B after close",
        ("fake registrar" if c.cpu else "cudaHostRegister") + f"; caching host allocator +{grew} B")
    assert ok, calls


def _host_allocator_bytes(c: Ctx) -> int:
    """Bytes torch's caching host allocator holds (0 where it does not say)."""
    if c.cpu:
        return 0
    try:
        stats = c.torch.cuda.host_memory_stats()
        return int(stats.get("reserved_bytes.current", stats.get("segment.current", 0)))
    except Exception:
        return 0


def check_demotion_overlap(c: Ctx) -> None:
    import threading

    from kvstore import KVLayout
    from kvstore.store.copy_engine import Job
    from kvstore.transfer import Transfer

    torch = c.torch
    c.use_fake()
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    n = 4 if c.cpu else 64  # 8 MiB / 128 MiB of hot blocks demoted by one put
    with c.store(n, 4 * n, lay) as s:
        kv0 = torch.randn(lay.batch_shape(n), device=c.device).to(lay.dtype)
        kv1 = torch.randn(lay.batch_shape(n), device=c.device).to(lay.dtype)
        k0 = s.block_keys(list(range(n * 16)))
        k1 = s.block_keys(list(range(10**6, 10**6 + n * 16)))
        s.put(k0, kv0).wait(60)
        s.flush()
        eng = s.state.engine
        gate = threading.Event()
        if c.cpu:  # hold the d2h path: the demotion copies are still "in flight" below
            eng.submit("d2h", Job(Transfer(), lambda st: (gate.wait(30), [])[1], lambda ok, e: None))
        c.sync()
        t0 = time.perf_counter()
        t = s.put(k1, kv1)  # hot is full of k0 (no lower copy): all of it is demoted
        t_call = time.perf_counter() - t0
        in_flight = sum(1 for k in k0 if k in s.state.pending)
        free = s.state.lock.acquire(timeout=5)
        if free:
            s.state.lock.release()
        gate.set()
        t.wait(60)
        s.flush()
        t_all = time.perf_counter() - t0
        st = s.stats()
        on_d2h = True
        if c.cpu:
            d2h = eng.stream("d2h").name
            on_d2h = [e[1] for e in c.fake.log if e[0] == "access" and e[2] == "demotion"] == [d2h] * n
        same = bool(torch.equal(s.fetch(k0).wait(60).cpu(), kv0.cpu()))
    bad = c.fake.violations if c.fake is not None else []
    demoted = st.tier("warm").demotions_in
    ok = same and free and on_d2h and demoted >= n and not bad and (not c.cpu or in_flight == n)
    if not ok:
        row("demotion overlap", False, "FAILED", f"equal={same} lock free={free} on d2h={on_d2h} "
            f"demoted={demoted} in flight={in_flight} violations={bad[:2]}")
        raise AssertionError("demotion overlap")
    row("demotion overlap", ok,
        f"put returned in {t_call * 1e3:.1f} ms, {demoted} demotions landed by {t_all * 1e3:.1f} ms",
        f"{in_flight} still copying at return; lock free meanwhile: {free}"
        + (f"; fake: {len(bad)} ordering violations" if c.cpu else ""))
    assert ok, bad[:3]


def check_layerwise(c: Ctx) -> None:
    from kvstore import KVLayout

    torch = c.torch
    c.use_fake()
    lay = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype=torch.float16, block_tokens=16)
    with c.store(16, 32, lay) as s:
        keys = s.block_keys(list(range(8 * 16)))
        kv = torch.randn(lay.batch_shape(8)).to(lay.dtype)
        s.put(keys, kv).wait(60)
        pages = [torch.zeros(2, 16, 16, 4, 64, dtype=lay.dtype, device=c.device) for _ in range(8)]
        ids = list(range(8, 16))
        side = c.fake.new_stream("forward") if c.cpu else torch.cuda.Stream()
        ctx = c.fake.use(side) if c.cpu else torch.cuda.stream(side)
        with ctx:
            t = s.load_into(keys, pages, ids)
            for layer in range(8):
                t.wait_layer(layer, 60)
                ok = torch.equal(pages[layer][:, 8:16].cpu(), kv[:, layer].transpose(0, 1).cpu())
                assert ok, f"layer {layer} not in place after wait_layer"
            assert t.wait(60) == 8
    row("layer-wise load_into + wait_layer", True, "8 layers", "on a non-default stream")


FAULT_CHILD = r"""
import os, sys, threading, torch
sys.path.insert(0, sys.argv[1])
import kvstore.streams as streams
from kvstore import KVLayout, TransferError, open_store
cpu = sys.argv[2] == "cpu"
lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, block_tokens=16)
if cpu:
    fake = streams.RecordingStreams()
    streams.streams_for = lambda d: fake
    streams.COPY_TIMEOUT_S = 5
s = open_store(None, layout=lay, model_id="fault", device="cpu" if cpu else "cuda:0",
               gpu_capacity=8 * lay.block_nbytes, cpu_capacity=8 * lay.block_nbytes)
keys = s.block_keys(list(range(32)))
s.put(keys, torch.randn(lay.batch_shape(2)).to(lay.dtype)).wait(30)
if cpu:
    fake.fail_after(0, RuntimeError("CUDA error: an illegal memory access was encountered"))
else:
    # a fault the device reports later, as a bad kernel's would: our scatter kernel given a
    # page id far out of range, or (no kernels) torch's device-side bounds assert
    try:
        from kvstore import kernels
        if kernels.cuda_kernels_available(torch.device("cuda:0")):
            from kvstore.paged import paged_geometry
            pages = [torch.zeros(2, 4, 16, 2, 32, dtype=lay.dtype, device="cuda") for _ in range(2)]
            geo = paged_geometry(lay, pages)
            bad = torch.tensor([1 << 40, 2], device="cuda")
            kernels.scatter_pages(lay, geo, torch.ones(2, 2, 16, 2, 32, dtype=lay.dtype,
                                                       device="cuda"), pages[0], bad)
        else:
            x = torch.zeros(4, device="cuda")
            x[torch.tensor([1 << 40], device="cuda")] = 1.0
    except Exception as e:
        print("FAULT RAISED AT LAUNCH:", type(e).__name__, str(e)[:100], flush=True)
        os._exit(3)
try:
    s.fetch(keys).wait(60)
    print("NO ERROR", flush=True)
except TransferError as e:
    print("ERROR SURFACED:", str(e)[:120], flush=True)
except Exception as e:
    print("ERROR SURFACED:", type(e).__name__, str(e)[:120], flush=True)
closer = threading.Thread(target=s.close, daemon=True)
closer.start()
closer.join(30)
print("CLOSE HUNG" if closer.is_alive() else "CLOSED", flush=True)
os._exit(0)
"""


def check_fault(c: Ctx) -> None:
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", FAULT_CHILD, str(ROOT), "cpu" if c.cpu else "cuda"],
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        row("forced device fault", False, "HANG", "the subprocess did not finish in 120 s")
        raise AssertionError("a device fault hung the store") from None
    dt = time.perf_counter() - t0
    out = (r.stdout + r.stderr).strip()
    # only the child's own verdict counts: a child that crashed on import, or whose fault
    # raised at its launch, says nothing about a fault the device reports later
    surfaced = "ERROR SURFACED" in r.stdout
    closed = "CLOSED" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("ERROR", "NO ERROR", "FAULT"))]
    note = (lines[0] if lines else (out.splitlines()[-1] if out else ""))[:100]
    value = ("silent" if not surfaced else
             f"error in {dt:.1f} s" + (", store closed" if closed else ", CLOSE HUNG"))
    row("forced device fault", surfaced and closed, value, note)
    assert surfaced and closed, out[-500:]


def check_bandwidth(c: Ctx) -> None:
    from kvstore import KVLayout

    torch = c.torch
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    n = 256  # 512 MiB
    nbytes = n * lay.block_nbytes
    host = torch.randn(lay.batch_shape(n)).to(lay.dtype).pin_memory()
    dev = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device="cuda")

    def timed(fn, repeat=5):
        best = float("inf")
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    raw_h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    raw_d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    with c.store(n // 2, 2 * n, lay) as s:  # a hot tier too: the real configuration
        keys = s.block_keys(list(range(n * 16)))
        s.put(keys, host).wait(60)
        s.evict(tier="hot")
        out = torch.empty_like(dev)
        t_fetch = timed(lambda: s.fetch(keys, out=out).wait(60))
        devkv = torch.empty_like(dev)
        devkv.copy_(host, non_blocking=True)  # no sync: the put orders itself

        def put_fresh() -> None:
            s.evict()
            s.put(keys, devkv).wait(60)

        t_put = timed(put_fresh, repeat=3)
    for name, t, ref in (("fetch warm->GPU (H2D)", t_fetch, raw_h2d), ("put GPU->memory", t_put, raw_d2h)):
        v, r = nbytes / t / 1e9, nbytes / ref / 1e9
        row(name, None, f"{v:.1f} GB/s", f"raw pinned copy_ {r:.1f} GB/s ({v / r:.2f}x)")


CHECKS = (check_preflight, check_kernels, check_race, check_open, check_pinned, check_round_trip,
          check_demotion_overlap, check_layerwise, check_fault, check_bandwidth)
CPU_SKIPS = {"check_bandwidth"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run on torch's CPU fallback")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"torch is not importable: {e}")
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the checks that need none")
        return 2
    c = Ctx(args.cpu)
    failed = False
    t0 = time.perf_counter()
    for check in CHECKS:
        if args.cpu and check.__name__ in CPU_SKIPS:
            row(check.__name__[6:], None, "skipped", "GPU only")
            continue
        before = len(ROWS)
        try:
            check(c)
        except Exception as e:  # report every check
            failed = True
            if len(ROWS) == before or ROWS[-1]["ok"] is not False:
                row(check.__name__[6:], False, "FAILED", f"{type(e).__name__}: {e}"[:160])
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.json").write_text(json.dumps(ROWS, indent=2))
    print("\n| check | ok | value | note |\n| --- | --- | --- | --- |")
    for r in ROWS:
        ok = "" if r["ok"] is None else ("yes" if r["ok"] else "**NO**")
        print(f"| {r['check']} | {ok} | {r['value']} | {r['note']} |")
    print(f"\n{'cpu' if args.cpu else 'cuda'}: {time.perf_counter() - t0:.1f} s, "
          f"{'FAILED' if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
