"""fetch and prefetch: plan under the lock, then lower-tier reads and layer-wise copies on the copy engine."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore import streams as _streams
from kvstore.errors import DiskError, StoreClosedError, TensorMismatchError
from kvstore.keys import BlockKey
from kvstore.store.copy_engine import (
    Job,
    copy_block_runs,
    copy_done,
    layerwise_supported,
    mark_layer_done,
)
from kvstore.store.residency import Residency, Stretch
from kvstore.store.state import StoreState
from kvstore.streams import NO_HANDOFF, Handoff, Stream, begin_copy, handoff, host_wait
from kvstore.tiers.base import Located, LowerTier, ReadStatus
from kvstore.tiers.slab import paired_runs
from kvstore.transfer import Transfer
from kvstore.validate import check_out

log = logging.getLogger("kvstore.store")


@dataclass(slots=True)
class FetchPlan:
    """What one fetch reads from where; built under the store lock, used by the copy jobs."""

    keys: list[BlockKey]  # the leading run found at planning time
    parent: BlockKey | None
    hot: list[tuple[int, int]]  # (position, hot slot)
    warm: list[tuple[int, int]]  # (position, warm slot)
    lower: list[tuple[int, int]]  # (position, reserved warm slot or -1) to read from a lower tier
    promote: list[int]  # hot slots reserved for the warm and lower-tier positions, in order
    pinned: list[BlockKey]
    deps: list[tuple[int, Transfer]]  # (position, pending put that writes it)
    valid: int = 0  # leading positions whose bytes are good
    direct: bool = False  # lower-tier blocks were read straight into the result
    staging: torch.Tensor | None = None  # host rows for lower-tier blocks without a warm slot
    promote_failed: bool = False  # the hot copies were not made: release the hot slots
    fill: bool = False  # warm copies of direct reads are made after the fetch (fill_warm)
    unfilled: set[int] = field(default_factory=set)  # positions whose warm copy failed
    # position -> (lower tier index, what it located, index in it): found while planning
    source: dict[int, tuple[int, Located, int]] = field(default_factory=dict)

    def located(self, idx: Sequence[int]) -> Located:
        """What planning located for the lower-tier reads ``lower[j]``, ``j`` in ``idx``."""
        srcs = [self.source[self.lower[j][0]] for j in idx]
        keys = tuple(loc.keys[q] for _, loc, q in srcs)
        if any(loc.handles is None for _, loc, _ in srcs):
            return Located(keys)
        return Located(keys, tuple(loc.handles[q] for _, loc, q in srcs))

    def tier_of(self, p: int) -> int:
        """The lower tier a position is read from (-1: memory)."""
        src = self.source.get(p)
        return -1 if src is None else src[0]


class Fetcher:
    """``fetch``/``prefetch``: plan under the lock, then lower-tier reads and layer-wise copies."""

    def __init__(self, st: StoreState, res: Residency) -> None:
        self.st = st
        self.res = res

    # -- fetch ----------------------------------------------------------------------------
    def fetch(
        self, keys: Sequence[bytes], *, out: torch.Tensor | None = None
    ) -> Transfer[torch.Tensor]:
        """Copy the leading held blocks of ``keys`` to the store's device (or into ``out``).

        The result ``[n, L, P, T, H, D]`` has ``n <= len(keys)`` blocks: the run stops at the
        first miss or damaged block (damage is counted, never raised). Blocks read from disk
        land in the warm tier; blocks served from a lower tier are promoted into hot. With
        ``out``, the result is ``out[:n]``: rows ``out[n:]`` are never changed (they may hold
        the caller's data), even where a read of theirs landed before the damage was seen.
        """
        ks = self.st.keys(keys)
        if out is not None:
            self.check_out(out, len(ks))
        return self.fetch_keys(ks, self.st.chain_parent(keys), out, want_result=True)

    def fetch_keys(
        self, ks: list[BlockKey], parent: BlockKey | None, out: torch.Tensor | None,
        *, want_result: bool,
    ) -> Transfer:
        return self.submit(ks, parent, out, want_result=want_result)[0]

    def submit(
        self, ks: list[BlockKey], parent: BlockKey | None, out: torch.Tensor | None,
        *, want_result: bool,
        then: Callable[[bool, BaseException | None], None] | None = None,
    ) -> tuple[Transfer, FetchPlan, torch.Tensor | None]:
        """Plan under the lock, then queue: lower-tier reads (``disk_read``), copies (``h2d``)."""
        with self.st.lock:
            self.st.check_open()
            plan = self.plan(ks, parent, want_result=want_result)
        job = self.job(plan, len(ks), want_result=want_result, then=then)
        try:
            job.start(out)
        except BaseException:
            with self.st.lock:
                self.release_plan(plan, ok=False)
            raise
        return job.transfer, plan, job.result

    def job(self, plan: FetchPlan, asked: int, *, want_result: bool = True,
            then: Callable[[bool, BaseException | None], None] | None = None) -> FetchJob:
        """The job that carries ``plan`` out (of a fetch of ``asked`` blocks): every fetch,
        prefetch and lease is one, built here."""
        return FetchJob(self, plan, asked, want_result, then)

    def check_out(self, out: torch.Tensor, n: int) -> None:
        check_out(self.st.layout, out, n, device=self.st.device)

    def plan(
        self, ks: list[BlockKey], parent: BlockKey | None, *, want_result: bool,
        warm_copies: bool = True, located: Sequence[Stretch] | None = None,
    ) -> FetchPlan:
        """Pin the leading held run of ``ks`` and lay out where each block comes from.
        ``warm_copies``: reserve warm slots for the blocks read from below (their warm
        copies); without, none is reserved, so nothing in warm is evicted for them.
        ``located``: what an earlier look found below memory (``Residency.placement``),
        taken instead of locating it again (``Residency.leading_run``)."""
        hot, warm = self.st.hot, self.st.warm
        found: list[tuple[int, int, Located]] = []
        n = self.res.leading_run(ks, found, located)
        plan = FetchPlan(ks[:n], parent, [], [], [], [], [], [])
        for start, t, loc in found:
            for q in range(len(loc)):
                plan.source[start + q] = (t, loc, q)
        lower_pos: list[int] = []
        # per-block work of every fetch: plain dict lookups, no method call per key
        hot_slots = hot.slots if hot is not None else {}
        warm_slots = warm.slots if warm is not None else {}
        pending = self.st.pending
        on_hot, on_warm, held = plan.hot.append, plan.warm.append, plan.pinned.append
        for i in range(n):
            k = ks[i]
            s = hot_slots.get(k)
            if s is not None:
                on_hot((i, s))
            else:
                s = warm_slots.get(k)
                if s is None:
                    lower_pos.append(i)
                    continue
                on_warm((i, s))
            held(k)
            if pending:
                dep = pending.get(k)
                if dep is not None:
                    plan.deps.append((i, dep))
        if self.res.used(plan.pinned) and self.st.writer is not None:
            self.st.writer.notify()  # second-hit: blocks used twice go to disk
        self.res.pin(plan.pinned)
        self.res.touch_chain(plan.keys)
        if lower_pos:
            assert warm is not None
            slots = self.res.reserve(warm, len(lower_pos)) if warm_copies else []
            plan.lower = [(p, slots[j] if j < len(slots) else -1) for j, p in enumerate(lower_pos)]
            if not want_result and len(slots) < len(lower_pos):
                # a prefetch has nowhere else to put blocks: it ends where the room does
                self.truncate(plan, lower_pos[len(slots)])
        if want_result and hot is not None and (plan.warm or plan.lower):
            plan.promote = self.res.reserve(hot, len(plan.warm) + sum(1 for _, s in plan.lower if s >= 0))
        plan.valid = len(plan.keys)
        return plan

    @staticmethod
    def truncate(plan: FetchPlan, cut: int) -> None:
        plan.keys = plan.keys[:cut]
        plan.hot = [(p, s) for p, s in plan.hot if p < cut]
        plan.warm = [(p, s) for p, s in plan.warm if p < cut]
        plan.lower = [(p, s) for p, s in plan.lower if p < cut and s >= 0]

    def read_lower(self, plan: FetchPlan, result: torch.Tensor | None,
                   ready: Handoff = NO_HANDOFF, *, keep: bool = False) -> None:
        """Read the plan's lower-tier blocks (straight into ``result`` when it is in host
        memory, else into their warm slots or host staging rows), one call per tier with what
        planning located, and cut ``plan.valid`` at the first block not read. A host
        ``result`` is written only after the work its caller queued on it (``ready``).
        ``keep``: it is the caller's ``out``, whose rows past the valid run must end as they
        were: read into warm slots (or staging) instead and copied for the valid run only, as
        for a device ``out`` (a damaged block is found only once its bytes have landed, and
        the blocks after it may have landed too; saving and restoring the caller's rows cost
        2-3x more than this copy, measured)."""
        assert self.st.warm is not None
        warm = self.st.warm.slab.data
        flat = None
        if result is not None and result.numel():
            flat = result.view(result.shape[0], -1).view(torch.uint8)
        plan.direct = flat is not None and flat.device.type == "cpu" and not keep
        if plan.direct:
            assert flat is not None
            host_wait(ready.ready, what="the work queued on a fetch's out buffer")
            streams = self.st.engine.streams if self.st.engine is not None else None
            if streams is not None:
                streams.access(None, writes=[flat[p] for p, _ in plan.lower], what="disk read")
        if not plan.direct and any(s < 0 for _, s in plan.lower):
            plan.staging = torch.empty((len(plan.lower), self.st.layout.block_nbytes),
                                       dtype=torch.uint8, pin_memory=self.st.config.pin_memory)
        dsts = [flat[p] if plan.direct else warm[s] if s >= 0 else plan.staging[j]
                for j, (p, s) in enumerate(plan.lower)]
        self._read_tiers(plan, dsts)

    def read_into(self, plan: FetchPlan, into: Callable[[int], Sequence[object]]) -> None:
        """Read the plan's lower-tier blocks straight into ``into(position)`` (the pieces that
        take that block's bytes in order: an engine's pages), verified by the reading
        threads; their warm copies are filled after the fetch (``plan.fill``). Durable tiers
        only (a volatile tier's block read twice could have expired: the caller checks).
        Cuts ``plan.valid`` at the first block not read."""
        plan.direct = True
        assert self.st.engine is not None
        with self.st.engine.foreground():  # not a job: tell background work it is running
            self._read_tiers(plan, [into(p) for p, _ in plan.lower])

    def _read_tiers(self, plan: FetchPlan, dsts: Sequence[Any]) -> None:
        """Each lower tier reads its blocks of the plan into ``dsts`` (one per
        ``plan.lower`` entry); cut ``plan.valid`` at the first block not read."""
        assert self.st.warm is not None
        warm = self.st.warm.slab.data
        statuses: list[ReadStatus] = [ReadStatus.MISSING] * len(plan.lower)
        damaged = missed = 0
        for t, tier in enumerate(self.st.lower):
            idx = [j for j, (p, _) in enumerate(plan.lower) if plan.tier_of(p) == t]
            if not idx:
                continue
            # read straight into the caller's buffer. A durable tier's blocks are read again
            # into their warm slots after the fetch completed (fill_warm: page-cache hits, off
            # the caller's path); a volatile tier's are copied by the reading threads as each
            # run lands (a second round trip could find them expired)
            mirrors = None
            if plan.direct and tier.volatile:
                mirrors = [warm[plan.lower[j][1]] if plan.lower[j][1] >= 0 else None for j in idx]
            elif plan.direct:
                plan.fill = plan.fill or any(plan.lower[j][1] >= 0 for j in idx)
            got = self.read_tier(tier, plan.located(idx), [dsts[j] for j in idx], mirrors)
            for j, st in zip(idx, got, strict=True):
                statuses[j] = st
                # DAMAGED: bytes corrupt or gone; MISSING: removed since the lookup (evicted,
                # expired) or a read that cannot be made now: a plain miss, not damage
                damaged += st is ReadStatus.DAMAGED
                missed += st is ReadStatus.MISSING
        self._cut_at_bad(plan, statuses, damaged, missed)

    def _cut_at_bad(self, plan: FetchPlan, statuses: list[ReadStatus], damaged: int,
                    missed: int) -> None:
        bad = [p for (p, _), st in zip(plan.lower, statuses, strict=True) if st is not ReadStatus.OK]
        if bad:
            with self.st.lock:
                self.st.counters.damaged += damaged
                self.st.counters.read_misses += missed
            plan.valid = min(plan.valid, min(bad))

    @staticmethod
    def read_tier(tier: LowerTier, found: Located, dsts: Sequence[Any],
                  mirrors: list[torch.Tensor | None] | None) -> list[ReadStatus]:
        try:
            return tier.read(found, dsts, mirrors)
        except (StoreClosedError, TensorMismatchError):  # the caller's buffers: its to fix
            raise
        except Exception as e:  # a counted miss, never wrong KV: a DiskError is a read that
            # cannot be made now (no index reader slot, ...), anything else a damaged index/tier
            now = isinstance(e, DiskError)
            log.warning("fetch: reading %d block(s) from the %s tier failed (%s: %s); "
                        "treating them as %s", len(dsts), tier.name, type(e).__name__, e,
                        "misses" if now else "damaged")
            return [ReadStatus.MISSING if now else ReadStatus.DAMAGED] * len(dsts)

    def fill_warm(self, plan: FetchPlan) -> None:
        """Read the durable tiers' blocks of a direct fetch into their reserved warm slots,
        verified like any read, after the caller has its bytes (never from the caller's
        buffer, which it may already be reusing). A block not read back is not published
        in warm, nor any after it (``plan.unfilled``)."""
        assert self.st.warm is not None
        warm = self.st.warm.slab.data
        n = plan.valid
        for t, tier in enumerate(self.st.lower):
            if tier.volatile:
                continue
            idx = [j for j, (p, s) in enumerate(plan.lower)
                   if s >= 0 and p < n and plan.tier_of(p) == t]
            if not idx:
                continue
            got = self.read_tier(tier, plan.located(idx), [warm[plan.lower[j][1]] for j in idx],
                                 None)
            plan.unfilled.update(plan.lower[j][0] for j, st in zip(idx, got, strict=True)
                                 if st is not ReadStatus.OK)
        if plan.unfilled:  # what joins warm stays prefix-closed: nothing after a gap
            cut = min(plan.unfilled)
            plan.unfilled.update(p for p, _ in plan.lower if p > cut)

    def copy(
        self, plan: FetchPlan, result: torch.Tensor | None, t: Transfer,
        stream: Stream | None, *, whole_blocks: bool = False, ready: Handoff = NO_HANDOFF,
    ) -> list:
        """Copy every block into ``result`` layer by layer, then promote into hot.

        Runs on the ``h2d`` worker: returns one event per layer (or marks the layers ready as
        it goes without a stream).
        """
        self.wait_deps(plan)
        n = plan.valid
        lay = self.st.layout
        if result is None or n == 0:
            t.set_layers_ready(lay.num_layers)
            return []
        L, lb = lay.num_layers, lay.layer_nbytes
        dst = result[:n].view(n, -1).view(torch.uint8)
        sources: list[tuple[torch.Tensor, list[tuple[int, int, int]]]] = []
        if self.st.hot is not None and plan.hot:
            sources.append((self.st.hot.slab.data, list(paired_runs([(p, s) for p, s in plan.hot if p < n]))))
        if self.st.warm is not None:
            warm_items = [(p, s) for p, s in plan.warm if p < n]
            if not plan.direct:
                warm_items += [(p, s) for p, s in plan.lower if p < n and s >= 0]
            if warm_items:
                sources.append((self.st.warm.slab.data, list(paired_runs(sorted(warm_items)))))
        if plan.staging is not None and not plan.direct:
            rows = [(p, j) for j, (p, s) in enumerate(plan.lower) if p < n and s < 0]
            if rows:
                sources.append((plan.staging, list(paired_runs(rows))))
        events: list = []
        streams = self.st.engine.streams if self.st.engine is not None else None
        begin_copy(streams, ready, stream)  # after the caller's work on result (rule 1)
        if streams is not None:
            streams.access(stream, reads=[data[s : s + m] for data, runs in sources
                                          for _, s, m in runs],
                           writes=[dst], what="fetch")
        if whole_blocks or not layerwise_supported(dst, *(d for d, _ in sources)):
            for data, runs in sources:  # every layer ready together
                copy_block_runs(dst, data, runs, layer=None, layer_nbytes=lb, stream=stream)
            if stream is None:
                t.set_layers_ready(L)
                return []
            return copy_done(stream) * L
        for layer in range(L):
            for data, runs in sources:
                copy_block_runs(dst, data, runs, layer=layer, layer_nbytes=lb, stream=stream)
            mark_layer_done(t, stream, layer, events)
        return events

    def wait_deps(self, plan: FetchPlan) -> None:
        """Wait (bounded) for the puts still copying blocks of the plan (they run on the
        ``d2h`` path); a put that failed or stored nothing cuts the run before its block."""
        for p, dep in plan.deps:
            if p >= plan.valid:
                continue
            try:
                stored = dep.wait(_streams.COPY_TIMEOUT_S)
            except Exception:  # its copy failed or hung: those bytes are not there
                stored = 0
            if stored == 0:
                plan.valid = min(plan.valid, p)

    def promote_copy(self, plan: FetchPlan, stream: Stream | None) -> list:
        """Copy the fetched lower-tier blocks from their warm slots into reserved hot slots.

        Runs after the fetch completed (the caller already has its bytes), from the warm
        slots, never from the caller's buffer, which it may already be reusing.
        """
        hot, warm = self.st.hot, self.st.warm
        if hot is None or warm is None or not plan.promote:
            return []
        lower = sorted(plan.warm + [(p, s) for p, s in plan.lower if s >= 0])
        items = [(plan.promote[j], s) for j, (p, s) in enumerate(lower[: len(plan.promote)])
                 if p < plan.valid and p not in plan.unfilled]
        streams = self.st.engine.streams if self.st.engine is not None else None
        for dst_first, src_first, length in paired_runs(items):
            d = hot.slab.data[dst_first : dst_first + length]
            s = warm.slab.data[src_first : src_first + length]
            if streams is not None:
                streams.access(stream, reads=[s], writes=[d], what="promotion")
            d.copy_(s, non_blocking=stream is not None)
        return copy_done(stream)

    def count_served(self, plan: FetchPlan, n: int) -> None:
        """Attribute the first ``n`` blocks of ``plan`` to the tier each was served from
        (``st.lock`` held): the per-tier hits of ``stats()``."""
        served = self.st.counters.served
        for name, items in (("hot", plan.hot), ("warm", plan.warm)):
            got = sum(1 for p, _ in items if p < n)
            if got:
                served[name] = served.get(name, 0) + got
        for p, _ in plan.lower:
            if p < n:
                name = self.st.lower[plan.tier_of(p)].name
                served[name] = served.get(name, 0) + 1

    def release_plan(self, plan: FetchPlan, *, ok: bool) -> None:
        hot, warm, cat = self.st.hot, self.st.warm, self.st.catalog
        if self.st.closed:
            return
        n = plan.valid if ok else 0
        joined_warm: list[BlockKey] = []
        joined_hot: list[BlockKey] = []
        # blocks read from a lower tier join the warm tier (only the valid leading run: prefix-closed)
        for p, slot in plan.lower:
            if slot < 0:
                continue
            assert warm is not None
            k = plan.keys[p] if p < len(plan.keys) else None
            if k is not None and p < n and k not in warm and p not in plan.unfilled:
                self.res.read_from_below(k, plan.keys[p - 1] if p else plan.parent,
                                         plan.tier_of(p))
                warm.insert(k, slot)
                warm.counters.promotions_in += 1
                joined_warm.append(k)
            else:
                warm.release(slot)
        if hot is not None and plan.promote:
            lower = sorted(plan.warm + [(p, s) for p, s in plan.lower if s >= 0])
            for (p, _), slot in zip(lower, plan.promote, strict=False):
                k = plan.keys[p] if p < len(plan.keys) else None
                if (k is not None and p < n and not plan.promote_failed and k not in hot
                        and k in cat and p not in plan.unfilled):
                    hot.insert(k, slot)
                    hot.counters.promotions_in += 1
                    joined_hot.append(k)
                else:
                    hot.release(slot)
        self.st.announce_stored("warm", joined_warm)
        self.st.announce_stored("hot", joined_hot)
        if n:
            if plan.lower or plan.promote:  # blocks joined a tier since the plan touched them
                self.res.touch_chain(plan.keys[:n])
            for low in self.st.lower:
                low.touch(plan.keys[:n])
        self.res.unpin(plan.pinned)

    # -- prefetch / flush / stats -------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> Transfer[int]:
        """Read the leading held blocks of ``keys`` from disk into the warm tier ahead of need.

        Yields the number of leading blocks now held in memory.
        """
        ks = self.st.keys(keys)
        return self.fetch_keys(ks, self.st.chain_parent(keys), None, want_result=False)


class FetchJob:
    """One planned fetch or prefetch on its way: lower-tier reads on ``disk_read``, then the
    layer-wise copies on ``h2d``, then settling the plan (and promotion into hot behind the
    caller's back). Every path ends in ``finish`` exactly once."""

    def __init__(self, fetcher: Fetcher, plan: FetchPlan, asked: int, want_result: bool,
                 then: Callable[[bool, BaseException | None], None] | None) -> None:
        self.fetcher = fetcher
        self.st = fetcher.st
        self.plan = plan
        self.asked = asked
        self.want_result = want_result
        self.then = then
        self.result: torch.Tensor | None = None
        self.ready: Handoff = NO_HANDOFF  # the caller's stream when it submitted (rule 1)
        self.keep = False  # the result is the caller's out: rows past the run stay as they were
        self.transfer: Transfer = Transfer(self.st.layout.num_layers)
        assert self.st.engine is not None
        self.engine = self.st.engine

    def start(self, out: torch.Tensor | None) -> None:
        plan, lay = self.plan, self.st.layout
        if self.want_result:
            n = len(plan.keys)
            self.keep = out is not None
            if out is None:
                out = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device=self.st.device)
            self.result = out[:n]
            self.ready = handoff(self.engine.streams, self.result)
        if self.want_result and not self.engine.asynchronous and not plan.lower and not plan.deps:
            # Host memory only, nothing in flight that these bytes wait for: copying right
            # here in whole-block runs beats a hand-off to the worker (the blocks are pinned).
            try:
                self.fetcher.copy(plan, self.result, self.transfer, None, whole_blocks=True)
            except BaseException as e:  # reported through the transfer
                self.finish(False, e)
            else:
                self.finish(True, None)
        elif plan.lower:
            self.engine.submit("disk_read", Job(Transfer(), self.read, self.after_read))
        elif self.want_result:
            self.engine.submit("h2d", self.copy_job())
        else:
            self.finish(True, None)

    def copy_job(self) -> Job:
        return Job(self.transfer, lambda stream: self.fetcher.copy(
            self.plan, self.result, self.transfer, stream, ready=self.ready), self.finish)

    def read(self, stream: Stream | None) -> list:
        self.fetcher.read_lower(self.plan, self.result, self.ready, keep=self.keep)
        return []

    def after_read(self, ok: bool, error: BaseException | None) -> None:
        if not ok:
            self.finish(False, error)
        elif self.want_result:
            try:
                self.engine.submit("h2d", self.copy_job())
            except BaseException as e:  # closing: fail cleanly, release everything
                self.finish(False, e)
        else:
            self.finish(True, None)

    def settle(self, ok: bool, error: BaseException | None = None) -> None:
        with self.st.lock:
            self.fetcher.release_plan(self.plan, ok=ok)

    def finish(self, ok: bool, error: BaseException | None) -> None:
        plan, t = self.plan, self.transfer
        if not self.want_result:
            # a prefetch's point is the blocks being in warm: settle before completing
            self.settle(ok)
            if ok:
                t.set_result(plan.valid)
            else:
                t.set_error(error or RuntimeError("prefetch failed"))
            if self.then is not None:
                self.then(ok, error)
            return
        with self.st.lock:
            self.st.counters.fetched(self.asked, plan.valid if ok else 0)
            if ok:
                self.fetcher.count_served(plan, plan.valid)
        filling = self.start_fill(ok)
        if not ok:
            t.set_error(error or RuntimeError("fetch failed"))
        else:
            assert self.result is not None
            t.set_result(self.result[: plan.valid])
        if self.then is not None:
            self.then(ok, error)
        if not filling:
            self.promote_or_settle(ok)

    def start_fill(self, ok: bool) -> bool:
        """Queue the warm copies of blocks read straight into the caller's buffer (when there
        are any): behind the caller's back, on the d2h path (into warm, off every fetch's
        disk_read and h2d); queued before the result is out, so that a flush after it waits
        for them too. The fill then promotes or settles; False: settle it yourself."""
        plan = self.plan
        if not (ok and plan.fill and plan.valid > 0):
            return False
        try:
            self.engine.submit("d2h", Job(Transfer(), self.fill, self.after_fill))
        except BaseException:  # closing: publish nothing of them in warm
            plan.unfilled.update(p for p, _ in plan.lower)
            return False
        return True

    def settle_direct(self, ok: bool) -> None:
        """The end of a fetch the caller ran itself (``Fetcher.read_into``; counted by it):
        fill the warm copies behind its back, then promote or settle."""
        if not self.start_fill(ok):
            self.promote_or_settle(ok)

    def fill(self, stream: Stream | None) -> list:
        self.fetcher.fill_warm(self.plan)
        return []

    def after_fill(self, ok: bool, error: BaseException | None) -> None:
        if not ok:
            self.plan.unfilled.update(p for p, _ in self.plan.lower)
        self.promote_or_settle(True)

    def promote_or_settle(self, ok: bool) -> None:
        plan = self.plan
        if ok and plan.promote and plan.valid:
            # promotion into hot happens behind the caller's back, off its critical path
            try:
                self.engine.submit("h2d", Job(
                    Transfer(), lambda st: self.fetcher.promote_copy(plan, st), self.settle))
                return
            except BaseException:  # closing: just settle without promoting
                plan.promote_failed = True
        self.settle(ok)
