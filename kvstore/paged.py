"""Gather/scatter between the store's block layout and an engine's paged KV cache.

The torch implementation here is the reference (and the fallback without CUDA kernels).
Engine pages, per layer: ``[kv_planes, num_pages, page_size, num_kv_heads, head_dim]``
(vLLM's flash-attention layout); with ``kv_planes == 1`` the plane axis may be omitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import TensorMismatchError
from kvstore.layout import KVLayout


@dataclass(frozen=True, slots=True)
class PagedGeometry:
    """How store blocks map onto engine pages."""

    page_size: int
    pages_per_block: int
    planes_axis: bool  # False when kv_planes == 1 and pages are [num_pages, page_size, H, D]


def paged_geometry(layout: KVLayout, pages: Sequence[torch.Tensor]) -> PagedGeometry:
    """Validate ``pages`` against ``layout``; raise :class:`TensorMismatchError` naming the fix."""
    if not isinstance(pages, Sequence) or isinstance(pages, torch.Tensor):
        raise TensorMismatchError("pages must be a list with one paged tensor per layer")
    if len(pages) != layout.num_layers:
        raise TensorMismatchError(
            f"pages has {len(pages)} layers, the layout has {layout.num_layers}"
        )
    first = pages[0]
    if not isinstance(first, torch.Tensor):
        raise TensorMismatchError("pages must hold torch tensors")
    planes_axis = first.dim() == 5
    if not planes_axis and not (first.dim() == 4 and layout.kv_planes == 1):
        raise TensorMismatchError(
            "each layer's pages must be [kv_planes, num_pages, page_size, num_kv_heads, head_dim]"
            f" (got shape {tuple(first.shape)})"
        )
    page_size = first.shape[-3]
    for i, p in enumerate(pages):
        if p.dtype != layout.dtype:
            raise TensorMismatchError(f"pages[{i}] has dtype {p.dtype}, the layout {layout.dtype}")
        if p.shape != first.shape or p.device != first.device:
            raise TensorMismatchError("every layer's pages must have the same shape and device")
    if planes_axis and first.shape[0] != layout.kv_planes:
        raise TensorMismatchError(
            f"pages have {first.shape[0]} planes, the layout has kv_planes={layout.kv_planes}"
        )
    if tuple(first.shape[-2:]) != (layout.num_kv_heads, layout.head_dim):
        raise TensorMismatchError(
            f"pages have heads x head_dim {tuple(first.shape[-2:])}, the layout "
            f"{(layout.num_kv_heads, layout.head_dim)}"
        )
    if page_size <= 0 or layout.block_tokens % page_size:
        raise TensorMismatchError(
            f"page_size {page_size} must divide block_tokens {layout.block_tokens}"
        )
    return PagedGeometry(page_size, layout.block_tokens // page_size, planes_axis)


def page_index(block_ids: object, needed: int, num_pages: int, device: torch.device) -> torch.Tensor:
    """``block_ids`` as an int64 index tensor of at least ``needed`` valid page ids."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
    if ids.numel() < needed:
        raise TensorMismatchError(
            f"block_ids names {ids.numel()} pages, {needed} are needed "
            "(block_tokens // page_size pages per key)"
        )
    ids = ids[:needed]
    if needed and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        raise TensorMismatchError(f"block_ids must be in [0, {num_pages})")
    return ids.to(device)


def scatter_layer(
    layout: KVLayout, geo: PagedGeometry, blocks_layer: torch.Tensor, dst: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    """Write one layer of ``n`` blocks (``[n, P, T, H, D]``) into pages ``ids`` of ``dst``."""
    n = blocks_layer.shape[0]
    P, H, D = layout.kv_planes, layout.num_kv_heads, layout.head_dim
    src = blocks_layer.reshape(n, P, geo.pages_per_block, geo.page_size, H, D)
    src = src.permute(1, 0, 2, 3, 4, 5).reshape(P, n * geo.pages_per_block, geo.page_size, H, D)
    if geo.planes_axis:
        dst.index_copy_(1, ids, src.to(dst.device))
    else:
        dst.index_copy_(0, ids, src[0].to(dst.device))


def gather_layer(
    layout: KVLayout, geo: PagedGeometry, src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor
) -> None:
    """Read pages ``ids`` of one layer into ``out`` (``[n, P, T, H, D]``)."""
    n = out.shape[0]
    P, H, D = layout.kv_planes, layout.num_kv_heads, layout.head_dim
    pages = src.index_select(1, ids) if geo.planes_axis else src.index_select(0, ids).unsqueeze(0)
    pages = pages.reshape(P, n, geo.pages_per_block, geo.page_size, H, D).permute(1, 0, 2, 3, 4, 5)
    out.copy_(pages.reshape(n, P, layout.block_tokens, H, D))
