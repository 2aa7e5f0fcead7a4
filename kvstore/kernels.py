"""Paged gather/scatter: CUDA kernels (``kvstore/paged_copy.cu``, package data, through CuPy)
or torch.

The kernels serve the ``flash`` layout on CUDA when CuPy is importable and
``KVSTORE_NO_CUDA_KERNELS`` is unset; everything else uses the torch reference in
:mod:`kvstore.paged`, which is also what the kernels are tested against.
"""

from __future__ import annotations

import functools
import os
from importlib.resources import files

import torch

from kvstore.layout import KVLayout
from kvstore.paged import FLASH, PagedGeometry, _layer_tensors, gather_layer, scatter_layer

_THREADS = 256


@functools.lru_cache(maxsize=1)
def _module():  # a cupy.RawModule
    """The compiled kernels, or None when CUDA kernels are unavailable here."""
    if os.environ.get("KVSTORE_NO_CUDA_KERNELS") or not torch.cuda.is_available():
        return None
    try:
        import cupy
    except ImportError:
        return None
    return cupy.RawModule(code=kernel_source(), options=("-std=c++14",), name_expressions=None)


def kernel_source() -> str:
    """The CUDA source, shipped inside the package (a wheel without it is a broken build:
    this raises rather than silently falling back to torch)."""
    return (files("kvstore") / "paged_copy.cu").read_text()


def cuda_kernels_available() -> bool:
    return _module() is not None


def _use_kernel(geo: PagedGeometry, t: torch.Tensor) -> bool:
    return geo.kind == FLASH and t.is_cuda and t.is_contiguous() and _module() is not None


def _launch(name: str, a: torch.Tensor, b: torch.Tensor, ids: torch.Tensor, planes: int,
            num_pages: int, chunk_bytes: int, ppb: int) -> None:
    import cupy

    kernel = _module().get_function(name)
    m = ids.numel()
    if m == 0:
        return
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(a.device).cuda_stream)
    with stream:
        kernel((m, planes), (_THREADS,), (
            a.data_ptr(), b.data_ptr(), ids.data_ptr(), cupy.int64(m), cupy.int64(planes),
            cupy.int64(num_pages), cupy.int64(chunk_bytes), cupy.int64(ppb),
        ))


def scatter_pages(layout: KVLayout, geo: PagedGeometry, blocks_layer: torch.Tensor,
                  dst: object, ids: torch.Tensor) -> None:
    """Write one layer of blocks (``[n, P, T, H, D]``) into engine pages ``ids``."""
    (t,) = _layer_tensors(dst) if geo.kind == FLASH else (None,)
    if t is not None and _use_kernel(geo, t) and blocks_layer.is_cuda:
        src = blocks_layer.contiguous()
        chunk = geo.page_size * layout.num_kv_heads * layout.head_dim * layout.itemsize
        _launch("kvstore_scatter_pages", src, t, ids.to(torch.int64).contiguous(),
                layout.kv_planes, geo.num_pages, chunk, geo.pages_per_block)
        return
    scatter_layer(layout, geo, blocks_layer, dst, ids)


def gather_pages(layout: KVLayout, geo: PagedGeometry, src: object, ids: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Read engine pages ``ids`` of one layer into ``out`` (``[n, P, T, H, D]``)."""
    (t,) = _layer_tensors(src) if geo.kind == FLASH else (None,)
    if t is not None and _use_kernel(geo, t) and out.is_cuda and out.is_contiguous():
        chunk = geo.page_size * layout.num_kv_heads * layout.head_dim * layout.itemsize
        _launch("kvstore_gather_pages", t, out, ids.to(torch.int64).contiguous(),
                layout.kv_planes, geo.num_pages, chunk, geo.pages_per_block)
        return
    gather_layer(layout, geo, src, ids, out)
