"""Shared-prefix ("cascade") attention for token-batched forwards of a transformers model.

One forward of the batched engine runs the new tokens of many sequences packed into one row
(``input_ids`` ``[1, N]``, no padding through the projections and the MLP). Each sequence
belongs to a *group* whose prefix K/V (``[H_kv, P, D]`` per layer, batch 1) was computed once;
its own tokens (prompt suffix, then generated tokens) live in per-sequence *suffix buffers*
``[rows, H_kv, C, D]``. Attention of a token is the softmax over its group's prefix and its
own sequence's suffix so far, computed in two parts and merged by their log-sum-exp:

- prefix part: for each group, every query of every sequence of the group against the one
  prefix K/V: a single matrix product (the prefix is never copied per sequence, nor even
  broadcast);
- suffix part: queries gathered into ``[rows, H_kv, G*S, D]`` against each row's suffix
  buffer with a causal/validity mask.

The model sees an ordinary attention implementation: :func:`shared_prefix_attention` is
registered with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`, and
:func:`running` switches the model's config to it for the duration of one forward (and back),
with the forward's :class:`ForwardPlan` in a context variable. Its ``cache`` argument is a
:class:`PlanCache`, whose ``update`` writes the new K/V into the suffix buffers.

The math is the model's own attention (scaling, GQA head mapping, sliding window, logit
soft-capping) in another summation order: float32 results agree to rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import ConfigError
from kvstore.integrations.batch.engines.split import wide

ATTENTION_NAME = "kvstore_shared_prefix"

#: score elements per chunk of one matrix product (bounds the memory of long prefills)
_CHUNK_ELEMENTS = 1 << 24
#: an attention call of at least this many score elements runs on the run's threads inside
#: :func:`~.split.small_ops` (below it, on one: waking the others costs more)
_WIDE_SCORES = 1 << 16

_ACTIVE: contextvars.ContextVar[ForwardPlan | None] = contextvars.ContextVar(
    "kvstore_batch_forward", default=None)


class SuffixKV:
    """Per-layer suffix buffers ``K``, ``V`` ``[rows, H_kv, capacity, D]`` of one batch."""

    def __init__(self, layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device) -> None:
        shape = (rows, kv_heads, capacity, head_dim)
        # zeros, not empty: a masked-out column still enters the products (0 x NaN is NaN)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows, self.capacity = rows, capacity

    def row(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of ``row`` in ``layer``, ``[H_kv, length, D]`` views."""
        return self.k[layer][row, :, :length], self.v[layer][row, :, :length]


@dataclass(frozen=True, eq=False)
class GroupSlice:
    """Tokens ``[start, stop)`` of the packed forward whose sequences share ``prefix``.

    ``prefix[layer] = (K, V)``, each ``[H_kv, P, D]``; an empty tuple means no prefix.
    """

    start: int
    stop: int
    prefix: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    prefix_len: int


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """Where the tokens of one packed forward go, shared by every layer of that forward.

    Rows are suffix-buffer rows; tokens are ordered by group, and by row within a group.
    """

    kv: SuffixKV
    groups: tuple[GroupSlice, ...]
    write_rows: torch.Tensor  # [N] suffix-buffer row of each token
    write_cols: torch.Tensor  # [N] its column in that row
    rows: torch.Tensor  # [R] the rows that have tokens in this forward
    q_index: torch.Tensor  # [R, S] token of (row, j) (padding repeats a valid token)
    q_inverse: torch.Tensor  # [N] index of each token in the flattened [R, S]
    mask: torch.Tensor  # [R, 1, 1, S, C] which suffix columns each query sees
    key_len: int  # C: suffix columns in use among the rows
    positions: torch.Tensor  # [N] absolute position of each token
    key_positions: torch.Tensor  # [R, C] absolute position of each suffix column
    all_rows: bool  # rows == arange(kv.rows): the buffers need no gather
    #: every row's tokens start at column 0 (a prefill): per row (buffer row, first token,
    #: count), each attended causally on its own (no padding to the longest row); else empty
    fresh: tuple[tuple[int, int, int], ...] = ()


def make_plan(kv: SuffixKV, groups: Sequence[GroupSlice], seq_rows: Sequence[int],
              seq_starts: Sequence[int], seq_counts: Sequence[int],
              seq_prefix: Sequence[int], *, device: torch.device) -> ForwardPlan:
    """The plan of a forward where sequence ``i`` (suffix row ``seq_rows[i]``, prefix length
    ``seq_prefix[i]``) adds ``seq_counts[i]`` tokens at suffix columns ``seq_starts[i]``...

    Sequences must be listed in token order (grouped as ``groups`` say).
    """
    R = len(seq_rows)
    S = max(seq_counts)
    C = max(s + c for s, c in zip(seq_starts, seq_counts, strict=True))
    counts = torch.tensor(seq_counts, dtype=torch.long)
    starts = torch.tensor(seq_starts, dtype=torch.long)
    prefix = torch.tensor(seq_prefix, dtype=torch.long)
    first = torch.cumsum(counts, 0) - counts  # first token of each sequence
    j = torch.arange(S).unsqueeze(0)
    q_index = first.unsqueeze(1) + torch.minimum(j, (counts - 1).unsqueeze(1))
    seq_of_token = torch.repeat_interleave(torch.arange(R), counts)
    j_of_token = torch.arange(int(counts.sum())) - first[seq_of_token]
    cols = starts[seq_of_token] + j_of_token
    c = torch.arange(C).unsqueeze(0)
    # query (row, j) sits at column starts + j; it sees columns up to its own
    q_cols = starts.unsqueeze(1) + torch.minimum(j, (counts - 1).unsqueeze(1))  # [R, S]
    mask = c.unsqueeze(1) <= q_cols.unsqueeze(2)  # [R, S, C]; padding repeats the last query
    rows = torch.tensor(seq_rows, dtype=torch.long)
    return ForwardPlan(
        kv=kv, groups=tuple(groups), write_rows=rows[seq_of_token].to(device),
        write_cols=cols.to(device), rows=rows.to(device), q_index=q_index.to(device),
        q_inverse=(seq_of_token * S + j_of_token).to(device),
        mask=mask.view(R, 1, 1, S, C).to(device), key_len=C,
        positions=(prefix[seq_of_token] + cols).to(device),
        key_positions=(prefix.unsqueeze(1) + c).to(device),
        all_rows=list(seq_rows) == list(range(kv.rows)),
        fresh=tuple(zip(seq_rows, (int(x) for x in first), seq_counts, strict=True))
        if not any(seq_starts) else (),
    )


class PlanCache:
    """The ``cache`` the model is handed during an engine forward: ``update`` stores the new
    tokens' K/V in the plan's suffix buffers (the attention reads them from there)."""

    is_compileable = False

    def __init__(self, plan: ForwardPlan) -> None:
        self.plan = plan

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.plan
        # [1, H, N, D] -> [N, H, D] at (row, col) of each token
        p.kv.k[layer_idx][p.write_rows, :, p.write_cols] = key_states[0].transpose(0, 1)
        p.kv.v[layer_idx][p.write_rows, :, p.write_cols] = value_states[0].transpose(0, 1)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.plan.positions.max()) + 1 if self.plan.positions.numel() else 0


# -- the attention function ---------------------------------------------------------------
#: torch's CPU flash attention, which also returns the log-sum-exp the two parts merge by
#: (private in torch; without it the parts are computed by plain matrix products)
_FLASH_CPU = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),
                     "default", None)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            softcap: float | None, mask: torch.Tensor | None, causal: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T) v`` and its log-sum-exp (-inf where a query sees no key), in float32.

    ``q [B, H, M, D]``, ``k``/``v [B, H, K, D]``, ``mask`` boolean, broadcastable to
    ``[B, H, M, K]``; ``causal``: query ``i`` sees keys ``<= i`` (``M == K``).
    """
    if (_FLASH_CPU is not None and q.device.type == "cpu" and not softcap
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        add = None
        if mask is not None:
            add = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            add.masked_fill_(~mask, float("-inf"))
        scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if scores >= _WIDE_SCORES:
            o, lse = wide(_FLASH_CPU, q, k, v, 0.0, causal, attn_mask=add, scale=scale)
        else:
            o, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=add, scale=scale)
        o, lse = o.float(), lse.float()
        if mask is not None:  # a query that sees no key (a window past the prefix): weight 0
            dead = ~mask.any(-1).expand(lse.shape)
            if bool(dead.any()):
                lse = lse.masked_fill(dead, float("-inf"))
                o = o.masked_fill(dead.unsqueeze(-1), 0.0)
        return o, lse
    s = torch.matmul(q, k.transpose(-1, -2)).float()
    s.mul_(scale)
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    if causal:
        M, K = s.shape[-2:]
        s.masked_fill_(torch.ones(M, K, dtype=torch.bool, device=s.device).triu_(1),
                       float("-inf"))
    if mask is not None:
        s.masked_fill_(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s.sub_(m).exp_()
    total = s.sum(-1, keepdim=True)
    o = torch.matmul(s.to(v.dtype), v).float() / total.clamp_min(torch.finfo(torch.float32).tiny)
    return o, (m + total.log()).squeeze(-1)


def _chunks(rows: int, per_row: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    for a in range(0, rows, step):
        yield a, min(rows, a + step)


def _prefix_part(plan: ForwardPlan, layer: int, q: torch.Tensor, scale: float,
                 softcap: float | None, window: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token against its group's prefix: ``o [Hkv, G, N, D]``, ``lse [Hkv, G, N]``."""
    Hkv, G, N, D = q.shape
    f32 = {"dtype": torch.float32, "device": q.device}
    o = torch.zeros((Hkv, G, N, D), **f32)
    lse = torch.full((Hkv, G, N), float("-inf"), **f32)
    for g in plan.groups:
        if not g.prefix or g.stop <= g.start:
            continue
        pk, pv = g.prefix[layer]
        n = g.stop - g.start
        # the group's queries (all heads sharing a KV head) against the one prefix
        qg = q[:, :, g.start:g.stop].reshape(1, Hkv, G * n, D)
        pos = plan.positions[g.start:g.stop].repeat(G)
        og = torch.empty((Hkv, G * n, D), **f32)
        lg = torch.empty((Hkv, G * n), **f32)
        for a, b in _chunks(G * n, Hkv * g.prefix_len):
            mask = None
            if window is not None and int(pos[a:b].max()) - window >= 0:
                kpos = torch.arange(g.prefix_len, device=q.device)
                mask = kpos.unsqueeze(0) > (pos[a:b].unsqueeze(1) - window)
            oc, lc = _attend(qg[:, :, a:b], pk.unsqueeze(0), pv.unsqueeze(0), scale, softcap, mask)
            og[:, a:b], lg[:, a:b] = oc[0], lc[0]
        o[:, :, g.start:g.stop] = og.view(Hkv, G, n, D)
        lse[:, :, g.start:g.stop] = lg.view(Hkv, G, n)
    return o, lse


def _suffix_part(plan: ForwardPlan, layer: int, q: torch.Tensor, scale: float,
                 softcap: float | None, window: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token against its own sequence's suffix so far (same shapes as the prefix part)."""
    Hkv, G, N, D = q.shape
    R, S = plan.q_index.shape
    C = plan.key_len
    k, v = plan.kv.k[layer], plan.kv.v[layer]
    if plan.fresh and window is None:
        # each sequence's first tokens (a prefill): plain causal attention per sequence, its
        # queries straight from the packed forward (no padding to the longest)
        o = torch.empty((Hkv, G, N, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((Hkv, G, N), dtype=torch.float32, device=q.device)
        for row, a, n in plan.fresh:
            qh = q[:, :, a:a + n].reshape(1, Hkv * G, n, D)
            kh, vh = k[row:row + 1, :, :n], v[row:row + 1, :, :n]
            if G > 1:
                kh, vh = kh.repeat_interleave(G, dim=1), vh.repeat_interleave(G, dim=1)
            oh, lh = _attend(qh, kh, vh, scale, softcap, None, causal=True)
            o[:, :, a:a + n] = oh.view(Hkv, G, n, D)
            lse[:, :, a:a + n] = lh.view(Hkv, G, n)
        return o, lse
    if plan.all_rows:
        k, v = k[:, :, :C], v[:, :, :C]
    else:
        k, v = k[plan.rows, :, :C], v[plan.rows, :, :C]
    # [Hkv, G, R, S, D] -> [R, Hkv, G*S, D]: a KV head's queries side by side
    qp = q[:, :, plan.q_index].permute(2, 0, 1, 3, 4).reshape(R, Hkv, G * S, D)
    mask = plan.mask
    if window is not None:
        qpos = plan.positions[plan.q_index]  # [R, S]
        inside = plan.key_positions.unsqueeze(1) > (qpos.unsqueeze(2) - window)  # [R, S, C]
        mask = mask & inside.view(R, 1, 1, S, C)
    o = torch.empty((R, Hkv, G * S, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((R, Hkv, G * S), dtype=torch.float32, device=q.device)
    for a, b in _chunks(R, Hkv * G * S * C):
        mk = mask[a:b].expand(b - a, 1, G, S, C).reshape(b - a, 1, G * S, C)
        o[a:b], lse[a:b] = _attend(qp[a:b], k[a:b], v[a:b], scale, softcap, mk)

    def packed(t: torch.Tensor) -> torch.Tensor:  # [R, Hkv, G*S, ...] -> [Hkv, G, N, ...]
        t = t.view(R, Hkv, G, S, *t.shape[3:]).movedim(0, 2).reshape(Hkv, G, R * S, *t.shape[3:])
        return t[:, :, plan.q_inverse]

    return packed(o), packed(lse)


def shared_prefix_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Any, *, scaling: float | None = None,
                            dropout: float = 0.0, softcap: float | None = None,
                            sliding_window: int | None = None, **kwargs: Any
                            ) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface``) of the batched engine."""
    plan = _ACTIVE.get()
    if plan is None:
        raise RuntimeError(f"the {ATTENTION_NAME!r} attention only runs inside a batched-engine "
                           "forward (kvstore.integrations.batch)")
    for bad in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(bad) is not None:
            raise ConfigError(f"attention with {bad} is not supported by the batched engine")
    layer = int(module.layer_idx)
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    B, Hq, N, D = query.shape
    Hkv = plan.kv.k[layer].shape[1]
    scale = float(scaling) if scaling is not None else D ** -0.5
    q = query[0].view(Hkv, Hq // Hkv, N, D)
    o_s, lse_s = _suffix_part(plan, layer, q, scale, softcap, window)
    if any(g.prefix for g in plan.groups):
        o_p, lse_p = _prefix_part(plan, layer, q, scale, softcap, window)
        # weights exp(lse_p - lse) and exp(lse_s - lse), lse = logaddexp(lse_p, lse_s): the
        # prefix part's is sigmoid(lse_p - lse_s) (lse_s is finite: every query sees its own
        # token; lse_p = -inf gives 0), and the two merge in one pass
        w = torch.sigmoid(lse_p - lse_s).unsqueeze(-1)
        out = torch.lerp(o_s, o_p, w)
    else:
        out = o_s
    # [Hkv, G, N, D] -> [1, N, Hq, D], the layout attention functions return
    return out.permute(2, 0, 1, 3).reshape(1, N, Hq, D).to(query.dtype), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


_register()


@contextlib.contextmanager
def running(model: torch.nn.Module, plan: ForwardPlan) -> Iterator[PlanCache]:
    """Within the block, ``model``'s attention is the shared-prefix attention of ``plan``."""
    cfg = model.config
    before = cfg._attn_implementation
    token = _ACTIVE.set(plan)
    cfg._attn_implementation = ATTENTION_NAME
    try:
        yield PlanCache(plan)
    finally:
        cfg._attn_implementation = before
        _ACTIVE.reset(token)
