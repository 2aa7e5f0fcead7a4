"""The GPU-only failure paths, on the CPU: kernel compile/launch fallback, the NVRTC-safe
source, the pinned shared slab's cleanup, and ``tools/gpu_check.py --cpu``."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import kvstore.kernels as kernels
import kvstore.tiers.slab as slab_mod
from kvstore import KVLayout
from kvstore.paged import gather_layer, paged_geometry, scatter_layer

ROOT = Path(__file__).resolve().parent.parent
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_tokens=8,
               kv_planes=2)


# -- kernels --------------------------------------------------------------------------------
def test_kernel_source_needs_no_c_headers():
    src = kernels.kernel_source()
    assert "#include" not in src.replace("nothing is #included", "")  # NVRTC has no C headers
    for name in ("uintptr_t", "int64_t", "uint8_t", "size_t"):
        assert name not in src.replace("kvstore_uintptr", ""), name
    for k in kernels.KERNELS:
        assert f'extern "C" __global__ void {k}(' in src


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_kernel_source_compiles_without_any_header(tmp_path):
    """A host C++ compiler with -nostdinc and NVRTC's builtins stubbed: any header the source
    needs (the old <stdint.h>) fails here as it does under NVRTC."""
    stub = ("struct uint4 { unsigned x, y, z, w; };\n"
            "struct uint3 { unsigned x, y, z; };\n"
            "extern const uint3 blockIdx, threadIdx, blockDim;\n"
            "#define __global__\n#define __restrict__ __restrict\n")
    f = tmp_path / "k.cu.cpp"
    f.write_text(stub + kernels.kernel_source())
    r = subprocess.run(["g++", "-std=c++14", "-nostdinc", "-fsyntax-only", "-x", "c++", str(f)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


class _FakeDevice:
    def __init__(self, idx):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _fake_cupy(get_function):
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "13.fake"
    cupy.cuda = types.SimpleNamespace(Device=_FakeDevice,
                                      nvrtc=types.SimpleNamespace(getVersion=lambda: (12, 8)))

    class RawModule:
        def __init__(self, code, options):
            assert "#include" not in code

        def get_function(self, name):
            return get_function(name)

    cupy.RawModule = RawModule
    return cupy


@pytest.fixture
def fresh_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_disabled_reason", lambda: "")
    return kernels


def test_a_compile_error_disables_the_kernels_once_with_nvrtc_log(fresh_kernels, monkeypatch, caplog):
    def boom(name):
        raise RuntimeError('NVRTC_ERROR_COMPILATION: catastrophic error: cannot open source file "stdint.h"')

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(boom))
    dev = torch.device("cuda", 0)
    with caplog.at_level(logging.WARNING, "kvstore.kernels"):
        assert not kernels.cuda_kernels_available(dev)  # the old check only imported cupy
        assert not kernels.cuda_kernels_available(dev)
    st = kernels.preflight(dev)
    assert not st.available and "compiling" in st.reason and "stdint.h" in st.log
    assert st.cupy == "13.fake" and st.nvrtc == "12.8"
    assert sum("disabled" in r.message for r in caplog.records) == 1


def test_a_launch_error_falls_back_to_torch_once(fresh_kernels, monkeypatch, caplog):
    def launch(*a):
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    monkeypatch.setattr(kernels, "_kernels", lambda device: {k: launch for k in kernels.KERNELS})
    monkeypatch.setattr(kernels, "_use_kernel", lambda geo, t, other: kernels._failed is None)
    pages = torch.randn(2, 9, 8, 2, 8).to(torch.float16)
    geo = paged_geometry(LAY, [pages, pages])
    blocks = torch.randn(2, 2, 8, 2, 8).to(torch.float16)
    ids = torch.tensor([4, 7])
    ref, got = pages.clone(), pages.clone()
    scatter_layer(LAY, geo, blocks, ref, ids)
    with caplog.at_level(logging.WARNING, "kvstore.kernels"):
        kernels.scatter_pages(LAY, geo, blocks, got, ids)  # the old code raised into vLLM
        out_ref, out_got = torch.empty_like(blocks), torch.empty_like(blocks)
        gather_layer(LAY, geo, pages, ids, out_ref)
        kernels.gather_pages(LAY, geo, pages, ids, out_got)
    assert torch.equal(ref, got) and torch.equal(out_ref, out_got)
    assert kernels._failed is not None and "launching" in kernels._failed.reason
    assert sum("disabled" in r.message for r in caplog.records) == 1


# -- the pinned shared slab ------------------------------------------------------------------
def test_register_pinned_failure_leaves_no_shared_file(tmp_path, monkeypatch):
    def fail(t):
        raise OSError("cudaHostRegister failed with error 2")

    monkeypatch.setattr(slab_mod, "register_pinned", fail)
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, block_tokens=4)
    path = str(tmp_path / "warm.slab")
    with pytest.raises(OSError, match="cudaHostRegister"):
        slab_mod.Slab(lay, 4 * lay.block_nbytes, torch.device("cpu"), pin_memory=True,
                      shared_path=path)
    assert not os.path.exists(path)
    assert not os.path.exists(slab_mod.directory_path(path))
    monkeypatch.undo()
    s = slab_mod.Slab(lay, 4 * lay.block_nbytes, torch.device("cpu"), pin_memory=False,
                      shared_path=path)  # the old code: FileExistsError (O_EXCL)
    s.close()


def test_cupy_built_for_another_cuda_major_is_refused(fresh_kernels, monkeypatch):
    cupy = _fake_cupy(lambda name: pytest.fail("must not compile"))
    cupy.cuda.runtime = types.SimpleNamespace(runtimeGetVersion=lambda: 12080)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    st = kernels.preflight(torch.device("cuda", 0))
    assert not st.available and "CUDA 12, torch for CUDA 13" in st.reason
    assert "kvstore[cuda]" in st.reason


def test_the_cuda_extra_pins_cupy_for_torchs_cuda_major():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'cuda = ["cupy-cuda13x' in text and 'cuda12 = ["cupy-cuda12x' in text


# -- tools/gpu_check.py ----------------------------------------------------------------------
def test_gpu_check_runs_every_check_it_can_on_the_cpu():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--cpu"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for check in ("preflight", "kernels == torch reference", "race", "pinned warm slab: exact bytes",
                  "round trip with a hot tier", "demotion overlap", "layer-wise",
                  "forced device fault"):
        assert f"| {check}" in r.stdout
    assert "**NO**" not in r.stdout and "all passed" in r.stdout
