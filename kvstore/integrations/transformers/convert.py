"""Tensors of the bridge: a store's blocks ``[n, L, 2, T, H, D]`` <-> a transformers cache
(per layer ``K``, ``V`` ``[batch, H, seq, D]``), for every cache API version.

Cache API versions: transformers >= 4.56 keeps ``cache.layers[i].keys`` / ``.values``; older
releases keep ``cache.key_cache[i]`` / ``cache.value_cache[i]``. Both are handled. On the
layered API a cached prefix is loaded lazily: its relayout from the store's block layout into
the cache's ``[B, H, S, D]`` tensor is fused with the concatenation ``DynamicCache`` performs
on the first update of each layer anyway, so loading a prefix costs one copy (the store's
fetch) on top of what an uncached prefill already does.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvstore.errors import ConfigError, TensorMismatchError
from kvstore.layout import KVLayout

try:  # transformers >= 4.56: one cache-layer object per layer
    from transformers.cache_utils import DynamicLayer as _DynamicLayer
except ImportError:  # pragma: no cover - older transformers
    _DynamicLayer = None

__all__ = ["PromptCache", "blocks_from_cache", "blocks_to_cache", "cache_layers"]


def _first_position(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The first position a cache update writes, when the model says (5.x: ``position_ids``
    in ``kwargs``; 4.x: ``cache_position`` in the cache kwargs)."""
    for d in (kwargs.get("kwargs"), kwargs.get("cache_kwargs"), *(a for a in args if isinstance(a, dict))):
        if isinstance(d, dict):
            for name in ("position_ids", "cache_position"):
                t = d.get(name)
                if isinstance(t, torch.Tensor) and t.numel():
                    return int(t.min())
    return None


class PromptCache(DynamicCache):
    """A ``DynamicCache`` that refuses a forward over positions it already holds.

    A prefilled prompt's cache holds every prompt token; transformers' ``generate`` given such
    a cache re-feeds (some of) the prompt on top of it and silently decodes something else.
    This cache raises instead, naming the supported way
    (:meth:`~kvstore.integrations.transformers.PrefillResult.cache_for_generate`).
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        first = _first_position(args, kwargs)
        if first is not None:
            held = self.get_seq_length(layer_idx)
            if first < held:
                raise ValueError(
                    f"this cache already holds positions 0..{held - 1}; a forward from position "
                    f"{first} would add their K/V again. To continue with transformers' "
                    "generate(input_ids, cache=...) (past_key_values= before transformers "
                    "5.x), pass "
                    "PrefillResult.cache_for_generate() (all but the last prompt token)"
                    + (", and leave use_cache on (use_cache=False re-feeds the whole "
                       "sequence every step)" if first == 0 else "")
                )
        layers = getattr(self, "layers", None)
        if isinstance(layers, list) and layer_idx < len(layers) and \
                getattr(layers[layer_idx], "_src", None) is None:  # a stored prefix adapts
            held_k = getattr(layers[layer_idx], "keys", None)
            if isinstance(held_k, torch.Tensor) and held_k.numel() and \
                    held_k.shape[0] != key_states.shape[0]:
                raise ValueError(
                    f"this cache holds {held_k.shape[0]} sequence(s); the forward has "
                    f"{key_states.shape[0]} rows (beam search or num_return_sequences expand "
                    "the batch): pass PrefillResult.cache_for_generate(repeats=N) with N the "
                    "rows per prompt (num_beams, or num_return_sequences when sampling)"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)``, each ``[batch, H, seq, D]``, of a transformers cache of any version."""
    layers = getattr(cache, "layers", None)
    if layers is not None and (not layers or hasattr(layers[0], "keys")):
        return [(ly.keys, ly.values) for ly in layers]
    if hasattr(cache, "key_cache"):  # transformers < 4.56
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    if isinstance(cache, (tuple, list)):  # legacy tuple-of-tuples
        return [(kv[0], kv[1]) for kv in cache]
    raise TypeError(f"cannot read K/V out of a {type(cache).__name__}")


def blocks_from_cache(
    cache: Any,
    layout: KVLayout,
    start_block: int = 0,
    num_blocks: int | None = None,
    *,
    device: torch.device | str | None = None,
    batch_index: int = 0,
) -> torch.Tensor:
    """Blocks ``[n, L, 2, T, H, D]`` of tokens ``[start_block*T, (start_block+n)*T)`` of a cache.

    ``num_blocks`` defaults to every full block from ``start_block`` on. The result is a new
    contiguous tensor in ``layout.dtype`` on ``device`` (default: the cache's device).
    """
    if layout.kv_planes != 2:
        raise ConfigError("the transformers bridge needs a layout with kv_planes=2 (K and V)")
    layers = cache_layers(cache)
    if len(layers) != layout.num_layers:
        raise TensorMismatchError(
            f"the cache has {len(layers)} layers; the layout has {layout.num_layers}"
        )
    T, H, D = layout.block_tokens, layout.num_kv_heads, layout.head_dim
    k0 = layers[0][0]
    seq = k0.shape[-2]
    if num_blocks is None:
        num_blocks = max(0, seq // T - start_block)
    a, b = start_block * T, (start_block + num_blocks) * T
    if b > seq:
        raise TensorMismatchError(f"the cache holds {seq} tokens; blocks up to token {b} were asked for")
    if tuple(k0.shape[1:2]) + tuple(k0.shape[3:]) != (H, D):
        raise TensorMismatchError(
            f"cache K/V have {k0.shape[1]} heads of dim {k0.shape[-1]}; the layout has {H} x {D}"
        )
    out = torch.empty(layout.batch_shape(num_blocks), dtype=layout.dtype,
                      device=device if device is not None else k0.device)
    if num_blocks == 0:
        return out
    for i, (k, v) in enumerate(layers):
        for plane, t in ((0, k), (1, v)):
            src = t[batch_index, :, a:b].view(H, num_blocks, T, D).permute(1, 2, 0, 3)
            out[:, i, plane].copy_(src)
    return out


if _DynamicLayer is not None:

    class _StoredPrefixLayer(_DynamicLayer):
        """A ``DynamicLayer`` whose first ``P`` tokens still sit in the store's block layout.

        The first ``update`` allocates the layer's ``[B, H, P + s, D]`` tensor once and copies
        the prefix (relayout) and the new tokens into it: the concatenation ``DynamicLayer``
        does anyway, with the relayout fused in. Any other read of ``keys``/``values`` before
        that materialises the prefix alone.
        """

        def __init__(self, k_src: torch.Tensor, v_src: torch.Tensor, device: torch.device,
                     dtype: torch.dtype) -> None:
            self._src: tuple[torch.Tensor, torch.Tensor] | None = None
            super().__init__()
            self._src = (k_src, v_src)
            self._src_len = k_src.shape[0] * k_src.shape[1]
            self.device = device
            self.dtype = dtype
            self.is_initialized = True

        # keys/values read before the first update materialise the prefix
        @property
        def keys(self) -> torch.Tensor | None:
            if self._src is not None:
                self._materialize(None, None)
            return self._keys

        @keys.setter
        def keys(self, value: torch.Tensor | None) -> None:
            self._keys = value

        @property
        def values(self) -> torch.Tensor | None:
            if self._src is not None:
                self._materialize(None, None)
            return self._values

        @values.setter
        def values(self, value: torch.Tensor | None) -> None:
            self._values = value

        def _materialize(self, k_new: torch.Tensor | None, v_new: torch.Tensor | None) -> None:
            assert self._src is not None
            k_src, v_src = self._src
            self._src = None
            n, T, H, D = k_src.shape
            P = n * T
            if k_new is None:
                B, s, dtype, device = 1, 0, self.dtype, self.device
            else:
                B, s, dtype, device = k_new.shape[0], k_new.shape[-2], k_new.dtype, k_new.device
            for name, src, new in (("_keys", k_src, k_new), ("_values", v_src, v_new)):
                full = torch.empty((B, H, P + s, D), dtype=dtype, device=device)
                full[:, :, :P].view(B, H, n, T, D).copy_(src.permute(2, 0, 1, 3).unsqueeze(0))
                if new is not None:
                    full[:, :, P:].copy_(new)
                setattr(self, name, full)
            self.device = device

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self._src is None:
                return super().update(key_states, value_states, *args, **kwargs)
            self._materialize(key_states, value_states)
            return self._keys, self._values

        def get_seq_length(self) -> int:
            if self._src is not None:
                return self._src_len
            return super().get_seq_length()


def blocks_to_cache(
    blocks: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    lazy: bool = True,
) -> DynamicCache:
    """A :class:`PromptCache` (batch 1) holding the tokens of ``blocks`` ``[n, L, 2, T, H, D]``.

    ``device``/``dtype`` default to those of ``blocks``. With ``lazy`` (and a transformers whose
    cache has per-layer objects), ``blocks`` is referenced, not copied: each layer relayouts its
    slice on the model's first update, so ``blocks`` must stay unmodified until then.
    """
    if blocks.dim() != 6 or blocks.shape[2] != 2:
        raise TensorMismatchError(
            f"blocks must be [n, L, 2, T, H, D] (K and V planes), got {list(blocks.shape)}"
        )
    dev = torch.device(device) if device is not None else blocks.device
    dt = dtype or blocks.dtype
    n, L, _, T, H, D = blocks.shape
    cache = PromptCache()
    if lazy and _DynamicLayer is not None and isinstance(getattr(cache, "layers", None), list):
        cache.layers = [
            _StoredPrefixLayer(blocks[:, i, 0], blocks[:, i, 1], dev, dt) for i in range(L)
        ]
        return cache
    for i in range(L):
        k = blocks[:, i, 0].permute(2, 0, 1, 3).reshape(1, H, n * T, D).to(dev, dt)
        v = blocks[:, i, 1].permute(2, 0, 1, 3).reshape(1, H, n * T, D).to(dev, dt)
        cache.update(k.contiguous(), v.contiguous(), i)
    return cache
