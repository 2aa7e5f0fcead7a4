"""A Llama-style attention's projections in one GEMM and its rotary embedding in one pass.

HF's ``LlamaAttention.forward`` (Qwen2's and Mistral's are copies of it) runs three GEMMs for
the query, key and value projections and ``apply_rotary_pos_emb`` as five element-wise passes
with a temporary each (a negation, a concatenation, two products, a sum) for the queries and
again for the keys. In the batched engine's forwards that was 5-6 % of a prefill-heavy job
(110M shape, the ``doc`` workload of ``kvstore bench --section batch``).

:class:`FusedQKV` gives each such module, during :meth:`FusedQKV.active`, a forward that runs
the three projections as one oneDNN call on their weights stacked and packed once (again when
a weight changes in place: its tensor version moves), and the rotary embedding as
``kvstore._rope`` (ext/rope.c: one pass, bit for bit HF's products and sum) straight from the
projection's output. The rest is HF's forward as it is: the cache's ``update``, the attention
function the config names, the output projection.

A module is fused only where its class's forward is the Llama forward this module was written
against (:data:`KNOWN_FORWARDS`: the code of transformers' ``LlamaAttention.forward``, which
another transformers version may change; then nothing is fused), it has no query/key norms,
its three projections are float32 CPU ``nn.Linear`` with biases alike, and the fused forward
gives the module's own results (to float32 rounding: the stacked GEMM sums in oneDNN's order)
on random rows and random cos/sin when the engine is built (a module whose
``apply_rotary_pos_emb`` is another rotary fails that check). Inputs the
fast path does not take (another dtype or device, cos/sin not ``[1, N, head_dim]``
contiguous, no ``kvstore._rope`` build) run HF's ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from kvstore.integrations.batch.engines.split import wide
from kvstore.integrations.batch.engines.swap import swapped_forwards

__all__ = ["FusedQKV", "KNOWN_FORWARDS", "forward_digest"]

log = logging.getLogger(__name__)

try:  # optional: built from ext/rope.c where a C compiler was found
    from kvstore import _rope as _kernel  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a build without it
    _kernel = None
if not callable(getattr(_kernel, "rope", None)):  # pragma: no cover - a stale build
    _kernel = None

#: digests (:func:`forward_digest`) of the ``LlamaAttention.forward`` code the fused forward
#: reproduces, and whether that code hands the cache's ``update`` its ``kwargs``: transformers
#: 5.25 (``cache=``, ``update(..., kwargs=kwargs)``) and 5.19 (``past_key_values=``)
_FORWARDS = {"b23f82ebce2bfb4f": True, "27f3221f0eb1db82": False}
KNOWN_FORWARDS = frozenset(_FORWARDS)
#: the batch size the stacked weights are packed for (a hint; every batch size runs)
_PACK_HINT = 512
#: how far the fused forward may be from the module's own on the check (relative)
CHECK_RTOL = 1e-4


def _code(f: Any) -> Any:
    # the function under its wrappers (transformers' deprecate_kwarg, the kernels hub's)
    while getattr(f, "__wrapped__", None) is not None:
        f = f.__wrapped__
    return getattr(f, "__code__", None)


def forward_digest(forward: Any) -> str:
    """A digest of a forward's code (bytecode and the names it uses), wrappers unwrapped."""
    code = _code(forward)
    if code is None:
        return ""
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    return h.hexdigest()[:16]


def _linear(m: Any) -> bool:
    w = getattr(m, "weight", None)
    return (type(m) is torch.nn.Linear and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.dtype == torch.float32 and w.device.type == "cpu")


def _eligible(m: torch.nn.Module) -> bool:
    if forward_digest(type(m).forward) not in KNOWN_FORWARDS:
        return False
    projs = [getattr(m, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    return (all(_linear(p) for p in projs)
            and len({p.bias is None for p in projs}) == 1  # type: ignore[union-attr]
            and getattr(m, "q_norm", None) is None and getattr(m, "k_norm", None) is None
            and isinstance(getattr(m, "head_dim", None), int) and m.head_dim % 2 == 0
            and hasattr(m, "layer_idx") and hasattr(m, "config"))


class _Stacked:
    """The three projections' weights stacked and packed, again when one changes (in place:
    its version moves; or replaced: another tensor)."""

    def __init__(self, m: torch.nn.Module) -> None:
        self.projs = (m.q_proj, m.k_proj, m.v_proj)
        self._seen: tuple[tuple[torch.Tensor, int, torch.Tensor | None, int], ...] = ()
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def _now(self) -> tuple[tuple[torch.Tensor, int, torch.Tensor | None, int], ...]:
        return tuple((p.weight, p.weight._version, p.bias,
                      -1 if p.bias is None else p.bias._version) for p in self.projs)

    def get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        now = self._now()
        if self.packed is None or any(
                a[0] is not b[0] or a[1] != b[1] or a[2] is not b[2] or a[3] != b[3]
                for a, b in zip(now, self._seen, strict=True)):
            with torch.no_grad():
                w = torch.cat([p.weight.detach() for p in self.projs])
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=_PACK_HINT)
                self.bias = (None if self.projs[0].bias is None
                             else torch.cat([p.bias.detach() for p in self.projs]))
            self._seen = now
        return self.packed, self.bias


def _rotated(x: torch.Tensor, heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor
             ) -> torch.Tensor:
    """``[1, N, heads, dim]`` rows of the projection's output ``x`` (a column slice: rows
    ``x.stride(1)`` apart), rotated: contiguous ``[1, N, heads, dim]``."""
    n = x.shape[1]
    out = torch.empty((1, n, heads, dim), dtype=torch.float32)
    if n:
        _kernel.rope(x.data_ptr(), x.stride(1), cos.data_ptr(), sin.data_ptr(), dim,  # type: ignore[union-attr]
                     out.data_ptr(), n, heads, dim)
    return out


def _fused_forward(m: torch.nn.Module, stacked: _Stacked) -> Callable[..., Any]:
    home = sys.modules[type(m).__module__]
    apply_rope = home.apply_rotary_pos_emb
    interfaces = home.ALL_ATTENTION_FUNCTIONS
    eager = home.eager_attention_forward
    op = torch.ops.mkldnn._linear_pointwise
    update_kwargs = _FORWARDS[forward_digest(type(m).forward)]
    own = type(m).forward
    cache_kw = "cache" if update_kwargs else "past_key_values"  # the name that code takes
    D = int(m.head_dim)
    Hq = m.q_proj.weight.shape[0] // D
    Hkv = m.k_proj.weight.shape[0] // D

    def forward(hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None,
                past_key_values: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if cache is None:
            cache = past_key_values
        x = hidden_states
        # the weights as they are now: model.half() / .to() after the engine was built
        if (x.dtype != torch.float32 or x.device.type != "cpu" or position_embeddings is None
                or not all(_linear(p) for p in stacked.projs)
                or len({p.bias is None for p in stacked.projs}) != 1
                or (torch.is_grad_enabled() and x.requires_grad)):
            return own(m, x, position_embeddings, attention_mask, **{cache_kw: cache}, **kwargs)
        input_shape = x.shape[:-1]
        packed, bias = stacked.get()
        qkv = wide(op, x, packed, bias, "none", [], "")
        q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=-1)
        cos, sin = position_embeddings
        if (_kernel is not None and x.dim() == 3 and x.shape[0] == 1 and qkv.is_contiguous()
                and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                        and not t.is_neg() and tuple(t.shape) == (1, x.shape[1], D)
                        for t in (cos, sin))):
            query_states = _rotated(q, Hq, D, cos, sin).transpose(1, 2)
            key_states = _rotated(k, Hkv, D, cos, sin).transpose(1, 2)
        else:
            query_states, key_states = apply_rope(q.view(*input_shape, -1, D).transpose(1, 2),
                                                  k.view(*input_shape, -1, D).transpose(1, 2),
                                                  cos, sin)
        value_states = v.view(*input_shape, -1, D).transpose(1, 2)
        if cache is not None:
            extra = {"kwargs": kwargs} if update_kwargs else {}
            key_states, value_states = cache.update(key_states, value_states, m.layer_idx,
                                                    **extra)
        attend = interfaces.get_interface(m.config._attn_implementation, eager)
        out, weights = attend(m, query_states, key_states, value_states, attention_mask,
                              dropout=0.0 if not m.training else m.attention_dropout,
                              scaling=m.scaling, **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        return m.o_proj(out), weights

    return forward


class FusedQKV:
    """The model's Llama-style attention modules whose projections and rotary embedding run
    fused (see the module docstring); empty where none qualifies or packing is missing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules: list[tuple[torch.nn.Module, _Stacked]] = []
        g = torch.Generator().manual_seed(0)
        for m in model.modules():
            if not _eligible(m):
                continue
            try:
                stacked = _Stacked(m)
                stacked.get()
                if _agrees(m, _fused_forward(m, stacked), g):
                    self.modules.append((m, stacked))
            except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as e:
                log.warning("fused attention projections unavailable: %s", e)
                return

    def __len__(self) -> int:
        return len(self.modules)

    def active(self) -> contextlib.AbstractContextManager[int]:
        """Within the block the modules run the fused forward; yields how many."""
        return swapped_forwards((m, functools.partial(_fused_forward, m, stacked))
                                for m, stacked in self.modules)


def _agrees(m: torch.nn.Module, fused: Callable[..., Any], g: torch.Generator) -> bool:
    """The fused forward gives the module's own results on random rows (eager attention,
    no cache, no mask: every row sees every row)."""
    cfg = m.config
    before = cfg._attn_implementation
    hidden = m.q_proj.weight.shape[1]
    n, D = 5, int(m.head_dim)
    x = torch.randn((1, n, hidden), generator=g)
    # any cos and sin (not the halves a Llama rotary repeats): a model whose rotary reads them
    # otherwise (interleaved pairs, a partial rotary) differs here and is left alone
    cos, sin = torch.randn((1, n, D), generator=g), torch.randn((1, n, D), generator=g)
    try:
        cfg._attn_implementation = "eager"
        with torch.no_grad():
            want = m(x, position_embeddings=(cos, sin), attention_mask=None)[0]
            got = fused(x, position_embeddings=(cos, sin), attention_mask=None)[0]
    finally:
        cfg._attn_implementation = before
    return want.shape == got.shape and torch.allclose(got, want, rtol=CHECK_RTOL, atol=1e-5)
