"""Gather/scatter between the store's block layout and an engine's KV cache.

Two engine layouts, per layer:

- ``flash`` (vLLM's flash-attention layout): a tensor ``[kv_planes, num_pages, page_size,
  num_kv_heads, head_dim]`` (the plane axis may be omitted when ``kv_planes == 1``);
  page ``i`` is ``[:, i]``.
- ``hf`` (transformers' ``DynamicCache``): a ``(key, value)`` pair of ``[batch, heads, seq,
  head_dim]`` tensors; page ``i`` is the ``page_size`` tokens starting at
  ``(i % (seq // page_size)) * page_size`` of batch row ``i // (seq // page_size)``.

A store block covers ``block_tokens // page_size`` consecutive pages. The torch code here is
the reference and the fallback; :mod:`kvstore.kernels` has CUDA kernels for ``flash``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import TensorMismatchError
from kvstore.layout import KVLayout

FLASH, HF = "flash", "hf"


@dataclass(frozen=True, slots=True)
class PagedGeometry:
    """How store blocks map onto engine pages."""

    kind: str  # FLASH or HF
    page_size: int
    pages_per_block: int
    num_pages: int
    planes_axis: bool  # FLASH only: False when pages are [num_pages, page_size, H, D]
    device: torch.device


def _layer_tensors(layer: object) -> tuple[torch.Tensor, ...]:
    if isinstance(layer, torch.Tensor):
        return (layer,)
    if (isinstance(layer, (tuple, list)) and layer
            and all(isinstance(t, torch.Tensor) for t in layer)):
        return tuple(layer)
    raise TensorMismatchError(
        "each layer must be a paged tensor [kv_planes, num_pages, page_size, H, D] or a "
        "(key, value) pair of [batch, heads, seq, head_dim] tensors"
    )


def paged_geometry(
    layout: KVLayout, pages: Sequence[object], page_size: int | None = None
) -> PagedGeometry:
    """Validate ``pages`` against ``layout``; raise :class:`TensorMismatchError` naming the fix."""
    if isinstance(pages, torch.Tensor) or not isinstance(pages, Sequence):
        raise TensorMismatchError("pages must be a list with one entry per layer")
    if len(pages) != layout.num_layers:
        raise TensorMismatchError(f"pages has {len(pages)} layers, the layout has {layout.num_layers}")
    layers = [_layer_tensors(p) for p in pages]
    first = layers[0][0]
    for i, ts in enumerate(layers):
        for t in ts:
            if t.dtype != layout.dtype:
                raise TensorMismatchError(f"pages[{i}] has dtype {t.dtype}, the layout {layout.dtype}")
            if t.shape != first.shape or t.device != first.device:
                raise TensorMismatchError("every layer's pages must have the same shape and device")
    H, D = layout.num_kv_heads, layout.head_dim
    if len(layers[0]) == 1:
        planes_axis = first.dim() == 5
        if not planes_axis and not (first.dim() == 4 and layout.kv_planes == 1):
            raise TensorMismatchError(
                "each layer's pages must be [kv_planes, num_pages, page_size, num_kv_heads, "
                f"head_dim] (got shape {tuple(first.shape)})"
            )
        if planes_axis and first.shape[0] != layout.kv_planes:
            raise TensorMismatchError(
                f"pages have {first.shape[0]} planes, the layout has kv_planes={layout.kv_planes}"
            )
        if tuple(first.shape[-2:]) != (H, D):
            raise TensorMismatchError(
                f"pages have heads x head_dim {tuple(first.shape[-2:])}, the layout {(H, D)}"
            )
        ps = first.shape[-3]
        if page_size is not None and page_size != ps:
            raise TensorMismatchError(f"page_size={page_size} but the pages hold {ps} tokens each")
        kind, num_pages = FLASH, first.shape[1] if planes_axis else first.shape[0]
    else:
        if len(layers[0]) != layout.kv_planes:
            raise TensorMismatchError(
                f"each layer needs {layout.kv_planes} tensors (key, value), got {len(layers[0])}"
            )
        if first.dim() != 4 or first.shape[1] != H or first.shape[3] != D:
            raise TensorMismatchError(
                f"transformers-layout tensors must be [batch, {H}, seq, {D}], got {tuple(first.shape)}"
            )
        ps = page_size or layout.block_tokens
        if first.shape[2] % ps:
            raise TensorMismatchError(f"seq length {first.shape[2]} is not a multiple of page_size {ps}")
        kind, planes_axis = HF, True
        num_pages = first.shape[0] * (first.shape[2] // ps)
    if ps <= 0 or layout.block_tokens % ps:
        raise TensorMismatchError(f"page_size {ps} must divide block_tokens {layout.block_tokens}")
    return PagedGeometry(kind, ps, layout.block_tokens // ps, num_pages, planes_axis, first.device)


def page_index(block_ids: object, needed: int, geo: PagedGeometry) -> torch.Tensor:
    """``block_ids`` as an int64 index tensor of at least ``needed`` valid page ids."""
    if isinstance(block_ids, (str, bytes)) or block_ids is None:
        raise TensorMismatchError(f"block_ids must be page numbers (ints), got "
                                  f"{type(block_ids).__name__}")
    try:
        raw = torch.as_tensor(block_ids)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise TensorMismatchError(f"block_ids must be page numbers (ints that fit int64): "
                                  f"{e}") from None
    # a float id would be truncated to another page, a bool is no page number
    if raw.dtype.is_floating_point or raw.dtype.is_complex or raw.dtype == torch.bool:
        raise TensorMismatchError(f"block_ids must be integer page numbers, got {raw.dtype}")
    ids = raw.to(torch.int64).reshape(-1)
    if ids.numel() < needed:
        raise TensorMismatchError(
            f"block_ids names {ids.numel()} pages, {needed} are needed "
            "(block_tokens // page_size pages per key)"
        )
    ids = ids[:needed]
    if needed and (int(ids.min()) < 0 or int(ids.max()) >= geo.num_pages):
        raise TensorMismatchError(f"block_ids must be in [0, {geo.num_pages})")
    return ids.to(geo.device)


def _hf_pages(t: torch.Tensor, ps: int) -> torch.Tensor:
    """``[B, H, S, D]`` viewed as ``[B, S // ps, H, ps, D]`` (writes go through)."""
    B, H, S, D = t.shape
    return t.view(B, H, S // ps, ps, D).permute(0, 2, 1, 3, 4)


def scatter_layer(
    layout: KVLayout, geo: PagedGeometry, blocks_layer: torch.Tensor, dst: object,
    ids: torch.Tensor,
) -> None:
    """Write one layer of ``n`` blocks (``[n, P, T, H, D]``) into pages ``ids`` of ``dst``."""
    n = blocks_layer.shape[0]
    P, H, D = layout.kv_planes, layout.num_kv_heads, layout.head_dim
    m = n * geo.pages_per_block
    src = blocks_layer.to(geo.device)
    if geo.kind == FLASH:
        # views only: a strided ``kv[:, layer]`` is read in place (the old reshape to
        # [P, n * ppb, ...] copied it whenever L * P > 1)
        (t,) = _layer_tensors(dst)
        v = src.unflatten(2, (geo.pages_per_block, geo.page_size)).transpose(0, 1)
        idx = ids.view(n, geo.pages_per_block)
        if geo.planes_axis:
            t[:, idx] = v
        else:
            t[idx] = v[0]
        return
    src = src.reshape(n, P, geo.pages_per_block, geo.page_size, H, D)
    src = src.permute(1, 0, 2, 3, 4, 5).reshape(P, m, geo.page_size, H, D)
    tensors = _layer_tensors(dst)
    per_row = tensors[0].shape[2] // geo.page_size
    rows, cols = ids // per_row, ids % per_row
    for plane, t in enumerate(tensors):
        _hf_pages(t, geo.page_size)[rows, cols] = src[plane].transpose(1, 2)


def gather_layer(
    layout: KVLayout, geo: PagedGeometry, src: object, ids: torch.Tensor, out: torch.Tensor
) -> None:
    """Read pages ``ids`` of one layer into ``out`` (``[n, P, T, H, D]``)."""
    n = out.shape[0]
    P, H, D = layout.kv_planes, layout.num_kv_heads, layout.head_dim
    if geo.kind == FLASH:
        (t,) = _layer_tensors(src)
        pages = t.index_select(1, ids) if geo.planes_axis else t.index_select(0, ids).unsqueeze(0)
    else:
        tensors = _layer_tensors(src)
        per_row = tensors[0].shape[2] // geo.page_size
        rows, cols = ids // per_row, ids % per_row
        pages = torch.stack([_hf_pages(t, geo.page_size)[rows, cols].transpose(1, 2) for t in tensors])
    pages = pages.reshape(P, n, geo.pages_per_block, geo.page_size, H, D).permute(1, 0, 2, 3, 4, 5)
    out.copy_(pages.reshape(n, P, layout.block_tokens, H, D))
