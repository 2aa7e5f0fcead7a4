"""transformers bridge: a store's blocks <-> ``DynamicCache``, and prefix-cached prefill.

The store holds a prompt's KV as blocks ``[n, L, P=2, T, H, D]``; transformers' ``DynamicCache``
holds per layer ``K``, ``V`` as ``[batch, H, seq, D]``. This module converts between the two
and wraps a decoder-only ``transformers`` model so that::

    cached = PrefixCachedModel.from_model(model, store)
    res = cached.prefill(input_ids)        # looks up the longest cached prefix, computes the rest
    out = cached.generate(input_ids, 32)   # greedy decoding on top of it

computes only the tokens after the longest cached prefix (always at least the last token, whose
logits are needed) and puts the new full blocks back. Any model whose cache is one K and one V
per layer works (Llama, Mistral, Qwen2, Gemma, Phi-3, ...); MLA and linear-attention layers
do not fit the block layout and are refused by :func:`layout_for`.

Cache API versions: transformers >= 4.56 keeps ``cache.layers[i].keys`` / ``.values`` (and 5.x
names the forward argument ``cache`` instead of ``past_key_values``); older releases keep
``cache.key_cache[i]`` / ``cache.value_cache[i]``. Both are handled. On the layered API the
cached prefix is loaded lazily: its relayout from the store's block layout into the cache's
``[B, H, S, D]`` tensor is fused with the concatenation ``DynamicCache`` performs on the first
update of each layer anyway, so loading a prefix costs one copy (the store's fetch) on top of
what an uncached prefill already does.

Importing this module imports ``transformers``; ``import kvstore`` never does.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvstore.api import BorrowedBlocks
from kvstore.errors import ConfigError, TensorMismatchError
from kvstore.keys import KeyChain
from kvstore.layout import KVLayout
from kvstore.store import Store, open_store
from kvstore.transfer import Transfer

try:  # transformers >= 4.56: one cache-layer object per layer
    from transformers.cache_utils import DynamicLayer as _DynamicLayer
except ImportError:  # pragma: no cover - older transformers
    _DynamicLayer = None

__all__ = [
    "GenerationResult",
    "PrefillResult",
    "PrefixCachedModel",
    "blocks_from_cache",
    "blocks_to_cache",
    "cache_layers",
    "layout_for",
    "model_id_for",
    "open_store_for",
    "weights_digest",
]

#: config keys that do not change what the model computes (left out of the model id)
_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "torch_dtype", "dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "architectures",
}
#: layer types whose KV is one K and one V per token (anything else does not fit a block)
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


# -- layout and identity -----------------------------------------------------------------------
def _config_of(obj: Any) -> Any:
    cfg = getattr(obj, "config", obj)
    get_text = getattr(cfg, "get_text_config", None)
    if get_text is not None:
        try:
            cfg = get_text(decoder=True)
        except TypeError:  # pragma: no cover - older signature
            cfg = get_text()
    return cfg


def _config_dtype(cfg: Any) -> torch.dtype:
    dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt.removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def layout_for(model_config: Any, dtype: torch.dtype | None = None, block_tokens: int = 16) -> KVLayout:
    """The :class:`KVLayout` of a decoder-only model's KV cache.

    ``model_config`` is a ``PretrainedConfig`` (or a model, whose ``.config`` is used).
    ``num_layers`` = ``num_hidden_layers``, ``num_kv_heads`` = ``num_key_value_heads`` (GQA;
    ``num_attention_heads`` when absent), ``head_dim`` = ``config.head_dim`` or
    ``hidden_size // num_attention_heads``. ``dtype`` defaults to the model's dtype (a model
    passed in wins over its config), else float32.
    """
    cfg = _config_of(model_config)
    if getattr(cfg, "kv_lora_rank", None):
        raise ConfigError(
            f"{getattr(cfg, 'model_type', 'this model')} uses multi-head latent attention (MLA); "
            "its latent cache does not fit the K/V block layout of this bridge"
        )
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        odd = sorted(set(layer_types) - _ATTENTION_LAYER_TYPES)
        if odd:
            raise ConfigError(
                f"layers of type {', '.join(odd)} keep no per-token K/V; only models whose every "
                "layer is an attention layer can use the transformers bridge"
            )
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if dtype is None:
        params = getattr(model_config, "parameters", None)
        p = next(iter(params()), None) if callable(params) else None
        dtype = p.dtype if p is not None else _config_dtype(cfg)
    return KVLayout(num_layers=int(cfg.num_hidden_layers), num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=dtype, block_tokens=block_tokens)


def model_id_for(model_config: Any) -> str:
    """A stable, namespace-friendly model id.

    The checkpoint name (``meta-llama/Llama-3.1-8B``) when the model came from the hub; for a
    local checkpoint directory its name plus a config digest; for a model built from a config,
    ``<model_type>-<12 hex digits of the config>``. The id names the architecture, not the
    weights: pass a ``model_revision`` (hub commit, or :func:`weights_digest`) to the store too.
    """
    cfg = _config_of(model_config)
    name = str(getattr(cfg, "name_or_path", "") or getattr(cfg, "_name_or_path", "") or "")
    d = {k: v for k, v in cfg.to_dict().items()
         if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    digest = hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]
    if name and not os.path.isabs(name) and not os.path.exists(name):
        return name
    if name:
        return f"{Path(name).name}-{digest}"
    return f"{getattr(cfg, 'model_type', 'model')}-{digest}"


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of every parameter and buffer: name, dtype, shape and bytes.

    Reads all the weights once, so it is meant for small or locally built models; for a hub
    checkpoint its commit hash is the cheaper revision.
    """
    h = hashlib.sha256(b"kvstore-weights/1")
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def open_store_for(
    model: torch.nn.Module,
    path: str | os.PathLike[str] | None = None,
    *,
    block_tokens: int = 16,
    model_revision: str | None = None,
    dtype: torch.dtype | None = None,
    **store_kwargs: Any,
) -> Store:
    """:func:`kvstore.open_store` with the layout, model id and revision derived from ``model``.

    The revision is ``model_revision``, else the hub commit the config came from, else
    :func:`weights_digest` (so two models with the same config but different weights never
    share blocks).
    """
    layout = layout_for(model, dtype=dtype, block_tokens=block_tokens)
    rev = model_revision or getattr(model.config, "_commit_hash", None) or weights_digest(model)
    return open_store(path, layout=layout, model_id=model_id_for(model), model_revision=rev,
                      **store_kwargs)


# -- tensors ------------------------------------------------------------------------------------
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
    """A ``DynamicCache`` (batch 1) holding the tokens of ``blocks`` ``[n, L, 2, T, H, D]``.

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
    cache = DynamicCache()
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


# -- the wrapper --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PrefillResult:
    """What one :meth:`PrefixCachedModel.prefill` did.

    ``logits`` are the last token's (``[vocab]``, float32); ``cache`` holds the whole prompt's
    K/V, ready for decoding. ``put`` is the store's transfer of the new blocks (None if none).
    """

    logits: torch.Tensor
    cache: Any
    prompt_tokens: int
    cached_tokens: int  # tokens whose K/V came from the store
    computed_tokens: int  # tokens run through the model
    new_blocks: int  # full blocks handed to store.put
    lookup_seconds: float = 0.0  # keys + lookup
    load_seconds: float = 0.0  # fetch + building the cache
    compute_seconds: float = 0.0  # the model's forward pass over the suffix
    store_seconds: float = 0.0  # relayout of the new blocks + put
    put: Transfer[int] | None = field(default=None, repr=False)

    @property
    def seconds(self) -> float:
        return self.lookup_seconds + self.load_seconds + self.compute_seconds + self.store_seconds

    @property
    def next_token(self) -> int:
        return int(self.logits.argmax())


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """Greedy generation: the new tokens, each step's logits ``[len(tokens), vocab]``."""

    tokens: tuple[int, ...]
    logits: torch.Tensor
    prefill: PrefillResult
    decode_seconds: float


def _as_token_list(input_ids: object) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        t = input_ids
        if t.dim() == 2:
            if t.shape[0] != 1:
                raise ValueError(
                    "PrefixCachedModel takes one prompt at a time (batch 1); for many prompts "
                    "use kvstore.batch.BatchRunner"
                )
            t = t[0]
        if t.dim() != 1:
            raise ValueError(f"input_ids must be 1-D or [1, seq], got shape {list(input_ids.shape)}")
        return [int(x) for x in t.tolist()]
    ids = [int(x) for x in input_ids]  # type: ignore[union-attr]
    return ids


class PrefixCachedModel:
    """A decoder-only transformers model whose prefills go through a kvstore :class:`Store`.

    ``store.layout`` must match the model (:func:`layout_for`); open the store with
    :func:`open_store_for` to get that, the model id and a weights revision right.

    Loads go through one reusable fetch buffer on the store's device (sized to the longest
    prefix loaded so far, in steps of 64 blocks), so an instance is not thread-safe: use one
    per thread.
    """

    def __init__(self, model: torch.nn.Module, store: Store, *, salt: str | bytes | None = None,
                 store_generated: bool = True) -> None:
        lay = store.layout
        want = layout_for(model.config, dtype=lay.dtype, block_tokens=lay.block_tokens)
        if want != lay or lay.kv_planes != 2:
            raise ConfigError(
                f"the store's layout {lay} does not match the model's KV cache {want}; open the "
                "store with kvstore.integrations.transformers.open_store_for(model, path)"
            )
        self.model = model
        self.store = store
        self.salt = salt
        self.store_generated = store_generated
        self.layout = lay
        p = next(model.parameters())
        if p.dtype != lay.dtype:
            raise ConfigError(
                f"the model computes in {p.dtype} but the store holds {lay.dtype} blocks: a "
                "prefix stored in another precision would not give the model's own outputs; "
                "open the store with the model's dtype (open_store_for does)"
            )
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._cache_position = "cache_position" in params
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.device, self.dtype = p.device, p.dtype
        # put takes tensors on the store's device or the CPU
        sd = store.device
        self._put_device = sd if sd.type == self.device.type else torch.device("cpu")
        self._staging: torch.Tensor | None = None

    @classmethod
    def from_model(cls, model: torch.nn.Module, store: Store, **kwargs: Any) -> PrefixCachedModel:
        return cls(model, store, **kwargs)

    def _load(self, keys: KeyChain) -> tuple[torch.Tensor, BorrowedBlocks | None]:
        """The blocks of ``keys``: read in place from an embedded store's memory on the model's
        device when all of them are there (no copy: each layer relayouts straight out of the
        store's slab during the forward pass), else fetched into the staging buffer."""
        store = self.store
        if isinstance(store, Store) and store.device == self.device:
            b = store.borrow_blocks(keys)
            if len(b) == len(keys):
                return b.blocks, b
            b.release()
        n = len(keys)
        return store.fetch(keys, out=self._staging_for(n)).wait(), None

    def _staging_for(self, n: int) -> torch.Tensor:
        """A reusable fetch buffer of at least ``n`` blocks (fresh memory would page-fault)."""
        buf = self._staging
        if buf is None or buf.shape[0] < n:
            cap = -(-n // 64) * 64
            buf = torch.empty(self.layout.batch_shape(cap), dtype=self.layout.dtype,
                              device=self.store.device)
            self._staging = buf
        return buf

    # -- model calls --------------------------------------------------------------------------
    def _forward(self, tokens: Sequence[int], cache: Any, start: int) -> torch.Tensor:
        """Run ``tokens`` (positions ``start``...) through the model on ``cache``; last logits."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(tokens), device=self.device).unsqueeze(0)
        kw: dict[str, Any] = {"input_ids": ids, self._cache_kw: cache, "position_ids": pos,
                              "use_cache": True}
        if self._cache_position:
            kw["cache_position"] = pos[0]
        if self._logits_kw is not None:
            kw[self._logits_kw] = 1
        with torch.no_grad():
            out = self.model(**kw)
        return out.logits[0, -1].float()

    # -- prefill ------------------------------------------------------------------------------
    def prefill(self, input_ids: object, *, salt: str | bytes | None = None,
                use_cache: bool = True) -> PrefillResult:
        """Prefill a prompt, reusing its longest cached prefix, and put its new full blocks.

        At most ``(len - 1) // block_tokens`` blocks are loaded, so the last token is always
        computed. ``use_cache=False`` is the plain prefill the cached one must equal: the store
        is neither read nor written.
        """
        ids = _as_token_list(input_ids)
        if not ids:
            raise ValueError("input_ids is empty: nothing to prefill")
        store, lay = self.store, self.layout
        T = lay.block_tokens
        t0 = time.perf_counter()
        keys = store.block_keys(ids, self.salt if salt is None else salt) if use_cache else None
        limit = (len(ids) - 1) // T
        n = store.lookup(keys[:limit]) if keys is not None and limit else 0
        t1 = time.perf_counter()
        cache: Any
        borrowed = None
        try:
            if n:
                blocks, borrowed = self._load(keys[:n])
                n = blocks.shape[0]  # damage shortens the run: compute from there
            if n:
                cache = blocks_to_cache(blocks, device=self.device, dtype=self.dtype)
            else:
                cache = DynamicCache()
            t2 = time.perf_counter()
            start = n * T
            logits = self._forward(ids[start:], cache, start)
            if n:
                cache_layers(cache)  # every layer has read its prefix: staging/borrow is free
        finally:
            if borrowed is not None:
                borrowed.release()
        t3 = time.perf_counter()
        put = self._put_new(cache, keys, n, len(keys)) if use_cache else None
        t4 = time.perf_counter()
        return PrefillResult(
            logits=logits, cache=cache, prompt_tokens=len(ids), cached_tokens=start,
            computed_tokens=len(ids) - start, new_blocks=len(keys) - n if put is not None else 0,
            lookup_seconds=t1 - t0, load_seconds=t2 - t1, compute_seconds=t3 - t2,
            store_seconds=t4 - t3, put=put,
        )

    def _put_new(self, cache: Any, keys: KeyChain, first: int, last: int) -> Transfer[int] | None:
        """Put blocks ``[first, last)`` of ``keys`` from ``cache`` (None when there are none)."""
        if last <= first:
            return None
        kv = blocks_from_cache(cache, self.layout, first, last - first, device=self._put_device)
        return self.store.put(keys[first:last], kv)

    # -- generation ---------------------------------------------------------------------------
    def generate(self, input_ids: object, max_new_tokens: int, *, salt: str | bytes | None = None,
                 eos_token_id: int | None = None, use_cache: bool = True) -> GenerationResult:
        """Greedy decoding after a prefix-cached :meth:`prefill` (``use_cache=False``: plain).

        With ``store_generated`` the full blocks of prompt + generated tokens (whose K/V the
        decode computed) are put too, so a follow-up turn that quotes the answer hits them.
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        ids = _as_token_list(input_ids)
        pre = self.prefill(ids, salt=salt, use_cache=use_cache)
        t0 = time.perf_counter()
        cache = pre.cache
        step_logits = [pre.logits]
        tokens = [pre.next_token]
        while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
            logits = self._forward(tokens[-1:], cache, len(ids) + len(tokens) - 1)
            step_logits.append(logits)
            tokens.append(int(logits.argmax()))
        if use_cache and self.store_generated and len(tokens) > 1:
            seq = ids + tokens[:-1]  # the last token's K/V was never computed
            T = self.layout.block_tokens
            first, last = len(ids) // T, len(seq) // T
            if last > first:
                keys = self.store.block_keys(seq, self.salt if salt is None else salt)
                self._put_new(cache, keys, first, last)
        return GenerationResult(tuple(tokens), torch.stack(step_logits), pre,
                                time.perf_counter() - t0)
