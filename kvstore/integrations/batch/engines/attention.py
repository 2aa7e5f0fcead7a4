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
soft-capping) in another summation order: float32 results agree to rounding. Calls without a
mask (a prompt's causal part, queries against a prefix without a window) go to the engine's
own kernel where it applies (:mod:`.flash`), the rest to torch's flash kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import ConfigError
from kvstore.integrations.batch.engines import flash
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
    """Tokens ``[start, stop)`` of the packed forward whose sequences share ``prefix`` (or,
    with ``index``, the tokens it lists: a group's decode steps spread over the forward).

    ``prefix[layer] = (K, V)``, each ``[H_kv, P, D]``; an empty tuple means no prefix.
    """

    start: int
    stop: int
    prefix: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    prefix_len: int
    index: torch.Tensor | None = None  # [n] the group's tokens (then start/stop are unused)


@dataclass(frozen=True, eq=False)
class SuffixPart:
    """The tokens ``[start, stop)`` of a packed forward whose sequences live in one suffix
    buffer ``kv`` (a forward of a continuous batch mixes rows of several buffers).

    Indices below are local to the part: token ``0`` is the forward's token ``start``.
    """

    kv: SuffixKV
    start: int
    stop: int
    write_rows: torch.Tensor  # [n] suffix-buffer row of each token
    write_cols: torch.Tensor  # [n] its column in that row
    rows: torch.Tensor  # [R] the rows that have tokens in this forward
    q_index: torch.Tensor  # [R, S] token of (row, j) (padding repeats a valid token)
    q_inverse: torch.Tensor  # [n] index of each token in the flattened [R, S]
    mask: torch.Tensor  # [R, 1, 1, S, C] which suffix columns each query sees
    key_len: int  # C: suffix columns in use among the rows
    key_positions: torch.Tensor  # [R, C] absolute position of each suffix column
    leading: bool  # rows == arange(R): the buffers' first R rows, read without a gather
    #: every row's tokens start at column 0 (a prefill): per row (buffer row, first token,
    #: count), each attended causally on its own (no padding to the longest row); else empty
    fresh: tuple[tuple[int, int, int], ...] = ()
    #: the additive mask of :attr:`mask` (0 / -inf) for the flash kernel, built at its first
    #: use in a forward and shared by every layer without a sliding window
    additive: dict[int, torch.Tensor] = field(default_factory=dict)
    #: per row (int64, CPU, for the engine's kernel): its first token in the part, its token
    #: count, and the suffix columns its last token sees (start + count)
    q_first: torch.Tensor | None = None
    q_counts: torch.Tensor | None = None
    key_lens: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class PartSpec:
    """Sequences of one suffix buffer in a forward: sequence ``i`` (buffer row ``rows[i]``,
    prefix length ``prefix[i]``) adds ``counts[i]`` tokens at columns ``starts[i]``..."""

    kv: SuffixKV
    rows: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    prefix: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """Where the tokens of one packed forward go, shared by every layer of that forward.

    Tokens are ordered by part, then (within a part) by group and by row within a group;
    ``groups`` index the forward's tokens.
    """

    groups: tuple[GroupSlice, ...]
    parts: tuple[SuffixPart, ...]
    positions: torch.Tensor  # [N] absolute position of each token


def make_plan(kv: SuffixKV, groups: Sequence[GroupSlice], seq_rows: Sequence[int],
              seq_starts: Sequence[int], seq_counts: Sequence[int],
              seq_prefix: Sequence[int], *, device: torch.device) -> ForwardPlan:
    """The plan of a forward where sequence ``i`` (suffix row ``seq_rows[i]``, prefix length
    ``seq_prefix[i]``) adds ``seq_counts[i]`` tokens at suffix columns ``seq_starts[i]``...

    Sequences must be listed in token order (grouped as ``groups`` say).
    """
    spec = PartSpec(kv, tuple(seq_rows), tuple(seq_starts), tuple(seq_counts), tuple(seq_prefix))
    return make_parts_plan(groups, [spec], device=device)


def make_parts_plan(groups: Sequence[GroupSlice], specs: Sequence[PartSpec], *,
                    device: torch.device) -> ForwardPlan:
    """The plan of a forward whose tokens are those of ``specs`` in order (each a suffix
    buffer's sequences, listed in token order and grouped as ``groups`` say)."""
    if not specs:
        raise ValueError("a forward needs at least one sequence")
    parts: list[SuffixPart] = []
    positions: list[torch.Tensor] = []
    at = 0
    for sp in specs:
        part, pos = _part(sp, at, device)
        parts.append(part)
        positions.append(pos)
        at = part.stop
    return ForwardPlan(groups=tuple(groups), parts=tuple(parts),
                       positions=torch.cat(positions).to(device))


def _part(sp: PartSpec, at: int, device: torch.device) -> tuple[SuffixPart, torch.Tensor]:
    R = len(sp.rows)
    if not R or len(sp.starts) != R or len(sp.counts) != R or len(sp.prefix) != R \
            or min(sp.counts) < 1:
        raise ValueError("each part needs rows, and each row one start, prefix and >= 1 token")
    S = max(sp.counts)
    C = max(s + c for s, c in zip(sp.starts, sp.counts, strict=True))
    counts = torch.tensor(sp.counts, dtype=torch.long)
    starts = torch.tensor(sp.starts, dtype=torch.long)
    prefix = torch.tensor(sp.prefix, dtype=torch.long)
    first = torch.cumsum(counts, 0) - counts  # first token of each sequence
    j = torch.arange(S).unsqueeze(0)
    q_index = first.unsqueeze(1) + torch.minimum(j, (counts - 1).unsqueeze(1))
    seq_of_token = torch.repeat_interleave(torch.arange(R), counts)
    n = int(counts.sum())
    j_of_token = torch.arange(n) - first[seq_of_token]
    cols = starts[seq_of_token] + j_of_token
    c = torch.arange(C).unsqueeze(0)
    # query (row, j) sits at column starts + j; it sees columns up to its own
    q_cols = starts.unsqueeze(1) + torch.minimum(j, (counts - 1).unsqueeze(1))  # [R, S]
    mask = c.unsqueeze(1) <= q_cols.unsqueeze(2)  # [R, S, C]; padding repeats the last query
    rows = torch.tensor(sp.rows, dtype=torch.long)
    part = SuffixPart(
        kv=sp.kv, start=at, stop=at + n, write_rows=rows[seq_of_token].to(device),
        write_cols=cols.to(device), rows=rows.to(device), q_index=q_index.to(device),
        q_inverse=(seq_of_token * S + j_of_token).to(device),
        mask=mask.view(R, 1, 1, S, C).to(device), key_len=C,
        key_positions=(prefix.unsqueeze(1) + c).to(device),
        leading=list(sp.rows) == list(range(R)),
        fresh=tuple(zip(sp.rows, (int(x) for x in first), sp.counts, strict=True))
        if not any(sp.starts) else (),
        q_first=first, q_counts=counts, key_lens=starts + counts,
    )
    return part, prefix[seq_of_token] + cols


class PlanCache:
    """The ``cache`` the model is handed during an engine forward: ``update`` stores the new
    tokens' K/V in the plan's suffix buffers (the attention reads them from there)."""

    is_compileable = False

    def __init__(self, plan: ForwardPlan) -> None:
        self.plan = plan

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # [1, H, N, D] -> [n, H, D] at (row, col) of each token of each part
        k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        for p in self.plan.parts:
            p.kv.k[layer_idx][p.write_rows, :, p.write_cols] = k[p.start:p.stop]
            p.kv.v[layer_idx][p.write_rows, :, p.write_cols] = v[p.start:p.stop]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.plan.positions.max()) + 1 if self.plan.positions.numel() else 0


# -- the attention function ---------------------------------------------------------------
#: torch's CPU flash attention, which also returns the log-sum-exp the two parts merge by
#: (private in torch; without it the parts are computed by plain matrix products)
_FLASH_CPU = getattr(getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None),
                     "default", None)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            softcap: float | None, mask: torch.Tensor | None, causal: bool = False,
            additive: torch.Tensor | None = None, sees_one: bool = False,
            kt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T) v`` and its log-sum-exp (-inf where a query sees no key), in float32.

    ``q [B, H, M, D]``, ``k``/``v [B, H, K, D]``, ``mask`` boolean, broadcastable to
    ``[B, H, M, K]``; ``causal``: query ``i`` sees keys ``<= i`` (``M == K``). ``additive``:
    ``mask`` as 0 / -inf in ``q``'s dtype, if the caller has it. ``sees_one``: every query
    sees at least one key (no check for those that see none). ``kt``: ``k`` as
    :func:`.flash.transposed_keys` gives it, where the caller keeps one.
    """
    if mask is None and additive is None and not softcap:
        done = flash.attend(q, k, v, scale, causal, kt=kt)  # the engine's own kernel, if it applies
        if done is not None:
            return done
    if _flash_ok(q, softcap):
        add = additive
        if mask is not None and add is None:
            add = additive_mask(mask, q.dtype)
        scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if scores >= _WIDE_SCORES:
            o, lse = wide(_FLASH_CPU, q, k, v, 0.0, causal, attn_mask=add, scale=scale)
        else:
            o, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=add, scale=scale)
        o, lse = o.float(), lse.float()
        if mask is not None and not sees_one:  # a query that sees no key (a window past the prefix): weight 0
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


def _flash_ok(q: torch.Tensor, softcap: float | None) -> bool:
    return (_FLASH_CPU is not None and q.device.type == "cpu" and not softcap
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16))


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the 0 / -inf the flash kernel adds to the scores."""
    add = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return add.masked_fill_(~mask, float("-inf"))


def _chunks(rows: int, per_row: int) -> Iterator[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    for a in range(0, rows, step):
        yield a, min(rows, a + step)


#: the attribute of a shared prefix's key tensor that holds it as the kernel reads it: made at
#: the first step that reads the prefix, gone with the tensor; every later decode step's call
#: skips the transposition (which cost more than the products at a step's few queries)
_TRANSPOSED = "_kvstore_transposed"


def _transposed(pk: torch.Tensor) -> torch.Tensor | None:
    """``pk [H_kv, P, D]`` transposed for the kernel (kept on ``pk``, remade if ``pk`` is
    written in place), or ``None`` where the kernel does not take it."""
    if not flash.kernel_available() or pk.dtype != torch.float32 or pk.device.type != "cpu":
        return None
    have = getattr(pk, _TRANSPOSED, None)
    if have is not None and have[0] == pk._version:
        return have[1]
    kt = flash.transposed_keys(pk.unsqueeze(0))
    setattr(pk, _TRANSPOSED, (pk._version, kt))
    return kt


def _prefix_part(plan: ForwardPlan, layer: int, q: torch.Tensor, scale: float,
                 softcap: float | None, window: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token against its group's prefix: ``o [Hkv, G, N, D]``, ``lse [Hkv, G, N]``."""
    Hkv, G, N, D = q.shape
    f32 = {"dtype": torch.float32, "device": q.device}
    o = torch.zeros((Hkv, G, N, D), **f32)
    lse = torch.full((Hkv, G, N), float("-inf"), **f32)
    for g in plan.groups:
        sel: slice | torch.Tensor = g.index if g.index is not None else slice(g.start, g.stop)
        n = len(g.index) if g.index is not None else g.stop - g.start
        if not g.prefix or n <= 0:
            continue
        pk, pv = g.prefix[layer]
        # the group's queries (all heads sharing a KV head) against the one prefix
        qg = q[:, :, sel].reshape(1, Hkv, G * n, D)
        pos = plan.positions[sel].repeat(G)
        og = torch.empty((Hkv, G * n, D), **f32)
        lg = torch.empty((Hkv, G * n), **f32)
        kt = _transposed(pk) if window is None and not softcap else None
        for a, b in _chunks(G * n, Hkv * g.prefix_len):
            mask = None
            if window is not None and int(pos[a:b].max()) - window >= 0:
                kpos = torch.arange(g.prefix_len, device=q.device)
                mask = kpos.unsqueeze(0) > (pos[a:b].unsqueeze(1) - window)
            oc, lc = _attend(qg[:, :, a:b], pk.unsqueeze(0), pv.unsqueeze(0), scale, softcap, mask,
                             kt=kt)
            og[:, a:b], lg[:, a:b] = oc[0], lc[0]
        o[:, :, sel] = og.view(Hkv, G, n, D)
        lse[:, :, sel] = lg.view(Hkv, G, n)
    return o, lse


def _suffix_part(plan: ForwardPlan, layer: int, q: torch.Tensor, scale: float,
                 softcap: float | None, window: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token against its own sequence's suffix so far (same shapes as the prefix part)."""
    if len(plan.parts) == 1:
        return _one_part(plan.parts[0], plan.positions, layer, q, scale, softcap, window)
    Hkv, G, N, D = q.shape
    o = torch.empty((Hkv, G, N, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((Hkv, G, N), dtype=torch.float32, device=q.device)
    for p in plan.parts:
        o[:, :, p.start:p.stop], lse[:, :, p.start:p.stop] = _one_part(
            p, plan.positions[p.start:p.stop], layer, q[:, :, p.start:p.stop], scale, softcap,
            window)
    return o, lse


def _one_part(plan: SuffixPart, positions: torch.Tensor, layer: int, q: torch.Tensor,
              scale: float, softcap: float | None, window: int | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of one part (``q``, ``positions``: theirs) against their suffixes."""
    Hkv, G, N, D = q.shape
    R, S = plan.q_index.shape
    C = plan.key_len
    k, v = plan.kv.k[layer], plan.kv.v[layer]
    if window is None and not softcap and plan.q_first is not None:
        # each row's tokens against its own buffer row in place (no gather, no padding to
        # the longest row, no mask): the engine's kernel, where it applies
        rows = plan.rows if plan.rows.device.type == "cpu" else plan.rows.cpu()
        done = flash.attend_rows(q.reshape(Hkv * G, N, D), k, v, plan.q_first, plan.q_counts,
                                 rows, plan.key_lens, scale)
        if done is not None:
            return done[0].view(Hkv, G, N, D), done[1].view(Hkv, G, N)
    if plan.fresh and window is None:
        # each sequence's first tokens (a prefill): plain causal attention per sequence, its
        # queries straight from the packed forward (no padding to the longest)
        o = torch.empty((Hkv, G, N, D), dtype=torch.float32, device=q.device)
        lse = torch.empty((Hkv, G, N), dtype=torch.float32, device=q.device)
        for row, a, n in plan.fresh:
            qh = q[:, :, a:a + n].reshape(1, Hkv * G, n, D)
            kh, vh = k[row:row + 1, :, :n], v[row:row + 1, :, :n]
            done = None if softcap else flash.attend(qh, kh, vh, scale, True)  # GQA as is
            if done is not None:
                oh, lh = done
            else:
                if G > 1:
                    kh, vh = kh.repeat_interleave(G, dim=1), vh.repeat_interleave(G, dim=1)
                oh, lh = _attend(qh, kh, vh, scale, softcap, None, causal=True)
            o[:, :, a:a + n] = oh.view(Hkv, G, n, D)
            lse[:, :, a:a + n] = lh.view(Hkv, G, n)
        return o, lse
    if plan.leading:
        k, v = k[:R, :, :C], v[:R, :, :C]
    else:
        k, v = k[plan.rows, :, :C], v[plan.rows, :, :C]
    # [Hkv, G, R, S, D] -> [R, Hkv, G*S, D]: a KV head's queries side by side
    qp = q[:, :, plan.q_index].permute(2, 0, 1, 3, 4).reshape(R, Hkv, G * S, D)
    mask = plan.mask
    additive = None
    if window is not None:
        qpos = positions[plan.q_index]  # [R, S]
        inside = plan.key_positions.unsqueeze(1) > (qpos.unsqueeze(2) - window)  # [R, S, C]
        mask = mask & inside.view(R, 1, 1, S, C)
    elif S == 1 and _flash_ok(q, softcap):  # a decode step: one mask for all layers
        additive = plan.additive.get(0)
        if additive is None:
            additive = plan.additive[0] = additive_mask(mask.view(R, 1, 1, C), q.dtype)
    o = torch.empty((R, Hkv, G * S, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((R, Hkv, G * S), dtype=torch.float32, device=q.device)
    for a, b in _chunks(R, Hkv * G * S * C):
        # every query sees its own token (a window always holds it)
        if additive is not None:
            o[a:b], lse[a:b] = _attend(qp[a:b], k[a:b], v[a:b], scale, softcap, None,
                                       additive=additive[a:b], sees_one=True)
            continue
        mk = mask[a:b].expand(b - a, 1, G, S, C).reshape(b - a, 1, G * S, C)
        o[a:b], lse[a:b] = _attend(qp[a:b], k[a:b], v[a:b], scale, softcap, mk, sees_one=True)

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
    Hkv = plan.parts[0].kv.k[layer].shape[1]
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
