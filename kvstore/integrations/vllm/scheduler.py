"""The scheduler side of the connector: which prompt blocks vLLM gets from the store, and the
per-step plan of loads and saves the worker side carries out.

It keys each request's prompt with kvstore's content keys (``salt`` = the request's
``cache_salt``; a LoRA adapter's name and path are the first block's extra bytes), asks the
store for the longest cached run beyond what vLLM's own prefix cache already has, and claims
whole blocks only, never the whole prompt (vLLM computes at least one token). It then plans,
per step, which blocks the worker loads (the claimed ones, into the pages vLLM allocated for
them) and which full prompt blocks it saves once computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.api import KVCache
from kvstore.client import Client
from kvstore.errors import ConfigError
from kvstore.hints import PutHint, hint_of
from kvstore.keys import KeyChain
from kvstore.store import Store

from .load_cost import LoadCost
from .metadata import BlockRun, KVStoreConnectorMetadata, KVStoreWorkerMetadata, Located
from .stats import ConnectorStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger("vllm.kvstore")

#: a request's ``kv_transfer_params`` keys this connector reads (the put hint of its saves)
SESSION_PARAM = "kvstore_session"
PRIORITY_PARAM = "kvstore_priority"


def request_hint(request: Any) -> PutHint | None:
    """The put hint of a request's saves, from its ``kv_transfer_params``
    (``{"kvstore_session": "conversation-42", "kvstore_priority": -1}``, both optional; the
    OpenAI server passes the request body's ``kv_transfer_params``). A bad value is logged and
    ignored: a hint only orders eviction, so it never fails a request."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict):
        return None
    try:  # kvstore.hints checks both fields (the daemon's put message goes through it too)
        return hint_of(params.get(SESSION_PARAM), params.get(PRIORITY_PARAM, 0))
    except ConfigError as e:
        log.warning("kvstore: request %s: ignoring its kv_transfer_params hint: %s",
                    getattr(request, "request_id", "?"), e)
        return None


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side bookkeeping for one request."""

    keys: KeyChain | None  # full blocks keyed so far (None: not cacheable)
    prompt_len: int
    request: Any = None  # vLLM's Request (its all_token_ids grow as tokens are generated)
    salt: str | None = None
    lora_tag: bytes | None = None  # the first block's extra bytes (a LoRA adapter)
    store_hit: int = 0  # leading blocks the store held at the last lookup
    local_blocks: int = 0  # blocks vLLM's own prefix cache had at the last lookup
    saved_upto: int = 0  # blocks [0, saved_upto) are in the store or queued to be saved
    block_ids: list[int] = field(default_factory=list)  # vLLM pages, group 0
    load: BlockRun | None = None  # planned by update_state_after_alloc, sent once
    load_async: bool = False  # the last match asked vLLM to load in the background
    load_now: str = ""  # else why it loads before the step (_load_now: its counter)
    located: Located = field(default_factory=list)  # what the last lookup found below memory
    hint: PutHint | None = None  # the saves' put hint (request_hint)
    failed_at: int | None = None  # first block a load of this request failed on
    tainted: bool = False  # computed over poisoned pages since its last lookup: never saved
    suspect: bool = False  # its pages may include poisoned ones: checked whole next step


def kv_role_sides(kv_transfer_config: object) -> dict[str, bool]:
    """``loads`` / ``saves`` of :class:`SchedulerSide` from ``KVTransferConfig.kv_role``:
    ``kv_both`` (and an unset role) both, ``kv_producer`` saves only, ``kv_consumer`` loads
    only (an engine that must not write to a store others read, as in disaggregated prefill)."""
    role = getattr(kv_transfer_config, "kv_role", None) or "kv_both"
    if role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ConfigError(f"kv_role={role!r}: one of 'kv_both', 'kv_producer', 'kv_consumer'")
    return {"loads": role != "kv_producer", "saves": role != "kv_consumer"}


class SchedulerSide:
    """The scheduler role's state and calls (``KVStoreConnector`` delegates to it)."""

    def __init__(self, store: KVCache, *, block_size: int, namespace_id: bytes,
                 stats: ConnectorStats, save_decode_blocks: bool = True,
                 load_async: bool = True, load_cost: LoadCost | None = None,
                 loads: bool = True, saves: bool = True) -> None:
        self.store = store
        # KVTransferConfig.kv_role: a kv_producer never loads, a kv_consumer never saves
        self.loads, self.saves = loads, saves
        # the engine step (timed here) and the worker's loads below memory (its samples come
        # in update_connector_output): whether a hit below memory is cheaper loaded now
        self.load_cost = load_cost or LoadCost()
        self._last_step: float | None = None
        self.block_size = block_size
        self.namespace_id = namespace_id
        self.stats = stats
        self.save_decode_blocks = save_decode_blocks
        self.load_async = load_async
        self._reqs: dict[str, _ReqState] = {}
        self._async_loads: list[BlockRun] = []  # planned, not yet sent to the worker
        # pages a failed load left (garbage vLLM may still serve from its own prefix cache:
        # it keeps them cached for the failed request to recompute, which may be aborted
        # first) or a tainted request wrote, until a clean request rewrites them whole
        self._poisoned: set[int] = set()

    # -- lookups -------------------------------------------------------------------------------
    def request_keys(self, request: Request) -> KeyChain | None:
        """The chained keys of the request's full prompt blocks (None: not cacheable)."""
        tokens = getattr(request, "prompt_token_ids", None)
        if tokens is None or getattr(request, "prompt_embeds", None) is not None:
            return None
        if getattr(request, "mm_features", None):
            return None  # multimodal inputs are not part of the key: never share their KV
        return self._keys(tokens, _lora_tag(request), getattr(request, "cache_salt", None) or None)

    def _keys(self, tokens: Sequence[int], lora_tag: bytes | None, salt: str | None) -> KeyChain:
        extras = None
        n_full = len(tokens) // self.block_size
        if lora_tag is not None and n_full:
            extras = [lora_tag] + [None] * (n_full - 1)
        return self.store.block_keys(tokens, salt, extras=extras)

    def _extend_keys(self, st: _ReqState, blocks: int) -> None:
        """Key the request's full blocks up to ``blocks``, generated tokens included (vLLM
        appends each sampled token to ``all_token_ids``): a chat's next turn, whose prompt
        repeats this answer, then hits it."""
        assert st.keys is not None
        tokens = getattr(st.request, "all_token_ids", None)
        if tokens is None:
            return
        blocks = min(blocks, len(tokens) // self.block_size)
        if blocks <= len(st.keys):
            return
        try:
            st.keys = self._keys(list(tokens[:blocks * self.block_size]), st.lora_tag, st.salt)
        except Exception:  # keying failed: the generated blocks are just not saved
            log.exception("kvstore: could not key the generated tokens of request %s",
                          getattr(st.request, "request_id", "?"))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        try:
            return self._match(request, num_computed_tokens)
        finally:
            self.stats.count(lookup_us=int((time.perf_counter() - t0) * 1e6))

    def _match(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            try:
                keys = self.request_keys(request)
            except Exception:  # a request we cannot key is just not cached
                log.exception("kvstore: could not key request %s", request.request_id)
                keys = None
            prompt = getattr(request, "prompt_token_ids", None) or []
            st = self._reqs[request.request_id] = _ReqState(
                keys, len(prompt), request, getattr(request, "cache_salt", None) or None,
                _lora_tag(request), hint=request_hint(request))
        st.load = None
        st.load_async = False
        st.load_now = ""
        st.tainted = st.suspect = False  # (re)starting: its pages are new
        if st.keys is None or not self.loads:
            return 0, False
        bs = self.block_size
        # never the whole prompt: vLLM must compute at least its last token
        claimable = max(0, (st.prompt_len - 1) // bs)
        st.located = []
        try:
            n = self._lookup(st, st.keys[:claimable]) if claimable else 0
        except Exception:  # the store failing is a miss, not an engine error
            log.exception("kvstore: lookup failed")
            n = 0
        if st.failed_at is not None:
            # a background load of this request failed there: vLLM retries the request from
            # its valid prefix, which must not claim the same blocks again (they may still
            # be indexed: a loop of failing loads)
            n = min(n, st.failed_at)
        st.store_hit = n
        st.saved_upto = n
        st.local_blocks = num_computed_tokens // bs
        self.stats.count(lookups=1, lookup_tokens=st.prompt_len)
        if num_computed_tokens % bs:
            return 0, False
        ext = n * bs - num_computed_tokens
        if ext <= 0:
            return 0, False
        st.load_now = self._load_now(st, n) if self.load_async else ""
        st.load_async = self.load_async and not st.load_now
        return ext, st.load_async

    def _load_now(self, st: _ReqState, n: int) -> str:
        """Why a hit loads before the step's forward (``load_kv_async=False``) rather than in
        the background (its counter's name; "": it does not): a background load costs its
        request one more engine step (vLLM schedules it in the step after the worker reports
        the load), so it pays only where a load would hold up other requests' steps. Loaded
        now: a hit whose every block a memory tier holds (a copy, cheaper than a step), and
        any hit while the engine runs nothing else (no other request's step to hold up).
        The rule is docs/vllm.md's "How a hit loads"."""
        assert st.keys is not None
        if self._in_memory(st.keys[st.local_blocks:n]):
            return "memory_loads"
        others = sum(1 for other in self._reqs.values() if other is not st)
        if not others:
            return "idle_loads"
        if self.load_cost.cheaper_now(n - st.local_blocks, others):
            return "cheap_loads"
        return ""

    def _lookup(self, st: _ReqState, keys: list[bytes]) -> int:
        """The store's lookup; an embedded store also says where it found the blocks below
        memory (``st.located``), which the load plan carries to the worker: it reads them
        with it instead of locating them again."""
        if not isinstance(self.store, Store):
            return self.store.lookup(keys)
        n, stretches = self.store.zero_copy.placement(keys)
        st.located = [(start, tier, list(handles)) for start, tier, handles in stretches]
        return n

    def _in_memory(self, keys: list[bytes]) -> bool:
        """Whether the worker can copy all of ``keys`` from memory: an embedded store shared
        with the worker (one process) that holds them in its hot or warm tier, or a daemon
        whose warm tier holds them (its shared key directory says so without a round trip).
        A load from disk or Redis (embedded or behind the daemon) is not."""
        if not keys:
            return False
        try:
            if isinstance(self.store, Store):
                return self.store.zero_copy.memory_run(keys) == len(keys)
            return daemon_warm_run(self.store, keys) == len(keys)
        except Exception:  # a closed store: the load will say
            return False

    # -- allocation and the step's plan --------------------------------------------------------
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.keys is None:
            return
        st.load = None
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        first = st.local_blocks  # vLLM's own hit, as passed to get_num_new_matched_tokens
        count = num_external_tokens // bs
        if num_external_tokens % bs or first + count > min(len(block_ids), len(st.keys)):
            log.warning("kvstore: request %s: load plan does not fit its blocks; skipped",
                        request.request_id)
            return
        run = BlockRun(
            request.request_id, list(st.keys[first:first + count]),
            st.keys[first - 1] if first else None, block_ids[first:first + count],
            located_window(st.located, first, count),
        )
        if st.load_async:
            # vLLM parks the request (WAITING_FOR_REMOTE_KVS) and schedules it once the worker
            # reports the load finished: it is in no step's scheduled requests before that
            st.block_ids = block_ids
            self._async_loads.append(run)
            self.stats.count(async_loads=1)
        else:
            st.load = run
            if st.load_now:
                self.stats.count(**{st.load_now: 1})
        self.stats.count(hit_requests=1, hit_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(namespace_id=self.namespace_id)
        meta.async_loads, self._async_loads = self._async_loads, []
        meta.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        self._time_step(scheduler_output)
        nsched = scheduler_output.num_scheduled_tokens
        written: list[tuple[_ReqState, int, int]] = []  # (request, computed, scheduled)
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None or st.keys is None:
                continue
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            st.suspect = st.suspect or bool(self._poisoned)  # it may hit poisoned pages
            if st.load is not None:
                meta.loads.append(st.load)
                st.load = None
            written.append((st, new.num_computed_tokens, nsched.get(new.req_id, 0)))
            self._plan_save(meta, new.req_id, st, new.num_computed_tokens + nsched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None or st.keys is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
                st.suspect = st.suspect or bool(self._poisoned)
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            if st.load is not None:
                meta.loads.append(st.load)
                st.load = None
            written.append((st, cached.num_computed_tokens[i], nsched.get(req_id, 0)))
            self._plan_save(meta, req_id, st, cached.num_computed_tokens[i] + nsched.get(req_id, 0))
        if self._poisoned or any(st.tainted for st, _, _ in written):
            self._drop_poisoned_saves(meta, written)
        _mark_attended(meta, self._reqs)
        _skip_zeroing(scheduler_output, meta)
        self.stats.write()
        return meta

    def _drop_poisoned_saves(self, meta: KVStoreConnectorMetadata,
                             written: list[tuple[_ReqState, int, int]]) -> None:
        """A request whose step reads a poisoned page (its block table up to what it computes,
        less the pages it rewrites from their first token) is tainted: the pages it writes are
        poisoned too (anyone sharing them reads garbage), and it is never saved again. A page
        a clean request rewrites from its first token, or a load fills, is right again (a
        failed load poisons it again). Only a suspect request's table is read whole (one that
        held a page when a failure was reported, or is new since, in its next step): the pages
        a clean request adds are its own, so a step costs a few pages per request."""
        bs = self.block_size
        for run in meta.loads:
            self._poisoned.difference_update(run.block_ids)
        steps = []  # (request, pages it rewrites from their first token, all it writes, reads)
        for st, computed, n in written:
            end = -(-(computed + n) // bs)
            fresh = set(st.block_ids[-(-computed // bs):end])
            reads = set(st.block_ids[:end]) - fresh if st.suspect else set()
            steps.append((st, fresh, st.block_ids[computed // bs:end], reads))
        tainted = {id(st) for st, *_ in steps if st.tainted}
        while True:  # clean writers heal what others read in the same forward
            healed = set().union(*(f for st, f, _, _ in steps if id(st) not in tainted))
            bad = (self._poisoned - healed).union(
                *(t for st, _, t, _ in steps if id(st) in tainted))
            new = {id(st) for st, _, _, r in steps if id(st) not in tainted and r & bad}
            if not new:
                break
            tainted |= new
        self._poisoned = bad
        for st, *_ in steps:  # a clean request's pages stay clean until a failure is reported
            st.tainted, st.suspect = id(st) in tainted, False
        keep = []
        for run in meta.saves:
            st = self._reqs.get(run.req_id)
            if st is not None and st.tainted:
                self.stats.count(skipped_saves=1)
                continue
            keep.append(run)
        meta.saves = keep

    def _time_step(self, scheduler_output: SchedulerOutput) -> None:
        """One engine step's time, from the previous scheduling to this one: counted only
        when a request runs on from the previous step (else the engine may have idled)."""
        now = time.perf_counter()
        if self._last_step is not None and scheduler_output.scheduled_cached_reqs.req_ids:
            self.load_cost.note_step(now - self._last_step)
        self._last_step = now

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, st: _ReqState,
                   done_tokens: int) -> None:
        assert st.keys is not None
        if not self.saves:
            return
        if not self.save_decode_blocks:
            done_tokens = min(done_tokens, st.prompt_len)
        done = done_tokens // self.block_size
        if done > len(st.keys):
            self._extend_keys(st, done)
        done = min(done, len(st.keys), len(st.block_ids))
        start = st.saved_upto
        if done <= start:
            return
        h = st.hint
        meta.saves.append(BlockRun(req_id, list(st.keys[start:done]),
                                   st.keys[start - 1] if start else None,
                                   st.block_ids[start:done], session=h and h.session,
                                   priority=h.priority if h else 0))
        st.saved_upto = done

    # -- what the worker reported, requests leaving ----------------------------------------------
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker_meta, KVStoreWorkerMetadata):
            for seconds, blocks in worker_meta.loads:
                self.load_cost.note_load(seconds, blocks)
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        self._poisoned.update(bad)
        # blocks that failed to load are recomputed by vLLM: save them again afterwards
        for st in self._reqs.values():
            for i, b in enumerate(st.block_ids):
                if b in bad:
                    st.suspect = True
                    st.saved_upto = min(st.saved_upto, i)
                    st.store_hit = min(st.store_hit, i)
                    st.failed_at = i if st.failed_at is None else min(st.failed_at, i)
                    break

    def request_finished(
        self, request: Request, block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        # a request aborted while its background load runs: vLLM keeps its pages until the
        # worker reports the load finished (its finish_requests), nothing to hold here
        self._reqs.pop(request.request_id, None)
        return False, None


def daemon_warm_run(store: object, keys: Sequence[bytes]) -> int:
    """How many leading ``keys`` a daemon's warm tier holds, read from its shared key
    directory (no round trip, no reconnect: 0 while the daemon is down, for a store that is
    not a daemon client, or a daemon without a shared slab): ``Client.memory_run``."""
    if not isinstance(store, Client):
        return 0
    return store.memory_run(keys)


def located_window(located: Located, first: int, count: int) -> Located:
    """The stretches of ``located`` (positions in the request's keys) that fall in
    ``[first, first + count)``, cut to it and counted from ``first``."""
    out: Located = []
    end = first + count
    for start, tier, handles in located:
        lo, hi = max(start, first), min(start + len(handles), end)
        if lo < hi:
            out.append((lo - first, tier, handles[lo - start:hi - start]))
    return out


def _lora_tag(request: Request) -> bytes | None:
    """A LoRA adapter's identity, the first block's extra bytes (None without one)."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    return (f"lora\0{getattr(lora, 'lora_name', '')}\0{getattr(lora, 'lora_path', '')}"
            f"\0{getattr(lora, 'lora_int_id', '')}").encode()


def _mark_attended(meta: KVStoreConnectorMetadata, reqs: dict[str, _ReqState]) -> None:
    """Give each save the pages of this step's loads that its request attends over. A request
    that hits another's loading pages in vLLM's own prefix cache (blocks being loaded are
    cached at allocation) computes its new blocks over them in the same forward: when those
    pages fail to load, vLLM rewinds it too, and its new blocks must not be saved (they would
    be served later as wrong KV)."""
    if not (meta.loads and meta.saves):
        return
    loaded = {b for run in meta.loads for b in run.block_ids}
    for run in meta.saves:
        st = reqs.get(run.req_id)
        if st is not None:
            run.attends = [b for b in st.block_ids if b in loaded]


def _skip_zeroing(scheduler_output: SchedulerOutput, meta: KVStoreConnectorMetadata) -> None:
    """vLLM zeroes every newly allocated page before the step; the pages this step loads
    are overwritten whole (a page that fails to load is reported and recomputed whole),
    so they need no zeroing. vLLM allows a synchronous loader this one edit."""
    zero = getattr(scheduler_output, "new_block_ids_to_zero", None)
    if not zero or not meta.loads:
        return
    loaded = {b for run in meta.loads for b in run.block_ids}
    scheduler_output.new_block_ids_to_zero = [b for b in zero if b not in loaded] or None
