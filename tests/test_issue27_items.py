"""Issue 27 items that no other CPU test would catch if their fix were undone.

Each test fails on the code before its fix (checked by reverting the guarded lines):

- item 1: the writer thread's put-overflow copy reads ``kv`` through ``OverflowJob.host_bytes``
  (after the producing stream), through the store, not just on a hand-built job;
- item 2: a fetch's result/``out`` is handed over (``record_stream``) to the copy stream, so
  the caching allocator cannot reuse it while the copy still writes it;
- item 5: kernels compile and launch under the tensor's device, on that device's current
  stream, with the page ids moved onto it; a scatter that fails in the vLLM worker is a load
  error, never an exception into vLLM;
- tools/gpu_check.py: importing it needs nothing but the standard library, and a check that
  cannot import kvstore is a FAILED row, not a traceback before the table.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from conftest import random_kv

import kvstore.integrations.vllm.fetches as fetches_mod
import kvstore.kernels as kernels
from kvstore import KVLayout, open_store
from kvstore.paged import paged_geometry
from kvstore.store.copy_engine import Job
from kvstore.transfer import Transfer

ROOT = Path(__file__).resolve().parent.parent
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_tokens=4)
BN = LAY.block_nbytes


def _gate_d2h(eng) -> threading.Event:
    gate = threading.Event()
    eng.submit("d2h", Job(Transfer(), lambda st: (gate.wait(10), [])[1], lambda ok, e: None))
    return gate


# -- item 1: the overflow copy on the writer thread --------------------------------------------
def test_put_overflow_through_the_store_reads_kv_only_after_its_producer(fake, tmp_path):
    """Memory is full of blocks still copying, so the second put overflows to disk from the
    caller's ``kv``; the writer thread's read of ``kv`` (declared here at the disk write, where
    the bytes are consumed) must come after the forward that wrote ``kv``."""
    fwd = fake.new_stream("forward")
    with open_store(tmp_path, layout=LAY, model_id="i27", device="cpu", gpu_capacity=0,
                    cpu_capacity=2 * BN, disk_capacity="8MiB") as s:
        durable = s.state.durable
        real_write = durable.write

        def write(items, *a, **kw):  # the disk reads each item's bytes on this (host) thread
            fake.access(None, reads=[it.data for it in items], what="disk write")
            return real_write(items, *a, **kw)

        durable.write = write
        gate = _gate_d2h(s.state.engine)  # the first put's copy stays in flight: its slots pinned
        a = s.block_keys(list(range(8)))
        t_a = s.put(a, random_kv(LAY, 2))
        b, kv_b = s.block_keys(list(range(100, 108))), random_kv(LAY, 2, seed=1)
        with fake.use(fwd):
            fake.access(fwd, writes=[kv_b], what="forward")  # no sync before the put
            t_b = s.put(b, kv_b)
        assert t_b.wait(10) == 2  # overflowed: written to disk by the writer thread
        gate.set()
        assert t_a.wait(10) == 2
        s.flush()
        assert torch.equal(s.fetch(b).wait(10), kv_b)
    assert fake.violations == [], fake.violations


# -- item 2: the fetch's result is handed over to the copy stream --------------------------------
def test_fetch_hands_its_result_to_the_copy_stream(fake):
    """The copy stream writes ``out`` (or the result the store allocated) after the caller's
    stream allocated or last used it: ``record_stream`` keeps the caching allocator from giving
    that memory to anyone else while the copy runs (the caller may drop it meanwhile)."""
    fwd = fake.new_stream("forward")
    with open_store(None, layout=LAY, model_id="i27", device="cpu", gpu_capacity=4 * BN,
                    cpu_capacity=8 * BN) as s, fake.use(fwd):
        h2d = s.state.engine.stream("h2d").name
        keys = s.block_keys(list(range(8)))
        kv = random_kv(LAY, 2)
        s.put(keys, kv).wait(5)
        out = torch.empty_like(kv)
        assert torch.equal(s.fetch(keys, out=out).wait(5), kv)
        assert (out.data_ptr(), h2d) in fake.handed
        got = s.fetch(keys).wait(5)  # a result the store allocated on the caller's stream
        assert torch.equal(got, kv) and (got.data_ptr(), h2d) in fake.handed
    assert fake.violations == []


# -- item 5: device selection of the kernels ---------------------------------------------------
class _Cupy:
    """A fake CuPy that records the device current at each compile and launch."""

    def __init__(self) -> None:
        self.current: list[int | None] = [None]
        self.compiled_on: list[int | None] = []
        self.streams: list[int] = []
        fake = self

        class Device:
            def __init__(self, idx):
                self.idx = idx

            def __enter__(self):
                fake.current.append(self.idx)

            def __exit__(self, *a):
                fake.current.pop()
                return False

        class RawModule:
            def __init__(self, code, options):
                pass

            def get_function(self, name):
                fake.compiled_on.append(fake.current[-1])
                return name

        @contextlib.contextmanager
        def external_stream(ptr):
            fake.streams.append(ptr)
            yield

        self.module = types.ModuleType("cupy")
        self.module.__version__ = "13.fake"
        self.module.RawModule = RawModule
        self.module.int64 = int
        self.module.cuda = types.SimpleNamespace(
            Device=Device, ExternalStream=external_stream,
            nvrtc=types.SimpleNamespace(getVersion=lambda: (13, 0)))


@pytest.fixture
def fresh_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_disabled_reason", lambda: "")
    cp = _Cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp.module)
    return cp


def test_kernels_compile_on_the_device_asked_for(fresh_kernels):
    assert kernels._kernels(torch.device("cuda", 1)) is not None
    assert fresh_kernels.compiled_on == [1, 1]  # both kernels, under device 1
    assert list(kernels._compiled) == [1]


def test_a_launch_runs_on_the_tensors_device_and_its_current_stream(fresh_kernels, monkeypatch):
    cp = fresh_kernels
    launched: list[tuple[int | None, tuple]] = []

    def kernel(grid, block, args):
        launched.append((cp.current[-1], args))

    monkeypatch.setattr(kernels, "_kernels", lambda device: {k: kernel for k in kernels.KERNELS})
    asked: list[torch.device] = []

    def current_stream(device):
        asked.append(device)
        return types.SimpleNamespace(cuda_stream=0x5EED)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    dev = torch.device("cuda", 1)
    a, b, ids = (types.SimpleNamespace(device=dev, data_ptr=lambda p=p: p) for p in (16, 32, 48))
    args = kernels.LaunchArgs((2, 2), (256,), 2, 2, 64, 1, 128, 64, 64, 64)
    assert kernels._launch("kvstore_scatter_pages", a, b, ids, args)
    assert launched == [(1, (16, 32, 48, *args.scalars()))]  # under device 1, not the current one
    assert asked == [dev] and cp.streams == [0x5EED]
    assert kernels._failed is None


def test_page_ids_are_moved_to_the_pages_device(monkeypatch):
    """The kernel reads the ids on the device: ids in host memory (vLLM's block ids) must be
    moved there first (a meta-device stands in for the GPU)."""
    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float16,
                   block_tokens=8, kv_planes=2)
    pages = torch.empty(2, 6, 8, 2, 8, dtype=torch.float16, device="meta")
    blocks = torch.empty(2, 2, 8, 2, 8, dtype=torch.float16, device="meta")
    geo = paged_geometry(lay, [pages])
    seen: list[torch.device] = []

    def launch(name, a, b, ids, args):
        seen.append(ids.device)
        return True

    monkeypatch.setattr(kernels, "_use_kernel", lambda geo, t, other: True)
    monkeypatch.setattr(kernels, "_launch", launch)
    ids = torch.tensor([4, 1])
    kernels.scatter_pages(lay, geo, blocks, pages, ids)
    kernels.gather_pages(lay, geo, pages, ids, blocks)
    assert seen == [pages.device, pages.device]


# -- item 5: the vLLM worker's scatter ---------------------------------------------------------
def test_a_scatter_that_fails_in_the_vllm_worker_is_a_load_error(monkeypatch):
    from kvstore.integrations.vllm.metadata import BlockRun, KVStoreConnectorMetadata
    from kvstore.integrations.vllm.stats import ConnectorStats
    from kvstore.integrations.vllm.worker import WorkerSide

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16,
                   block_tokens=4, kv_planes=2)
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    with open_store(None, layout=lay, model_id="i27-worker", device="cpu", gpu_capacity=0,
                    cpu_capacity=16 * lay.block_nbytes) as store:
        ns = bytes(store.namespace_id)
        w = WorkerSide(store, layout=lay, namespace_id=ns, page_kind="flash", layerwise=False,
                       max_model_len=64, stats=ConnectorStats("worker", "embedded", None))
        pages = [torch.randn(2, 12, 4, 2, 8).to(torch.float16) for _ in names]
        w.register_kv_caches(dict(zip(names, pages, strict=True)))
        keys = list(store.block_keys(list(range(12))))
        w.wait_for_save(KVStoreConnectorMetadata(namespace_id=ns,
                                                 saves=[BlockRun("a", keys, None, [1, 2, 3])]))
        w.finish_puts(wait=True)
        assert store.lookup(keys) == 3

        def boom(*a, **kw):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(fetches_mod, "scatter_pages", boom)  # the pre-forward scatter
        w.start_load_kv(KVStoreConnectorMetadata(namespace_id=ns,
                                                 loads=[BlockRun("b", keys, None, [7, 8, 9])]))
        w.wait_for_save(None)  # finishes the loads
        assert w.get_block_ids_with_load_errors() == {7, 8, 9}  # vLLM recomputes them


# -- tools/gpu_check.py ----------------------------------------------------------------------
def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_i27", ROOT / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_reports_a_check_that_cannot_import_kvstore_as_a_failed_row(monkeypatch, capsys):
    """Imports live inside each check's try: with kvstore not importable, the module still
    loads and every check is a FAILED row of the table (before: an ImportError at the top)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("kvstore", "msgpack"):
        monkeypatch.setitem(sys.modules, name, None)
    gc = _load_gpu_check()
    monkeypatch.setattr(gc, "CHECKS", tuple(c for c in gc.CHECKS if c.__name__ != "check_fault"))
    assert gc.main(["--cpu"]) == 1
    out = capsys.readouterr().out
    assert "| check | ok | value | note |" in out
    for check in ("preflight", "kernels", "race", "round_trip", "layerwise"):
        assert f"| {check} | **NO** | FAILED | ModuleNotFoundError" in out, out
