"""transformers bridge: a store's blocks <-> ``DynamicCache``, and prefix-cached prefill.

The store holds a prompt's KV as blocks ``[n, L, P=2, T, H, D]``; transformers' ``DynamicCache``
holds per layer ``K``, ``V`` as ``[batch, H, seq, D]``. This package converts between the two
and wraps a decoder-only ``transformers`` model so that::

    cached = PrefixCachedModel.from_model(model, store)
    res = cached.prefill(input_ids)        # looks up the longest cached prefix, computes the rest
    out = cached.generate(input_ids, 32)   # greedy decoding on top of it

computes only the tokens after the longest cached prefix (always at least the last token, whose
logits are needed) and puts the new full blocks back. Any model whose cache is one K and one V
per layer works (Llama, Mistral, Qwen2, Gemma, Phi-3, Falcon, ...); MLA and linear-attention
layers do not fit the block layout and are refused by :func:`layout_for`.

One module per part: :mod:`.identity` (layout, model id, weights revision, the store opened for
a model, EOS tokens), :mod:`.convert` (blocks <-> caches, every cache API version) and
:mod:`.model` (:class:`PrefixCachedModel`). Many prompts at once go through the token-batched
engine, :mod:`kvstore.integrations.batch`.

Importing this package imports ``transformers``; ``import kvstore`` never does.
"""

from __future__ import annotations

from kvstore.integrations.transformers.convert import (
    PromptCache,
    blocks_from_cache,
    blocks_to_cache,
    cache_layers,
)
from kvstore.integrations.transformers.identity import (
    cache_kwarg,
    connect_for,
    eos_token_ids,
    layout_for,
    model_id_for,
    open_store_for,
    rope_exact_tokens,
    weights_digest,
    weights_stamp,
)
from kvstore.integrations.transformers.model import (
    GenerationResult,
    PrefillResult,
    PrefixCachedModel,
)

__all__ = [
    "GenerationResult",
    "PrefillResult",
    "PrefixCachedModel",
    "PromptCache",
    "blocks_from_cache",
    "blocks_to_cache",
    "cache_kwarg",
    "cache_layers",
    "connect_for",
    "eos_token_ids",
    "layout_for",
    "model_id_for",
    "open_store_for",
    "rope_exact_tokens",
    "weights_digest",
    "weights_stamp",
]
