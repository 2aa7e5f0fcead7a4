"""Paged gather/scatter: CUDA kernels (``kvstore/paged_copy.cu``, package data, through CuPy)
or torch.

The kernels serve the ``flash`` layout on CUDA when CuPy is importable, the source compiles
(NVRTC, which ships no C headers: the source includes none) and ``KVSTORE_NO_CUDA_KERNELS``
is unset; everything else uses the torch reference in :mod:`kvstore.paged`, which is also what
the kernels are tested against. Compilation is forced up front (both kernels, per device), so
:func:`cuda_kernels_available` means they compiled; a compile or launch failure is logged
once, with NVRTC's log, and every later call takes the torch path.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import torch

from kvstore.layout import KVLayout
from kvstore.paged import FLASH, PagedGeometry, _layer_tensors, gather_layer, scatter_layer

log = logging.getLogger("kvstore.kernels")

_THREADS = 256
KERNELS = ("kvstore_scatter_pages", "kvstore_gather_pages")


@dataclass(frozen=True, slots=True)
class KernelStatus:
    """What :func:`preflight` found: whether the kernels serve copies here, and why not."""

    available: bool
    reason: str  # "" when available
    cupy: str  # CuPy's version, or "" when not importable
    nvrtc: str  # NVRTC's version, or ""
    log: str  # NVRTC's compile log (errors, warnings), or the launch error


_lock = threading.Lock()
_compiled: dict[int, dict[str, Any]] = {}  # device index -> kernel name -> cupy RawKernel
_failed: KernelStatus | None = None  # set once compiling or launching failed: torch from then on


def kernel_source() -> str:
    """The CUDA source, shipped inside the package (a wheel without it is a broken build:
    this raises rather than silently falling back to torch)."""
    return (files("kvstore") / "paged_copy.cu").read_text()


def _disabled_reason() -> str:
    if os.environ.get("KVSTORE_NO_CUDA_KERNELS"):
        return "KVSTORE_NO_CUDA_KERNELS is set"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return ""


def _fail(reason: str, detail: str, cupy_version: str = "", nvrtc: str = "") -> None:
    """Fall back to torch for good, saying why once."""
    global _failed
    if _failed is None:
        _failed = KernelStatus(False, reason, cupy_version, nvrtc, detail)
        log.warning("kvstore: CUDA paged-copy kernels disabled, using the torch path: %s%s",
                    reason, f"\n{detail}" if detail else "")


def _kernels(device: torch.device) -> dict[str, Any] | None:
    """The compiled kernels on ``device`` (compiling them the first time), or None."""
    if _failed is not None or _disabled_reason():
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        got = _compiled.get(idx)
        if got is not None or _failed is not None:
            return got
        try:
            import cupy
        except ImportError as e:
            _fail("CuPy is not importable (pip install 'kvstore[cuda]')", str(e))
            return None
        mismatch = _cuda_mismatch(cupy)
        if mismatch:
            _fail(mismatch, "", cupy.__version__)
            return None
        try:
            with cupy.cuda.Device(idx):
                mod = cupy.RawModule(code=kernel_source(), options=("-std=c++14",))
                got = {name: mod.get_function(name) for name in KERNELS}  # compiles now
        except Exception as e:  # CompileException carries NVRTC's log
            _fail(f"compiling kvstore/paged_copy.cu failed ({type(e).__name__})",
                  str(e), cupy.__version__, _nvrtc_version())
            return None
        _compiled[idx] = got
        return got


def _cuda_mismatch(cupy: Any) -> str:
    """Why CuPy's CUDA does not fit torch's (different majors), or ""."""
    try:
        theirs = int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
        ours = int(str(torch.version.cuda).split(".")[0])
    except Exception:  # unknown on either side: let compiling tell
        return ""
    if theirs == ours:
        return ""
    extra = "kvstore[cuda]" if ours >= 13 else f"kvstore[cuda{ours}]"
    return (f"CuPy is built for CUDA {theirs}, torch for CUDA {ours}: pip uninstall "
            f"cupy-cuda{theirs}x and pip install '{extra}'")


def _nvrtc_version() -> str:
    try:
        import cupy

        major, minor = cupy.cuda.nvrtc.getVersion()
        return f"{major}.{minor}"
    except Exception:
        return ""


def preflight(device: torch.device | None = None) -> KernelStatus:
    """Compile both kernels on ``device`` now and say how it went (tools/gpu_check.py)."""
    reason = _disabled_reason()
    if reason:
        return KernelStatus(False, reason, "", "", "")
    dev = device or torch.device("cuda", torch.cuda.current_device())
    if _kernels(dev) is None:
        assert _failed is not None
        return _failed
    import cupy

    return KernelStatus(True, "", cupy.__version__, _nvrtc_version(), "")


def cuda_kernels_available(device: torch.device | None = None) -> bool:
    """Whether the kernels compiled (on ``device``, default the current CUDA device)."""
    if _disabled_reason():
        return False
    return _kernels(device or torch.device("cuda", torch.cuda.current_device())) is not None


@dataclass(frozen=True, slots=True)
class LaunchArgs:
    """One launch of a paged-copy kernel: grid, block and the scalar arguments after the
    three pointers (store-side blocks, engine pages, page ids), strides in bytes."""

    grid: tuple[int, int]
    block: tuple[int]
    n_pages_moved: int
    planes: int
    chunk_bytes: int
    ppb: int
    block_stride: int  # store side: from one block to the next (kv[:, layer]: the whole block)
    block_plane_stride: int  # store side: from one plane (K, V) of a block to the next
    page_plane_stride: int  # engine side: from one plane to the next (0 without a plane axis)
    page_stride: int  # engine side: from one page to the next

    def scalars(self) -> tuple[int, ...]:
        return (self.n_pages_moved, self.planes, self.chunk_bytes, self.ppb, self.block_stride,
                self.block_plane_stride, self.page_plane_stride, self.page_stride)


def _dense_from(t: torch.Tensor, dim: int) -> bool:
    """Whether ``t``'s axes from ``dim`` on are laid out densely (as if contiguous)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[dim:]), reversed(t.stride()[dim:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def launch_args(layout: KVLayout, geo: PagedGeometry, blocks: torch.Tensor, pages: torch.Tensor,
                n_pages_moved: int) -> LaunchArgs | None:
    """The kernel arguments for copying ``n_pages_moved`` pages between ``blocks`` (one layer
    of store blocks, ``[n, P, T, H, D]``, any strides of its first two axes: ``kv[:, layer]``
    is read or written in place) and ``pages`` (the engine's flash layout, any strides of its
    plane and page axes); None when a layout the kernels cannot address (a token, head or
    dim axis not dense) must take the torch path."""
    if geo.kind != FLASH or blocks.dim() != 5 or blocks.element_size() != pages.element_size():
        return None
    P = layout.kv_planes
    if not _dense_from(blocks, 2) or blocks.shape[1] != P:
        return None
    if geo.planes_axis:
        if pages.dim() != 5 or not _dense_from(pages, 2):
            return None
        page_plane, page = pages.stride(0), pages.stride(1)
    else:
        if pages.dim() != 4 or not _dense_from(pages, 1) or P != 1:
            return None
        page_plane, page = 0, pages.stride(0)
    esz = blocks.element_size()
    chunk = geo.page_size * layout.num_kv_heads * layout.head_dim * esz
    return LaunchArgs(
        grid=(n_pages_moved, P), block=(_THREADS,), n_pages_moved=n_pages_moved, planes=P,
        chunk_bytes=chunk, ppb=geo.pages_per_block, block_stride=blocks.stride(0) * esz,
        block_plane_stride=blocks.stride(1) * esz, page_plane_stride=page_plane * esz,
        page_stride=page * esz,
    )


def _use_kernel(geo: PagedGeometry, t: torch.Tensor, other: torch.Tensor) -> bool:
    return (geo.kind == FLASH and t.is_cuda and other.is_cuda and t.device == other.device
            and _failed is None)


def _launch(name: str, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor,
            args: LaunchArgs) -> bool:
    """Launch ``name`` on ``a``'s device and current stream; False (logged once, torch from
    then on) when the kernels are unavailable or the launch fails."""
    kernels = _kernels(a.device)
    if kernels is None:
        return False
    if args.n_pages_moved == 0:
        return True
    try:
        import cupy

        with cupy.cuda.Device(a.device.index):
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(a.device).cuda_stream)
            with stream:
                kernels[name](args.grid, args.block, (
                    a.data_ptr(), b.data_ptr(), ids.data_ptr(),
                    *(cupy.int64(v) for v in args.scalars()),
                ))
    except Exception as e:  # a launch error (config, driver): never wrong KV, torch instead
        _fail(f"launching {name} failed ({type(e).__name__})", str(e))
        return False
    return True


def scatter_pages(layout: KVLayout, geo: PagedGeometry, blocks_layer: torch.Tensor,
                  dst: object, ids: torch.Tensor) -> None:
    """Write one layer of blocks (``[n, P, T, H, D]``, strided: read in place) into engine
    pages ``ids``."""
    (t,) = _layer_tensors(dst) if geo.kind == FLASH else (None,)
    if t is not None and _use_kernel(geo, t, blocks_layer):
        args = launch_args(layout, geo, blocks_layer, t, ids.numel())
        if args is not None and _launch("kvstore_scatter_pages", blocks_layer, t,
                                        ids.to(t.device, torch.int64).contiguous(), args):
            return
    scatter_layer(layout, geo, blocks_layer, dst, ids)


def gather_pages(layout: KVLayout, geo: PagedGeometry, src: object, ids: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Read engine pages ``ids`` of one layer into ``out`` (``[n, P, T, H, D]``, strided:
    ``kv[:, layer]`` is written in place)."""
    (t,) = _layer_tensors(src) if geo.kind == FLASH else (None,)
    if t is not None and _use_kernel(geo, t, out):
        args = launch_args(layout, geo, out, t, ids.numel())
        if args is not None and _launch("kvstore_gather_pages", t, out,
                                        ids.to(t.device, torch.int64).contiguous(), args):
            return
    gather_layer(layout, geo, src, ids, out)
