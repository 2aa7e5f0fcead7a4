"""The model side of the bridge: the store layout of a model's KV cache, its identity (model
id, weights revision), the store opened for it, and its end-of-sequence tokens."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from kvstore.client import Client, connect
from kvstore.errors import ConfigError
from kvstore.integrations.transformers.convert import cache_layers
from kvstore.layout import KVLayout
from kvstore.store import Store, open_store

__all__ = ["cache_kwarg", "connect_for", "eos_token_ids", "layout_for", "model_id_for",
           "open_store_for",
           "rope_exact_tokens", "weights_digest", "weights_stamp"]

#: config keys that do not change what the model computes (left out of the model id)
_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "torch_dtype", "dtype", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "architectures",
}
#: layer types whose KV is one K and one V per token (anything else does not fit a block)
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


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


def _config_kv_heads(cfg: Any) -> int:
    """K/V heads per layer as the config describes them (Falcon's variants included)."""
    heads = int(cfg.num_attention_heads)
    if getattr(cfg, "model_type", None) == "falcon":
        # Falcon caches every head with the new (40B) decoder, one with multi-query, and
        # num_kv_heads otherwise
        if getattr(cfg, "new_decoder_architecture", False):
            return heads
        return 1 if getattr(cfg, "multi_query", True) else int(cfg.num_kv_heads or heads)
    return int(getattr(cfg, "num_key_value_heads", None) or heads)


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the forward's cache argument (``cache`` in transformers 5.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def dropout_active(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` drops activations at random (training mode, a dropout
    module or an attention dropout rate above 0)."""
    if not model.training:
        return False
    for m in model.modules():
        if not m.training:
            continue
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        rate = getattr(m, "attention_dropout", None)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
            return True
    return False


def _probe(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, K/V heads, head dim) of what ``model`` really caches: a two-token forward.

    Twice, with another second token: a causal model's K/V of the first token are the same
    (bit for bit: same shapes, the second token masked out); a model whose tokens attend to
    later ones (bidirectional, BERT-style) gives other K/V, so a prefix's blocks would depend
    on what follows them, and it is refused.
    """
    if dropout_active(model):
        raise ConfigError(
            f"{type(model).__name__} is in training mode with dropout: its K/V are random, "
            "so no cached prefix is what it computes; call model.eval() first"
        )
    p = next(model.parameters())
    caches = []
    for second in (1, 2):
        cache = DynamicCache()
        ids = torch.tensor([[0, second]], dtype=torch.long, device=p.device)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        caches.append(cache_layers(cache))
    for i, (a, b) in enumerate(zip(*caches, strict=True)):
        for x, y in zip(a, b, strict=True):
            x, y = x[:, :, :1].float(), y[:, :, :1].float()
            if float((x - y).abs().max()) > 1e-4 * max(float(x.abs().max()), 1e-30):
                raise ConfigError(
                    f"{type(model).__name__} is not causal: the K/V of a token in layer {i} "
                    "change with the tokens after it (bidirectional attention), so a cached "
                    "prefix would not be what the model computes for a longer prompt; the "
                    "transformers bridge takes causal decoder-only language models"
                )
    k = caches[0][0][0]
    return len(caches[0]), int(k.shape[1]), int(k.shape[-1])


def layout_for(model_config: Any, dtype: torch.dtype | None = None, block_tokens: int = 16) -> KVLayout:
    """The :class:`KVLayout` of a decoder-only model's KV cache.

    ``model_config`` is a ``PretrainedConfig`` or a model. For a model, the layers, K/V heads
    and head dim are those its cache really holds (one token's forward finds them: attention
    variants such as Falcon's multi-query cache fewer heads than the config's
    ``num_kv_heads``). For a config: ``num_hidden_layers``, ``num_key_value_heads`` (GQA;
    ``num_attention_heads`` when absent; Falcon's rules for its variants), ``head_dim`` or
    ``hidden_size // num_attention_heads``. ``dtype`` defaults to the model's dtype (a model
    passed in wins over its config), else float32.
    """
    cfg = _config_of(model_config)
    top = getattr(model_config, "config", model_config)
    if getattr(top, "is_encoder_decoder", False) or getattr(cfg, "is_encoder_decoder", False):
        raise ConfigError(
            f"{getattr(top, 'model_type', 'this model')} is an encoder-decoder model: its "
            "decoder's K/V depend on the encoder's input as well as the prompt's tokens, and "
            "it caches cross-attention too; the transformers bridge takes decoder-only models"
        )
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
    layers = int(cfg.num_hidden_layers)
    kv_heads = _config_kv_heads(cfg)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if isinstance(model_config, torch.nn.Module):
        layers, kv_heads, head_dim = _probe(model_config)
    if dtype is None:
        params = getattr(model_config, "parameters", None)
        p = next(iter(params()), None) if callable(params) else None
        dtype = p.dtype if p is not None else _config_dtype(cfg)
    return KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype=dtype, block_tokens=block_tokens)


def _config_digest(cfg: Any) -> str:
    """12 hex digits of what the config says the model computes (volatile keys left out)."""
    d = {k: v for k, v in cfg.to_dict().items()
         if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def model_id_for(model_config: Any) -> str:
    """A stable, namespace-friendly model id.

    The checkpoint name (``meta-llama/Llama-3.1-8B``) when the model came from the hub; for a
    local checkpoint directory its name plus a config digest; for a model built from a config,
    ``<model_type>-<12 hex digits of the config>``. The id names the architecture, not the
    weights: pass a ``model_revision`` (hub commit, or :func:`weights_digest`) to the store too.
    """
    cfg = _config_of(model_config)
    name = str(getattr(cfg, "name_or_path", "") or getattr(cfg, "_name_or_path", "") or "")
    digest = _config_digest(cfg)
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


def weights_stamp(model: torch.nn.Module) -> tuple[Any, ...]:
    """What the weights are now, without reading them: each parameter's name, object, storage
    and in-place version counter (an optimizer step, ``load_state_dict``, ``copy_`` under
    ``no_grad`` bump it; a replaced or moved parameter has another object or storage).
    Parameters on the meta device (offloaded, swapped in per forward) count by name only.
    Edits through ``.data`` bypass the version counter: no stamp sees them."""
    return tuple(
        (name,) if p.device.type == "meta" else (name, id(p), p.data_ptr(), p._version)
        for name, p in model.named_parameters()
    )


#: store -> (the model open_store_for opened it for, that model's weights_stamp then)
_OPENED_FOR: weakref.WeakKeyDictionary[Store | Client,
                                       tuple[weakref.ref[torch.nn.Module], tuple[Any, ...]]]
_OPENED_FOR = weakref.WeakKeyDictionary()


def opened_stamp(store: Store | Client, model: torch.nn.Module) -> tuple[Any, ...] | None:
    """The :func:`weights_stamp` ``model`` had when :func:`open_store_for` opened ``store``
    (or :func:`connect_for` connected it) for it (None: opened otherwise, or for another
    model object)."""
    try:
        got = _OPENED_FOR.get(store)
    except TypeError:  # a KVCache of another kind that takes no weak reference, or no hash
        return None
    return got[1] if got is not None and got[0]() is model else None


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
    share blocks). The store remembers the model's :func:`weights_stamp`: a
    :class:`PrefixCachedModel` refuses the pair once the weights were edited since. A hub
    name as the model id does not say how the config was loaded
    (``from_pretrained(name, rope_theta=...)`` overrides it): the config's digest then joins
    the namespace's extras (``hf_config``), so a model loaded with other settings never shares
    blocks with it.
    """
    stamp = weights_stamp(model)
    ident = _identity(model, block_tokens, model_revision, dtype,
                      store_kwargs.pop("namespace_extras", None))
    store = open_store(path, layout=ident.layout, model_id=ident.model_id,
                       model_revision=ident.revision, namespace_extras=ident.extras,
                       **store_kwargs)
    _OPENED_FOR[store] = (weakref.ref(model), stamp)
    return store


def connect_for(
    model: torch.nn.Module,
    socket_path: str | os.PathLike[str],
    *,
    block_tokens: int = 16,
    model_revision: str | None = None,
    dtype: torch.dtype | None = None,
    **client_kwargs: Any,
) -> Client:
    """:func:`kvstore.connect` to a ``kvstore serve`` daemon with the identity
    :func:`open_store_for` gives ``model`` (layout, model id, weights revision, the config
    digest in the extras): the same namespace, so an embedded store and a daemon holding it
    serve each other's blocks. The client fetches onto the model's device unless ``device``
    is given; a :class:`PrefixCachedModel` over it refuses weights edited in place since."""
    stamp = weights_stamp(model)
    ident = _identity(model, block_tokens, model_revision, dtype,
                      client_kwargs.pop("namespace_extras", None))
    client_kwargs.setdefault("device", next(model.parameters()).device)
    client = connect(socket_path, layout=ident.layout, model_id=ident.model_id,
                     model_revision=ident.revision, namespace_extras=ident.extras,
                     **client_kwargs)
    _OPENED_FOR[client] = (weakref.ref(model), stamp)
    return client


@dataclass(frozen=True, slots=True)
class _Identity:
    layout: KVLayout
    model_id: str
    revision: str
    extras: Mapping[str, object] | None


def _identity(model: torch.nn.Module, block_tokens: int, model_revision: str | None,
              dtype: torch.dtype | None, extras: Mapping[str, object] | None) -> _Identity:
    """The namespace fields of ``model`` (see :func:`open_store_for`)."""
    layout = layout_for(model, dtype=dtype, block_tokens=block_tokens)
    rev = model_revision or getattr(model.config, "_commit_hash", None) or weights_digest(model)
    model_id = model_id_for(model)
    digest = _config_digest(_config_of(model))
    if not model_id.endswith(digest):
        extras = dict(extras or {})
        extras.setdefault("hf_config", digest)
    return _Identity(layout, model_id, rev, extras)


def _longrope_original(module: Any, layer_type: str | None) -> int | None:
    cfg = getattr(module, "config", None)
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    got = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    got = got or getattr(cfg, "original_max_position_embeddings", None)
    return int(got) if got else None


def rope_exact_tokens(model: torch.nn.Module) -> int | None:
    """The longest forward (its last position + 1) whose rotary frequencies are the model's
    base ones, for models whose RoPE changes with the length of the forward (``dynamic`` NTK
    scaling: grown past ``max_position_embeddings``; ``longrope``: the long factors past
    ``original_max_position_embeddings``); None when they never change.

    A token's K/V in such a model depends on how long the forward that computed it was, so a
    block is only the model's own K/V for every prompt when it was computed, and is used, in
    forwards of at most this many positions (:class:`PrefixCachedModel` keeps to that).
    """
    return _rope_limits(model)[0]


def _rope_limits(model: torch.nn.Module) -> tuple[int | None, bool]:
    """:func:`rope_exact_tokens`, and whether a ``longrope`` layer sets it (transformers'
    ``generate`` recomputes the whole sequence once a decode crosses its original length)."""
    limit: int | None = None
    longrope = False
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None:
            continue
        types = rope_type.items() if isinstance(rope_type, dict) else [(None, rope_type)]
        for layer_type, kind in types:
            if "dynamic" in str(kind):
                # a forward as long as the original length keeps grown frequencies after a
                # longer one (transformers resets them only below it): one position less
                n = getattr(module, "original_max_seq_len", None)
                n = int(n) - 1 if n else None
            elif kind == "longrope":
                n = _longrope_original(module, layer_type)
                longrope = True
            else:
                continue
            if n is None:
                raise ConfigError(
                    f"{type(module).__name__} uses {kind} RoPE, whose frequencies change with "
                    "the forward's length, and its original length could not be read; the "
                    "transformers bridge cannot tell which K/V stays exact: use a static "
                    "rope_scaling (linear, llama3, yarn) or none"
                )
            limit = n if limit is None else min(limit, n)
    return limit, longrope


def eos_token_ids(model: Any, eos_token_id: int | Sequence[int] | None = None) -> frozenset[int]:
    """End-of-sequence token ids: ``eos_token_id`` (an int or a list) if given, else the
    model's ``generation_config.eos_token_id``, else its config's (either may be a list)."""
    def ids(v: Any) -> frozenset[int] | None:
        if v is None:
            return None
        if isinstance(v, int):
            return frozenset((v,))
        return frozenset(int(t) for t in v)

    got = ids(eos_token_id)
    if got is not None:
        return got
    gen = getattr(model, "generation_config", None)
    for src in (gen, getattr(model, "config", None)):
        got = ids(getattr(src, "eos_token_id", None)) if src is not None else None
        if got is not None:
            return got
    return frozenset()
