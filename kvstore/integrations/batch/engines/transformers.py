"""Token-batched execution of a batch on a transformers model.

For each shared prefix of the plan (:mod:`.schedule`), the prefix is computed once as one
sequence (or loaded from a kvstore :class:`~kvstore.store.Store`, and the new full blocks put
there), extending its parent's. Rows (each a prompt's suffix after its prefix) run in
*continuous batches*: each forward is one packed forward (:mod:`.attention`: the prefix K/V is
never copied per sequence) of one token per running row and the whole suffix of the rows that
join, in plan order, as far as the token, row and prefix budgets allow; each row stops on its
own (:mod:`.sampling`) and frees its place for the next.

Greedy outputs equal ``model.generate`` run on each prompt alone (float32: the same tokens;
the attention sums in another order). Works for decoder-only models whose attention layers
take transformers' ``AttentionInterface`` (Llama, Mistral, Qwen2, Gemma, Phi-3, ...).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.errors import ConfigError
from kvstore.integrations.batch.engines import EngineReport, OnDone
from kvstore.integrations.batch.engines.allocator import heap_reuse
from kvstore.integrations.batch.engines.attention import (
    GroupSlice,
    PartSpec,
    SuffixKV,
    make_parts_plan,
    running,
)
from kvstore.integrations.batch.engines.linear import PackedLinears, packing_available
from kvstore.integrations.batch.engines.norm import FusedNorms
from kvstore.integrations.batch.engines.qkv import FusedQKV
from kvstore.integrations.batch.engines.rope import longrope_modules, per_token_rope
from kvstore.integrations.batch.engines.sampling import RowState, Tokenizer, choose_tokens
from kvstore.integrations.batch.engines.schedule import PrefixNode, Row, Schedule, pack, schedule
from kvstore.integrations.batch.engines.split import small_ops
from kvstore.integrations.batch.engines.threads import CoreShare, set_threads
from kvstore.integrations.batch.plan import BatchPlan, plan_batch
from kvstore.integrations.batch.requests import BatchRequest
from kvstore.integrations.transformers import (
    cache_kwarg,
    eos_token_ids,
    layout_for,
    rope_exact_tokens,
)
from kvstore.layout import KVLayout
from kvstore.transfer import Transfer

__all__ = ["TransformersEngine"]

LayerKV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (K, V), each [H, P, D]

#: a forward of at most this many tokens runs its element-wise operations on one thread and
#: its linear layers and large attention calls on all (:mod:`.split`), where the linear
#: layers are packed (all of them then go through :func:`~.split.wide`)
SMALL_FORWARD = 512


@dataclass(frozen=True, slots=True)
class _Counts:
    computed: int = 0
    stored: int = 0
    forwards: int = 0

    def __add__(self, o: _Counts) -> _Counts:
        return _Counts(self.computed + o.computed, self.stored + o.stored, self.forwards + o.forwards)


@dataclass(slots=True, eq=False)
class _Live:
    """A row between its prefill and its last token: ``length`` suffix columns filled, in
    row ``slot`` of ``buf``."""

    row: Row
    state: RowState
    buf: _Buffer
    slot: int
    length: int


class _Buffer:
    """A suffix buffer whose running rows fill its leading rows (``rows[i]`` at slot ``i``),
    so that attention reads them as a slice, not a gather."""

    __slots__ = ("kv", "rows")

    def __init__(self, kv: SuffixKV) -> None:
        self.kv = kv
        self.rows: list[_Live] = []

    def leave(self, lv: _Live) -> None:
        """``lv`` stopped: the last running row moves into its slot (one row's copy). Once
        a quarter or less of the rows run, they move to a buffer of their size: a wave of
        rows that left one long answer behind does not keep the whole wave's memory."""
        last = self.rows.pop()
        if last is not lv:
            s, n = lv.slot, last.length
            for t in (*self.kv.k, *self.kv.v):
                t[s, :, :n] = t[last.slot, :, :n]
            last.slot = s
            self.rows[s] = last
        kv, n = self.kv, len(self.rows)
        if n and n * 4 <= kv.rows:
            small = SuffixKV(len(kv.k), n, kv.k[0].shape[1], kv.capacity, kv.k[0].shape[3],
                             dtype=kv.k[0].dtype, device=kv.k[0].device)
            for old, new in zip((*kv.k, *kv.v), (*small.k, *small.v), strict=True):
                new.copy_(old[:n])
            self.kv = small


@dataclass(frozen=True, slots=True, eq=False)
class _Part:
    """Rows of one suffix buffer in a forward: row ``rows[i]`` (buffer row ``slots[i]``) adds
    ``new[i]`` from column ``starts[i]``."""

    kv: SuffixKV
    rows: tuple[Row, ...]
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    new: tuple[Sequence[int], ...]
    live: tuple[_Live, ...] = ()
    stepping: bool = False  # running rows, one token each (else rows from their first token)


class TransformersEngine:
    """Runs :class:`BatchRequest` s on ``model`` with token batching over shared prefixes.

    ``store`` (optional, its layout must match the model: ``open_store_for``) serves shared
    prefixes computed by earlier jobs and receives the new ones (their full blocks, salted
    with ``salt``). ``max_batch_tokens`` bounds the tokens of one packed forward (joining
    rows' suffixes, one per running row), ``max_batch_rows`` the rows in flight,
    ``max_prefix_tokens`` the shared-prefix tokens held at once (default: 32 x
    ``max_batch_tokens``; each holds its K/V in every layer, and with the attention kernel
    its keys once more, transposed). ``continuous=False``: static batches instead (each runs until its
    last row stops before the next starts). ``eos_token_id``: an
    int or a list; by default the model's ``generation_config.eos_token_id``. ``threads``:
    torch's intra-op threads during :meth:`run` (default: the cores this process may use
    less those other processes keep busy, looked at again every half second as it runs,
    :class:`~.threads.CoreShare`; restored after). ``prepack``: run the model's float32
    CPU linear layers on oneDNN-prepacked weights during :meth:`run` (:mod:`.linear`;
    default: where this torch has it), packed here (a weight changed in place is packed
    again at the next run), gated SiLU MLPs on fused oneDNN calls, RMSNorms in one pass
    (:mod:`.norm`, where ``kvstore._rmsnorm`` was built). On glibc, large freed
    tensors stay in the heap for reuse during :meth:`run` (:mod:`.allocator`).
    """

    name = "transformers"

    def __init__(self, model: torch.nn.Module, *, tokenizer: Tokenizer | None = None,
                 store: Any = None, salt: str | bytes | None = None,
                 eos_token_id: int | Sequence[int] | None = None, block_tokens: int = 16,
                 max_batch_tokens: int = 8192, max_batch_rows: int = 256,
                 max_prefix_tokens: int | None = None, threads: int | None = None,
                 prepack: bool | None = None, continuous: bool = True) -> None:
        p = next(model.parameters())
        self.model, self.tokenizer, self.store, self.salt = model, tokenizer, store, salt
        self.device, self.dtype = p.device, p.dtype
        if store is not None:
            block_tokens = store.layout.block_tokens
        self.layout: KVLayout = layout_for(model, dtype=p.dtype, block_tokens=block_tokens)
        if store is not None and store.layout != self.layout:
            raise ConfigError(f"the store's layout {store.layout} does not match the model's KV "
                              f"cache {self.layout}; open it with open_store_for(model, path)")
        self.eos = eos_token_ids(model, eos_token_id)
        self.context: int | None = getattr(model.config, "max_position_embeddings", None)
        if max_batch_tokens < 1 or max_batch_rows < 1:
            raise ValueError("max_batch_tokens and max_batch_rows must be >= 1")
        # 0 is no budget to fall back from: `or` turned it into the default without a word
        if max_prefix_tokens is not None and max_prefix_tokens < 1:
            raise ValueError(f"max_prefix_tokens must be >= 1 (or None), got {max_prefix_tokens}")
        self.max_batch_tokens, self.max_batch_rows = max_batch_tokens, max_batch_rows
        self.max_prefix_tokens = max_prefix_tokens or 32 * max_batch_tokens
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.vocab: int | None = getattr(emb, "num_embeddings", None)
        self.threads = threads
        self.continuous = continuous
        if prepack is None:
            prepack = self.device.type == "cpu" and self.dtype == torch.float32
        self._linears = PackedLinears(model) if prepack and packing_available() else None
        if self._linears is not None:
            self._linears.pack_all()  # at load, not in the first run's time
        self._norms = FusedNorms(model) if prepack else None  # one-pass RMSNorm (.norm)
        # Q/K/V in one packed GEMM, rotary in one pass (.qkv)
        self._qkv = FusedQKV(model) if self._linears is not None else None
        params = inspect.signature(model.forward).parameters
        self._cache_kw = cache_kwarg(model)
        self._keep_rows = "logits_to_keep" in params  # takes a tensor of positions
        # longrope (Phi-3): per-token short/long factors, as generate gives each prompt (.rope)
        # (its original length: a forward whose last position is below it takes the short ones)
        self._longrope = longrope_modules(model)
        self._long_at = rope_exact_tokens(model) if self._longrope else None
        self._split = False  # during run: small forwards split threads (.split)
        # threads not fixed: the cores other processes leave us, looked at from here on
        self._share = CoreShare() if self.device.type == "cpu" and not threads else None
        self._following: CoreShare | None = None  # during run: the share threads follow
        self._used: set[int] = set()  # during run: the thread counts forwards ran on

    def plan(self, requests: Sequence[BatchRequest]) -> BatchPlan:
        """The batch's plan (prefix tree, groups); the store is not simulated."""
        return plan_batch([r.token_ids for r in requests], block_tokens=self.layout.block_tokens,
                          budget_blocks=None)

    # -- one packed forward -------------------------------------------------------------------
    def _forward(self, parts: Sequence[_Part], prefixes: dict[int, LayerKV]) -> torch.Tensor:
        """The tokens of ``parts`` (in order) through the model as one packed forward; the
        logits of each row's last token ``[rows, V]``, rows in the parts' order."""
        groups: list[GroupSlice] = []
        specs: list[PartSpec] = []
        ids: list[int] = []
        counts: list[int] = []
        long: list[bool] = []
        # node -> (prefix length, its running rows' tokens, wherever they sit in the forward)
        stepping: dict[int, tuple[int, list[int]]] = {}
        t = 0
        prev = None
        for part in parts:
            for r, x in zip(part.rows, part.new, strict=True):
                n = len(x)
                if part.stepping:  # one token of a running row
                    stepping.setdefault(r.node, (r.prefix_len, []))[1].append(t)
                elif groups and prev == r.node:
                    g = groups[-1]
                    groups[-1] = GroupSlice(g.start, t + n, g.prefix, g.prefix_len)
                else:
                    groups.append(GroupSlice(t, t + n, prefixes.get(r.node, ()), r.prefix_len))
                prev = r.node
                t += n
                ids.extend(x)
                counts.append(n)
                if self._long_at is not None:  # longrope only: per-token factors
                    long.extend([r.long] * n)
            specs.append(PartSpec(part.kv, tuple(part.slots), tuple(part.starts),
                                  tuple(len(x) for x in part.new),
                                  tuple(r.prefix_len for r in part.rows)))
        for node, (plen, at) in stepping.items():
            # a prefix's decode tokens are one group, read against it once per layer
            if at[-1] - at[0] == len(at) - 1:
                groups.append(GroupSlice(at[0], at[-1] + 1, prefixes.get(node, ()), plen))
            else:
                groups.append(GroupSlice(0, 0, prefixes.get(node, ()), plen,
                                         torch.tensor(at, device=self.device)))
        plan = make_parts_plan(groups, specs, device=self.device)
        ends = torch.cumsum(torch.tensor(counts), 0) - 1
        kw: dict[str, Any] = {"input_ids": torch.tensor([ids], dtype=torch.long, device=self.device),
                              "position_ids": plan.positions.unsqueeze(0), "use_cache": True}
        if self._keep_rows:
            kw["logits_to_keep"] = ends.to(self.device)
        if self._following is not None:
            n = self._following.threads()
            if n != torch.get_num_threads():
                torch.set_num_threads(n)
        self._used.add(torch.get_num_threads())
        split = (small_ops(torch.get_num_threads())
                 if self._split and len(plan.positions) <= SMALL_FORWARD
                 else contextlib.nullcontext())
        flags = torch.tensor(long, device=self.device) if self._long_at is not None else None
        with running(self.model, plan) as cache, torch.no_grad(), split, \
                per_token_rope(self._longrope, flags, self._long_at or 0):
            logits = self.model(**kw, **{self._cache_kw: cache}).logits[0]
        return logits if self._keep_rows else logits[ends.to(self.device)]

    # -- shared prefixes ----------------------------------------------------------------------
    def _compute_prefix(self, node: PrefixNode, tokens: Sequence[int],
                        prefixes: dict[int, LayerKV], puts: list[Transfer[int]]) -> _Counts:
        """The K/V of ``node``'s prefix: from the store as far as it has it, else from the
        parent's, the rest computed as one sequence; new full blocks put in the store."""
        base: LayerKV = prefixes[node.parent] if node.parent >= 0 else ()
        base_len = self._prefix_len_of(base)
        stored, loaded = self._load_prefix(tokens[: node.prefix_len], base_len)
        if loaded is not None:
            base, base_len = loaded, stored
        n = node.prefix_len - base_len
        if n == 0:  # the store held the whole prefix (a whole number of blocks): no forward
            prefixes[node.node] = base
            return _Counts(stored=stored)
        lay = self.layout
        kv = SuffixKV(lay.num_layers, 1, lay.num_kv_heads, n, lay.head_dim, dtype=self.dtype,
                      device=self.device)
        row = Row(prompt=node.source, node=-2, prefix_len=base_len)  # -2: the base, below
        self._forward([_Part(kv, (row,), (0,), (0,), (tokens[base_len: node.prefix_len],))],
                      {-2: base})
        own = [kv.row(i, 0, n) for i in range(lay.num_layers)]
        if base:  # one copy per prefix (not per sequence): the node's own [H, P, D]
            own = [(torch.cat((bk, k), 1), torch.cat((bv, v), 1))
                   for (bk, bv), (k, v) in zip(base, own, strict=True)]
        prefixes[node.node] = tuple(own)
        self._put_prefix(tokens[: node.prefix_len], prefixes[node.node],
                         stored // lay.block_tokens, puts)
        return _Counts(computed=n, stored=stored if loaded is not None else 0, forwards=1)

    @staticmethod
    def _prefix_len_of(kv: LayerKV) -> int:
        return int(kv[0][0].shape[1]) if kv else 0

    def _load_prefix(self, tokens: Sequence[int], have: int) -> tuple[int, LayerKV | None]:
        """Tokens of ``tokens``' full blocks the store holds (a leading run) and, when that is
        more than ``have``, their K/V."""
        store, T = self.store, self.layout.block_tokens
        if store is None or len(tokens) < T:
            return 0, None
        keys = store.block_keys(list(tokens[: len(tokens) // T * T]), self.salt)
        n = store.lookup(keys)
        if n * T <= have:
            return n * T, None
        blocks = store.fetch(keys[:n]).wait()
        n = int(blocks.shape[0])  # damage shortens the run: compute from there
        if n * T <= have:
            return n * T, None
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        kv = tuple(
            tuple(blocks[:, i, plane].permute(2, 0, 1, 3).reshape(H, n * T, D)
                  .to(self.device, self.dtype) for plane in (0, 1))
            for i in range(self.layout.num_layers))
        return n * T, kv  # type: ignore[return-value]

    def _put_prefix(self, tokens: Sequence[int], kv: LayerKV, first: int,
                    puts: list[Transfer[int]]) -> None:
        store, T = self.store, self.layout.block_tokens
        last = len(tokens) // T
        if store is None or last <= first:
            return
        keys = store.block_keys(list(tokens[: last * T]), self.salt)
        H, D = self.layout.num_kv_heads, self.layout.head_dim
        m = last - first
        dev = store.device if store.device.type == self.device.type else torch.device("cpu")
        out = torch.empty(self.layout.batch_shape(m), dtype=self.layout.dtype, device=dev)
        for i, (k, v) in enumerate(kv):
            for plane, t in ((0, k), (1, v)):
                out[:, i, plane].copy_(t[:, first * T: last * T].view(H, m, T, D).permute(1, 2, 0, 3))
        puts.append(store.put(keys[first:last], out))

    def run(self, requests: Sequence[BatchRequest], *, on_done: OnDone | None = None,
            plan: BatchPlan | None = None) -> EngineReport:
        """Run ``requests`` (any order; ``plan``: theirs, default :meth:`plan`)."""
        t0 = time.perf_counter()
        lengths = [len(r.token_ids) for r in requests]
        if not requests:
            return EngineReport(0, 0, 0, 0, 0, 0, 0.0, "engine")
        self._check(requests, plan)
        plan = plan or self.plan(requests)
        before = None
        if self.device.type == "cpu":
            self._following = None if self.threads else self._share
            before = set_threads(self._following.threads(now=True) if self._following
                                 else self.threads)
        self._used = set()
        try:
            with self._linears.active() if self._linears else contextlib.nullcontext() as n, \
                    self._norms.active() if self._norms else contextlib.nullcontext(), \
                    self._qkv.active() if self._qkv else contextlib.nullcontext(), \
                    heap_reuse() if self.device.type == "cpu" else contextlib.nullcontext():
                # one thread for small ops only where every linear layer is packed (wide)
                self._split = bool(n) and self._linears is not None \
                    and n == self._linears.linear_count
                try:
                    return self._run(requests, lengths, plan, on_done, t0)
                finally:
                    self._split = False
        finally:
            self._following = None
            if before is not None:
                torch.set_num_threads(before)

    def _check(self, requests: Sequence[BatchRequest], plan: BatchPlan | None) -> None:
        """Refuse, before any forward, what would otherwise fail half way through the job
        (after other requests' ``on_done``) or run silently wrong."""
        for r in requests:
            ids, n = r.token_ids, len(r.token_ids)
            # the embedding raised an IndexError naming no request
            if n and self.vocab is not None and not (min(ids) >= 0 and max(ids) < self.vocab):
                bad = next(t for t in ids if not 0 <= t < self.vocab)
                raise ValueError(f"request {r.custom_id!r} has token id {bad}, outside the "
                                 f"model's vocabulary [0, {self.vocab})")
            if self.context is not None and n >= self.context:  # it decoded past the context
                raise ValueError(f"request {r.custom_id!r} has {n} prompt tokens; the model's "
                                 f"context is {self.context} (it must leave room for one new "
                                 "token)")
        if plan is not None:
            _check_plan(plan, [r.token_ids for r in requests])

    def _run(self, requests: Sequence[BatchRequest], lengths: list[int], plan: BatchPlan,
             on_done: OnDone | None, t0: float) -> EngineReport:
        sched = schedule(plan, lengths)
        pending = [n.rows + n.children for n in sched.nodes]
        if self._long_at is not None:
            sched = _long_rows(sched, lengths, self._long_at, pending)
        prefixes: dict[int, LayerKV] = {}
        resumed: list[_Live] = []  # rows crossing longrope's original length (recomputed)
        puts: list[Transfer[int]] = []
        counts, generated = _Counts(), 0
        batches = pack(sched, lengths, max_tokens=self.max_batch_tokens,
                       max_rows=self.max_batch_rows, max_prefix_tokens=self.max_prefix_tokens)
        waiting = deque(sched.rows)  # plan order (continuous admission)
        live: list[_Live] = []
        while True:
            if self.continuous:
                new, c = self._admit(waiting, live, sched.nodes, requests, lengths, prefixes,
                                     pending, puts)
            else:  # static: the next packed batch once the last one has finished
                batch = None if live else next(batches, None)
                new, c = [], _Counts()
                if batch is not None:
                    for nid in batch.nodes:
                        c += self._ensure(sched.nodes, nid, requests, prefixes, pending, puts)
                    new = list(batch.rows)
            counts += c
            if not live and not new and not resumed:
                break
            joined = self._joined(new, requests, resumed)
            resumed = []
            counts += _Counts(computed=sum(len(x) for x in joined.new), forwards=1)
            stepping = self._stepping(live)
            logits = self._forward([*stepping, joined] if joined.rows else stepping, prefixes)
            order = [lv for part in stepping for lv in part.live] + list(joined.live)
            for lv in live:
                lv.length += 1
            toks = choose_tokens(logits, [lv.state for lv in order])
            live = []
            for lv, tok in zip(order, toks, strict=True):
                generated += 1
                if lv.state.add(tok, self.eos, self.tokenizer):
                    lv.buf.leave(lv)
                    if on_done is not None:
                        on_done(lv.state.index, lv.state.completion(self.tokenizer))
                    if lv.row.node >= 0:
                        self._release(sched.nodes, lv.row.node, prefixes, pending)
                elif self._crosses(lv):
                    # generate recomputes the whole sequence with the long factors here
                    lv.buf.leave(lv)
                    if lv.row.node >= 0:
                        self._release(sched.nodes, lv.row.node, prefixes, pending)
                    resumed.append(lv)
                else:
                    live.append(lv)
        for p in puts:
            p.wait()
        return EngineReport(
            requests=len(requests), prompt_tokens=sum(lengths), computed_tokens=counts.computed,
            stored_tokens=counts.stored, generated_tokens=generated, forwards=counts.forwards,
            seconds=time.perf_counter() - t0, token_source="engine",
            threads=(min(self._used), max(self._used)) if self._used else (0, 0))

    def _admit(self, waiting: deque[Row], live: Sequence[_Live], nodes: Sequence[PrefixNode],
               requests: Sequence[BatchRequest], lengths: Sequence[int],
               prefixes: dict[int, LayerKV], pending: list[int], puts: list[Transfer[int]]
               ) -> tuple[list[Row], _Counts]:
        """Rows that join the next forward, in plan order, while it stays within the budgets:
        ``max_batch_tokens`` (each running row's one token counts), ``max_batch_rows`` and
        ``max_prefix_tokens`` of prefixes held. A row is taken regardless when nothing else
        would run (a suffix over the token budget runs alone). Their prefixes are computed."""
        taken: list[Row] = []
        tokens, c = len(live), _Counts()
        held = sum(nodes[i].prefix_len for i in prefixes)
        while waiting:
            r = waiting[0]
            n = lengths[r.prompt] - r.prefix_len
            new = r.node >= 0 and r.node not in prefixes
            # only a new prefix meets the prefix budget: a row of a held one (or of none) adds
            # no prefix K/V, and checking it too ran every row alone once one prefix was over
            if (live or taken) and (tokens + n > self.max_batch_tokens
                                    or len(live) + len(taken) + 1 > self.max_batch_rows
                                    or new and held + nodes[r.node].prefix_len
                                    > self.max_prefix_tokens):
                break
            waiting.popleft()
            if new:
                c += self._ensure(nodes, r.node, requests, prefixes, pending, puts)
                held = sum(nodes[i].prefix_len for i in prefixes)
            taken.append(r)
            tokens += n
        return taken, c

    def _crosses(self, lv: _Live) -> bool:
        """``lv``'s next token would sit at longrope's original length, still on the short
        factors (Phi-3's generate recomputes the sequence with the long ones there)."""
        return (self._long_at is not None and not lv.row.long
                and lv.row.prefix_len + lv.length >= self._long_at)

    def _joined(self, rows: Sequence[Row], requests: Sequence[BatchRequest],
                resumed: Sequence[_Live] = ()) -> _Part:
        """Rows joining with their whole suffix, in a new suffix buffer (rows of a prefix side
        by side, so that each prefix is one group of the forward). ``resumed``: rows computed
        again from their first token with longrope's long factors, prompt and tokens so far."""
        order = {n: i for i, n in enumerate(dict.fromkeys(r.node for r in rows))}
        rows = sorted(rows, key=lambda r: order[r.node])
        states = [RowState(requests[r.prompt], r.prompt, r.prefix_len, context=self.context,
                           device=self.device) for r in rows]
        suffixes = tuple(requests[r.prompt].token_ids[r.prefix_len:] for r in rows)
        if resumed:
            rows = [*rows, *(Row(lv.row.prompt, -1, 0, long=True) for lv in resumed)]
            states = [*states, *(lv.state for lv in resumed)]
            suffixes = (*suffixes, *(tuple(requests[lv.row.prompt].token_ids)
                                     + tuple(lv.state.tokens) for lv in resumed))
        # the last new token never goes through the model
        cap = max((len(x) + st.max_new - len(st.tokens) - 1
                   for x, st in zip(suffixes, states, strict=True)), default=0)
        buf = _Buffer(SuffixKV(self.layout.num_layers, len(rows), self.layout.num_kv_heads, cap,
                               self.layout.head_dim, dtype=self.dtype, device=self.device))
        buf.rows = [_Live(r, st, buf, i, len(x))
                    for i, (r, st, x) in enumerate(zip(rows, states, suffixes, strict=True))]
        return _Part(buf.kv, tuple(rows), tuple(range(len(rows))), (0,) * len(rows), suffixes,
                     tuple(buf.rows))

    @staticmethod
    def _stepping(live: Sequence[_Live]) -> list[_Part]:
        """Running rows, one new token each: one part per suffix buffer, in slot order."""
        bufs = {id(lv.buf): lv.buf for lv in live}.values()
        return [_Part(b.kv, tuple(x.row for x in b.rows), tuple(range(len(b.rows))),
                      tuple(x.length for x in b.rows), tuple([x.state.tokens[-1]] for x in b.rows),
                      tuple(b.rows), stepping=True)
                for b in bufs]

    def _ensure(self, nodes: Sequence[PrefixNode], nid: int, requests: Sequence[BatchRequest],
                prefixes: dict[int, LayerKV], pending: list[int], puts: list[Transfer[int]]) -> _Counts:
        """Compute node ``nid``'s prefix (and its ancestors') unless held."""
        if nid in prefixes:
            return _Counts()
        node = nodes[nid]
        c = _Counts()
        if node.parent >= 0:
            c = self._ensure(nodes, node.parent, requests, prefixes, pending, puts)
        c += self._compute_prefix(node, requests[node.source].token_ids, prefixes, puts)
        if node.parent >= 0:
            self._release(nodes, node.parent, prefixes, pending)
        return c

    @staticmethod
    def _release(nodes: Sequence[PrefixNode], nid: int, prefixes: dict[int, LayerKV],
                 pending: list[int]) -> None:
        """One row or child of ``nid`` is done with its prefix; drop it after the last."""
        pending[nid] -= 1
        if pending[nid] == 0:
            prefixes.pop(nid, None)


def _long_rows(sched: Schedule, lengths: Sequence[int], limit: int, pending: list[int]
               ) -> Schedule:
    """``sched`` with each prompt longer than longrope's original length ``limit`` run whole
    on the long factors (as generate computes it), not after a shared prefix computed on the
    short ones; ``pending`` (rows and children of each node) counts it no more."""
    rows = []
    for r in sched.rows:
        if lengths[r.prompt] > limit:
            if r.node >= 0:
                pending[r.node] -= 1
            r = Row(r.prompt, -1, 0, long=True)
        rows.append(r)
    return Schedule(nodes=sched.nodes, rows=tuple(rows))


def _check_plan(plan: BatchPlan, prompts: Sequence[Sequence[int]]) -> None:
    """``plan`` is for ``prompts``: each runs once, and each row's prompt starts with every
    prefix it is given. A plan for fewer prompts dropped the rest without a completion; one
    for other prompts decoded rows against another prompt's K/V."""
    if plan.num_prompts != len(prompts) or sorted(plan.order) != list(range(len(prompts))):
        raise ValueError(f"the plan is for {plan.num_prompts} prompts, got {len(prompts)}")
    for s in plan.steps:
        g = s.group
        while g >= 0:
            grp = plan.groups[g]
            n = grp.shared_tokens
            if len(prompts[s.prompt]) <= n or prompts[s.prompt][:n] != prompts[grp.first][:n]:
                raise ValueError(f"the plan is not for these prompts: prompt {s.prompt} does "
                                 f"not start with the {n} tokens of its shared prefix")
            g = grp.parent
