"""The wrapper: a transformers model whose prefills go through a kvstore store.

:class:`PrefixCachedModel` looks up the longest cached prefix of a prompt, loads it (borrowed
in place from an embedded store's memory, else fetched), computes only the rest (always at
least the last token, whose logits are needed) and puts the new full blocks back.
"""

from __future__ import annotations

import inspect
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.api import BorrowedBlocks
from kvstore.errors import ConfigError, TokenError
from kvstore.integrations.transformers.convert import (
    PromptCache,
    blocks_from_cache,
    blocks_to_cache,
    cache_layers,
)
from kvstore.integrations.transformers.identity import (
    _rope_limits,
    cache_kwarg,
    dropout_active,
    eos_token_ids,
    layout_for,
    opened_stamp,
    weights_stamp,
)
from kvstore.keys import KeyChain
from kvstore.store import Store
from kvstore.transfer import Transfer

__all__ = ["GenerationResult", "PrefillResult", "PrefixCachedModel"]


@dataclass(frozen=True, eq=False)
class PrefillResult:
    """What one :meth:`PrefixCachedModel.prefill` did.

    ``logits`` are the last token's (``[vocab]``, float32); ``cache`` holds the whole prompt's
    K/V, ready for the *next* token (feed it at position ``prompt_tokens``). transformers'
    ``generate`` wants a cache of a strict prefix of its ``input_ids`` instead: pass it
    :meth:`cache_for_generate` (``res.cache`` itself is refused there, with a message, rather
    than silently giving other tokens). ``put`` is the store's transfer of the new blocks
    (None if none).
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

    def cache_for_generate(self, repeats: int = 1) -> PromptCache:
        """A cache of all but the prompt's last token (views of ``cache``, no copy), the way
        transformers' ``generate`` takes one::

            model.generate(ids, cache=res.cache_for_generate(), ...)

        (``past_key_values=`` before transformers 5.x.)

        ``generate`` recomputes the last token and goes on; its outputs equal a plain
        ``generate``. Each call gives a fresh cache, so ``cache`` stays as it is. ``repeats``:
        the rows ``generate`` runs per prompt (``num_beams``, or ``num_return_sequences``
        when sampling); the K/V are then repeated (copied) per row, as it expands its inputs.
        """
        if repeats < 1:
            raise ValueError("repeats must be >= 1")
        out = PromptCache()
        for i, (k, v) in enumerate(cache_layers(self.cache)):
            k, v = k[:, :, : self.prompt_tokens - 1], v[:, :, : self.prompt_tokens - 1]
            if repeats > 1:
                k, v = k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0)
            out.update(k, v, i)
        return out


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """Greedy generation: the new tokens, each step's logits ``[len(tokens), vocab]``.

    ``put`` is the store's transfer of the prompt + answer blocks (None if none).
    """

    tokens: tuple[int, ...]
    logits: torch.Tensor
    prefill: PrefillResult
    decode_seconds: float
    put: Transfer[int] | None = field(default=None, repr=False)


def _as_token_list(input_ids: object, vocab: int | None = None) -> list[int]:
    """The prompt as a list of ints: a 1-D or ``[1, seq]`` integer tensor, or a sequence of
    integers; each below ``vocab`` (the model's embedding rows) when given. A float or bool
    tensor, or a non-integral value, is a :class:`TokenError` (not truncated to some id)."""
    if isinstance(input_ids, torch.Tensor):
        t = input_ids
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise TokenError(f"input_ids must be an integer tensor, got {t.dtype}")
        if t.dim() == 2:
            if t.shape[0] != 1:
                raise ValueError(
                    "PrefixCachedModel takes one prompt at a time (batch 1); for many prompts "
                    "use kvstore.integrations.batch.TransformersEngine"
                )
            t = t[0]
        if t.dim() != 1:
            raise ValueError(f"input_ids must be 1-D or [1, seq], got shape {list(input_ids.shape)}")
        ids = [int(x) for x in t.tolist()]
    else:
        items = list(input_ids)  # type: ignore[call-overload]
        odd = next((x for x in items if not isinstance(x, numbers.Integral)), None)
        if odd is not None:
            raise TokenError(f"token ids must be integers, got {odd!r} ({type(odd).__name__})")
        ids = [int(x) for x in items]
    if vocab is not None and ids:
        hi, lo = max(ids), min(ids)
        if hi >= vocab or lo < 0:
            raise TokenError(
                f"token id {hi if hi >= vocab else lo} is outside the model's vocabulary "
                f"(its embedding has {vocab} rows)"
            )
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
        # what the model really caches (a forward of one token), not what its config says
        want = layout_for(model, dtype=lay.dtype, block_tokens=lay.block_tokens)
        if want != lay or lay.kv_planes != 2:
            raise ConfigError(
                f"the store's layout {lay} does not match the model's KV cache {want} (it caches "
                f"{want.num_kv_heads} K/V heads of dim {want.head_dim} in {want.num_layers} "
                f"layers); open the store with "
                "kvstore.integrations.transformers.open_store_for(model, path)"
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
        # the weights the store's namespace names: an in-place edit (a merged LoRA, a training
        # step, load_state_dict) would have the store serve K/V of the weights before it
        self._stamp = weights_stamp(model)
        if opened_stamp(store, model) not in (None, self._stamp):
            raise self._weights_changed("open_store_for opened the store")
        params = inspect.signature(model.forward).parameters
        self._cache_kw = cache_kwarg(model)
        self._cache_position = "cache_position" in params
        self._logits_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self.device, self.dtype = p.device, p.dtype
        # put takes tensors on the store's device or the CPU
        sd = store.device
        self._put_device = sd if sd.type == self.device.type else torch.device("cpu")
        self._staging: torch.Tensor | None = None
        # RoPE whose frequencies change with the forward's length: only shorter forwards are
        # cached (a longer one computes every token's K/V with other frequencies)
        self._rope_tokens, self._rope_recompute = _rope_limits(model)
        try:
            emb = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):
            emb = None
        rows = getattr(emb, "num_embeddings", None)
        self._vocab: int | None = int(rows) if isinstance(rows, int) else None

    def _weights_changed(self, since: str) -> ConfigError:
        return ConfigError(
            f"the model's weights changed since {since} (edited in place, replaced or moved): "
            "the store's blocks hold the K/V of the weights before, which this model no longer "
            "computes; open the store again with open_store_for(model, path) (a new weights "
            "revision) and make a new PrefixCachedModel"
        )

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
        is neither read nor written. So is a prompt longer than :func:`rope_exact_tokens` of a
        model whose RoPE changes with the length (dynamic, longrope).
        """
        ids = _as_token_list(input_ids, self._vocab)
        if not ids:
            raise ValueError("input_ids is empty: nothing to prefill")
        use_cache = use_cache and (self._rope_tokens is None or len(ids) <= self._rope_tokens)
        if use_cache and weights_stamp(self.model) != self._stamp:
            raise self._weights_changed("this PrefixCachedModel was made")
        if use_cache and dropout_active(self.model):
            raise ConfigError(
                "the model is in training mode with dropout: its K/V are random, so the store "
                "would serve and keep K/V it does not compute; call model.eval() (or prefill "
                "with use_cache=False)"
            )
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
                cache = PromptCache()
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
                 eos_token_id: int | Sequence[int] | None = None,
                 use_cache: bool = True) -> GenerationResult:
        """Greedy decoding after a prefix-cached :meth:`prefill` (``use_cache=False``: plain).

        Stops after ``max_new_tokens`` or at an end-of-sequence token (kept in ``tokens``):
        ``eos_token_id`` as an int or a list, by default the model's
        ``generation_config.eos_token_id`` (else its config's); ``()`` for none. With
        ``store_generated`` the full blocks of prompt + generated tokens (whose K/V the decode
        computed) are put too, so a follow-up turn that quotes the answer hits them.
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        eos = eos_token_ids(self.model, eos_token_id)
        ids = _as_token_list(input_ids, self._vocab)
        pre = self.prefill(ids, salt=salt, use_cache=use_cache)
        t0 = time.perf_counter()
        cache = pre.cache
        step_logits = [pre.logits]
        tokens = [pre.next_token]
        stored = cache  # the cache whose K/V the store may take (base RoPE frequencies)
        while len(tokens) < max_new_tokens and tokens[-1] not in eos:
            pos = len(ids) + len(tokens) - 1
            if self._rope_recompute and pos == self._rope_tokens:
                # longrope crosses to its long factors: every position's K/V changes, and
                # transformers' generate recomputes the whole sequence here; so does this
                cache = PromptCache()
                logits = self._forward(ids + tokens, cache, 0)
            else:
                logits = self._forward(tokens[-1:], cache, pos)
            step_logits.append(logits)
            tokens.append(int(logits.argmax()))
        put = None
        if use_cache and self.store_generated and len(tokens) > 1:
            seq = ids + tokens[:-1]  # the last token's K/V was never computed
            T = self.layout.block_tokens
            first, last = len(ids) // T, len(seq) // T
            if self._rope_tokens is not None:  # decode steps past it used other frequencies
                last = min(last, self._rope_tokens // T)
            if last > first:
                keys = self.store.block_keys(seq, self.salt if salt is None else salt)
                put = self._put_new(stored, keys, first, last)
        return GenerationResult(tuple(tokens), torch.stack(step_logits), pre,
                                time.perf_counter() - t0, put=put)
