"""fetch and prefetch: plan under the lock, then disk reads and layer-wise copies on the copy engine."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.copy_engine import Job, copy_block_runs, layerwise_supported, mark_layer_done
from kvstore.errors import StoreClosedError
from kvstore.keys import BlockKey
from kvstore.store.residency import Residency
from kvstore.store.state import StoreState
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
    disk: list[tuple[int, int]]  # (position, reserved warm slot or -1) to read from disk
    promote: list[int]  # hot slots reserved for the warm+disk positions, in order
    pinned: list[BlockKey]
    deps: list[tuple[int, Transfer]]  # (position, pending put that writes it)
    valid: int = 0  # leading positions whose bytes are good
    direct: bool = False  # disk blocks were read straight into the result
    staging: torch.Tensor | None = None  # host rows for disk blocks without a warm slot
    promote_failed: bool = False  # the hot copies were not made: release the hot slots
    remote: set[int] = field(default_factory=set)  # lower positions the remote tier serves
    located: dict[int, bytes] = field(default_factory=dict)  # disk records found at planning


class Fetcher:
    """``fetch``/``prefetch``: plan under the lock, then disk reads and layer-wise copies."""

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
        land in the warm tier; blocks served from a lower tier are promoted into hot.
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
        """Plan under the lock, then queue: disk reads (``disk_read``), copies (``h2d``)."""
        lay = self.st.layout
        with self.st.lock:
            self.st.check_open()
            plan = self.plan(ks, parent, want_result=want_result)
        n = len(plan.keys)
        result = None
        if want_result:
            try:
                if out is None:
                    out = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device=self.st.device)
                result = out[:n]
            except BaseException:
                with self.st.lock:
                    self.release_plan(plan, ok=False)
                raise
        t: Transfer = Transfer(lay.num_layers)
        asked = len(ks)
        engine = self.st.engine
        assert engine is not None

        def settle(ok: bool, error: BaseException | None) -> None:
            with self.st.lock:
                self.release_plan(plan, ok=ok)

        def finish(ok: bool, error: BaseException | None) -> None:
            with self.st.lock:
                if want_result:
                    c = self.st.counters
                    c.fetches += 1
                    c.fetched_blocks += plan.valid if ok else 0
                    c.fetch_short += asked - (plan.valid if ok else 0)
            if not want_result:
                # a prefetch's point is the blocks being in warm: settle before completing
                settle(ok, error)
                if ok:
                    t.set_result(plan.valid)
                else:
                    t.set_error(error or RuntimeError("prefetch failed"))
                if then is not None:
                    then(ok, error)
                return
            if not ok:
                t.set_error(error or RuntimeError("fetch failed"))
            else:
                assert result is not None
                t.set_result(result[: plan.valid])
            if then is not None:
                then(ok, error)
            if ok and plan.promote and plan.valid:
                # promotion into hot happens behind the caller's back, off its critical path
                try:
                    engine.submit("h2d", Job(Transfer(), lambda st: self.promote_copy(plan, st), settle))
                    return
                except BaseException:  # closing: just settle without promoting
                    plan.promote_failed = True
            settle(ok, error)

        def run_copy(stream: torch.cuda.Stream | None) -> list:
            return self.copy(plan, result, t, stream)

        copy_job = Job(t, run_copy, finish)
        if want_result and not engine.cuda and not plan.disk and not plan.deps:
            # Host memory only, nothing in flight that these bytes wait for: copying right
            # here in whole-block runs beats a hand-off to the worker (the blocks are pinned).
            try:
                self.copy(plan, result, t, None, whole_blocks=True)
            except BaseException as e:  # reported through the transfer
                finish(False, e)
            else:
                finish(True, None)
            return t, plan, result
        try:
            self.queue(engine, plan, copy_job, result, finish, want_result)
        except BaseException:
            with self.st.lock:
                self.release_plan(plan, ok=False)
            raise
        return t, plan, result

    def queue(self, engine, plan, copy_job, result, finish, want_result) -> None:
        if plan.disk:
            def run_disk(stream: torch.cuda.Stream | None) -> list:
                self.read_lower(plan, result)
                return []

            def after_disk(ok: bool, error: BaseException | None) -> None:
                if not ok:
                    finish(False, error)
                elif want_result:
                    try:
                        engine.submit("h2d", copy_job)
                    except BaseException as e:  # closing: fail cleanly, release everything
                        finish(False, e)
                else:
                    finish(True, None)

            engine.submit("disk_read", Job(Transfer(), run_disk, after_disk))
        elif want_result:
            engine.submit("h2d", copy_job)
        else:
            finish(True, None)

    def check_out(self, out: torch.Tensor, n: int) -> None:
        check_out(self.st.layout, out, n)

    def plan(
        self, ks: list[BlockKey], parent: BlockKey | None, *, want_result: bool
    ) -> FetchPlan:
        hot, warm, cat = self.st.hot, self.st.warm, self.st.catalog
        remote_at: list[int] = []
        located: dict[int, bytes] = {}
        n = self.res.leading_run(ks, remote_at, located)
        plan = FetchPlan(ks[:n], parent, [], [], [], [], [], [])
        plan.remote = set(remote_at)
        plan.located = located
        disk_pos: list[int] = []
        # per-block work of every fetch: plain dict lookups, no method call per key
        hot_slots = hot._slots if hot is not None else {}
        warm_slots = warm._slots if warm is not None else {}
        pending = self.st.pending
        second_hit = self.st.writer is not None and self.st.config.admission == "second-hit"
        on_hot, on_warm, held = plan.hot.append, plan.warm.append, plan.pinned.append
        for i in range(n):
            k = ks[i]
            s = hot_slots.get(k)
            if s is not None:
                on_hot((i, s))
            else:
                s = warm_slots.get(k)
                if s is None:
                    disk_pos.append(i)
                    continue
                on_warm((i, s))
            held(k)
            if pending:
                dep = pending.get(k)
                if dep is not None:
                    plan.deps.append((i, dep))
            if second_hit and cat.use(k) >= 2:
                cat.mark_dirty(k)
        cat.pin_many(plan.pinned)
        self.res.touch_chain(plan.keys)
        if disk_pos:
            assert warm is not None
            slots = self.res.reserve(warm, len(disk_pos))
            plan.disk = [(p, slots[j] if j < len(slots) else -1) for j, p in enumerate(disk_pos)]
            if not want_result and len(slots) < len(disk_pos):
                # a prefetch has nowhere else to put blocks: it ends where the room does
                self.truncate(plan, disk_pos[len(slots)])
        if want_result and hot is not None and (plan.warm or plan.disk):
            plan.promote = self.res.reserve(hot, len(plan.warm) + sum(1 for _, s in plan.disk if s >= 0))
        plan.valid = len(plan.keys)
        if self.st.writer is not None and self.st.config.admission == "second-hit":
            self.st.writer.notify()
        return plan

    @staticmethod
    def truncate(plan: FetchPlan, cut: int) -> None:
        plan.keys = plan.keys[:cut]
        plan.hot = [(p, s) for p, s in plan.hot if p < cut]
        plan.warm = [(p, s) for p, s in plan.warm if p < cut]
        plan.disk = [(p, s) for p, s in plan.disk if p < cut and s >= 0]

    def read_lower(self, plan: FetchPlan, result: torch.Tensor | None) -> None:
        """Read the plan's disk blocks (straight into ``result`` when it is in host memory,
        else into their warm slots or host staging rows) and cut ``plan.valid`` at damage."""
        from kvstore.tiers.disk import ReadStatus

        assert self.st.warm is not None
        warm = self.st.warm.slab.data
        flat = None
        if result is not None and result.numel():
            flat = result.view(result.shape[0], -1).view(torch.uint8)
        plan.direct = flat is not None and flat.device.type == "cpu"
        if not plan.direct and any(s < 0 for _, s in plan.disk):
            plan.staging = torch.empty((len(plan.disk), self.st.layout.block_nbytes),
                                       dtype=torch.uint8, pin_memory=self.st.config.pin_memory)
        dsts = []
        for j, (p, s) in enumerate(plan.disk):
            if plan.direct:
                dsts.append(flat[p])
            elif s >= 0:
                dsts.append(warm[s])
            else:
                dsts.append(plan.staging[j])
        statuses: list = [None] * len(plan.disk)
        mirrored: set[int] = set()
        for tier, mine in ((self.st.disk, False), (self.st.remote, True)):
            idx = [j for j, (p, _) in enumerate(plan.disk) if (p in plan.remote) == mine]
            if not idx:
                continue
            assert tier is not None
            keys = [plan.keys[plan.disk[j][0]] for j in idx]
            try:
                if mine:
                    got = tier.read_many(keys, [dsts[j] for j in idx],
                                         namespace_id=self.st.namespace_id)
                else:
                    # read straight into the caller's buffer: the reading threads keep the warm
                    # copy as each run lands, overlapping that copy with the reads still going
                    mirrors = None
                    if plan.direct:
                        mirrors = [warm[plan.disk[j][1]] if plan.disk[j][1] >= 0 else None
                                   for j in idx]
                        mirrored.update(idx)
                    # the records found while planning: no second index transaction
                    recs = [plan.located.get(plan.disk[j][0]) for j in idx]
                    got = tier.read_many(keys, [dsts[j] for j in idx], mirrors=mirrors,
                                         namespace_id=self.st.namespace_id,
                                         records=recs if None not in recs else None)
            except StoreClosedError:
                raise
            except Exception as e:  # a damaged index or tier: a counted miss, never wrong KV
                log.warning("fetch: reading %d block(s) from the %s tier failed (%s: %s); "
                            "treating them as damaged", len(idx), "remote" if mine else "disk",
                            type(e).__name__, e)
                got = [ReadStatus.DAMAGED] * len(idx)
            for j, st in zip(idx, got, strict=True):
                statuses[j] = st
        bad = [p for (p, _), st in zip(plan.disk, statuses, strict=True) if st is not ReadStatus.OK]
        damaged = sum(1 for (p, _), st in zip(plan.disk, statuses, strict=True)
                      if st is ReadStatus.DAMAGED or (st is ReadStatus.MISSING and p not in plan.remote))
        if bad:
            with self.st.lock:
                self.st.counters.damaged += damaged  # an expired remote value is a plain miss
            plan.valid = min(plan.valid, min(bad))
        if plan.direct:
            for j, ((p, s), dst) in enumerate(zip(plan.disk, dsts, strict=True)):
                if p < plan.valid and s >= 0 and j not in mirrored:
                    warm[s].copy_(dst)  # keep a warm copy of what was read

    def copy(
        self, plan: FetchPlan, result: torch.Tensor | None, t: Transfer,
        stream: torch.cuda.Stream | None, *, whole_blocks: bool = False,
    ) -> list:
        """Copy every block into ``result`` layer by layer, then promote into hot.

        Runs on the ``h2d`` worker: returns one CUDA event per layer (or marks the layers
        ready as it goes on the CPU).
        """
        for p, dep in plan.deps:  # a put queued before us on this path has finished (FIFO)
            if dep.done() and dep.exception() is None and dep.wait() == 0:
                plan.valid = min(plan.valid, p)  # its copy failed: those bytes are not there
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
                warm_items += [(p, s) for p, s in plan.disk if p < n and s >= 0]
            if warm_items:
                sources.append((self.st.warm.slab.data, list(paired_runs(sorted(warm_items)))))
        if plan.staging is not None and not plan.direct:
            rows = [(p, j) for j, (p, s) in enumerate(plan.disk) if p < n and s < 0]
            if rows:
                sources.append((plan.staging, list(paired_runs(rows))))
        events: list = []
        if whole_blocks or not layerwise_supported(stream):  # every layer ready together
            for data, runs in sources:
                copy_block_runs(dst, data, runs, layer=None, layer_nbytes=lb, stream=stream)
            if stream is None:
                t.set_layers_ready(L)
                return []
            ev = torch.cuda.Event()
            ev.record(stream)
            return [ev] * L
        for layer in range(L):
            for data, runs in sources:
                copy_block_runs(dst, data, runs, layer=layer, layer_nbytes=lb, stream=stream)
            mark_layer_done(t, stream, layer, events)
        return events

    def promote_copy(self, plan: FetchPlan, stream: torch.cuda.Stream | None) -> list:
        """Copy the fetched lower-tier blocks from their warm slots into reserved hot slots.

        Runs after the fetch completed (the caller already has its bytes), from the warm
        slots, never from the caller's buffer, which it may already be reusing.
        """
        hot, warm = self.st.hot, self.st.warm
        if hot is None or warm is None or not plan.promote:
            return []
        lower = sorted(plan.warm + [(p, s) for p, s in plan.disk if s >= 0])
        items = [(plan.promote[j], s) for j, (p, s) in enumerate(lower[: len(plan.promote)])
                 if p < plan.valid]
        for dst_first, src_first, length in paired_runs(items):
            hot.slab.data[dst_first : dst_first + length].copy_(
                warm.slab.data[src_first : src_first + length], non_blocking=stream is not None)
        if stream is None:
            return []
        ev = torch.cuda.Event()
        ev.record(stream)
        return [ev]

    def release_plan(self, plan: FetchPlan, *, ok: bool) -> None:
        hot, warm, cat = self.st.hot, self.st.warm, self.st.catalog
        if self.st.closed:
            return
        n = plan.valid if ok else 0
        # blocks read from disk join the warm tier (only the valid leading run: prefix-closed)
        for p, slot in plan.disk:
            if slot < 0:
                continue
            assert warm is not None
            k = plan.keys[p] if p < len(plan.keys) else None
            if k is not None and p < n and k not in warm:
                if k not in cat:
                    cat.add(k, plan.keys[p - 1] if p else plan.parent)
                    if p in plan.remote and self.st.disk is not None:
                        cat.mark_dirty(k)  # a block from another host: keep a local copy too
                        self.st.skip_remote.add(k)
                    else:
                        cat.set_on_disk(k)
                warm.insert(k, slot)
                warm.counters.promotions_in += 1
            else:
                warm.release(slot)
        if hot is not None and plan.promote:
            lower = sorted(plan.warm + [(p, s) for p, s in plan.disk if s >= 0])
            for (p, _), slot in zip(lower, plan.promote, strict=False):
                k = plan.keys[p] if p < len(plan.keys) else None
                if k is not None and p < n and not plan.promote_failed and k not in hot and k in cat:
                    hot.insert(k, slot)
                    hot.counters.promotions_in += 1
                else:
                    hot.release(slot)
        if n:
            if plan.disk or plan.promote:  # blocks joined a tier since the plan touched them
                self.res.touch_chain(plan.keys[:n])
            if self.st.disk is not None:
                self.st.disk.touch(plan.keys[:n], self.st.namespace_id)
        cat.unpin_many(plan.pinned)

    # -- prefetch / flush / stats -------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> Transfer[int]:
        """Read the leading held blocks of ``keys`` from disk into the warm tier ahead of need.

        Yields the number of leading blocks now held in memory.
        """
        ks = self.st.keys(keys)
        return self.fetch_keys(ks, self.st.chain_parent(keys), None, want_result=False)
