"""The background writer's passes: dirty blocks and put overflow into disk segments.

The durable tier's writes are staged (:class:`~kvstore.tiers.base.StagedWrites`): each pass
writes one segment's bytes (the device starts writing them at once) and the pass that finds
nothing more to do commits every staged segment together: one fsync per file, one directory
fsync, one index commit. Staging the next batch overlaps the device writing the last one, and
``flush`` still returns only once every block put before it is durable: it waits for such an
idle pass or, while puts go on, for the pass after which nothing stamped before it waits
(:meth:`WriteBack._progress`). A commit also happens once :data:`COMMIT_BYTES` (or a quarter of the warm
tier, whose slots stay pinned until then) is staged, or the oldest staged batch is
:data:`COMMIT_AGE_S` old.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from kvstore.errors import DiskError
from kvstore.keys import BlockKey
from kvstore.store.put import OverflowJob
from kvstore.store.residency import Residency
from kvstore.store.state import StoreState
from kvstore.tiers.base import BlockWrite, LowerTier, StagedWrites

log = logging.getLogger("kvstore.store")
#: how much the background writer puts into one segment
WRITE_BATCH_BYTES = 64 << 20
#: staged bytes that make the writer commit without waiting to drain
COMMIT_BYTES = 1 << 30
#: staged batches older than this are committed (visible and durable) without waiting to drain
COMMIT_AGE_S = 2.0

Job = tuple[BlockKey, BlockKey | None, torch.Tensor, int]


@dataclass(slots=True)
class Staged:
    """What the durable tier holds staged: its batches and the (pinned) blocks they carry."""

    batches: list[object] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    nbytes: int = 0
    since: float = 0.0


class WriteBack:
    """The background writer's passes: dirty blocks into disk segments (and the remote
    tier), put overflow straight to disk."""

    def __init__(self, st: StoreState, res: Residency) -> None:
        self.st = st
        self.res = res
        self.staged = Staged()  # touched only by the writer's thread (or under ``pass_lock``)
        # held for a whole pass: an evict takes it to see no write of its keys in flight
        self.pass_lock = threading.Lock()

    def write_pass(self) -> bool:
        """One batch of the background writer: overflow of a put straight to the durable
        tier, else dirty blocks into every lower tier (one disk segment, one remote pipeline).
        Returns False, with everything staged committed, once there is nothing more."""
        with self.pass_lock:
            more = self._write_pass()
            if more:
                self._progress()
            return more

    def _progress(self) -> None:
        """A flush waits for a stamp (the catalog's when it was called): once no block or
        overflow job stamped up to it still waits, commit what is staged and report how far
        every stamp is settled (durable, or refused and kept for flush to report). Without
        this, a flush under puts that never pause waited for a pass with nothing left to
        do, which never came."""
        writer = self.st.writer
        ticket = writer.waiting() if writer is not None else None
        if ticket is None:
            return
        with self.st.lock:
            cat, overflow = self.st.catalog, self.st.overflow
            waiting = [s for s in (cat.oldest_dirty_stamp(), overflow[0].stamp if overflow else None)
                       if s is not None]
            done = min(waiting) - 1 if waiting else cat.stamp
        if done >= ticket:
            self.commit()
            assert writer is not None
            writer.reached(done)

    def revoke(self, keys: set[BlockKey] | None, *, memory: bool) -> int:
        """No write of ``keys`` (None: of any block) may land after this returns.

        The caller holds :attr:`pass_lock`, so no pass is running: what is staged is
        committed now (the evict that follows deletes it from the index), the keys leave the
        overflow queue, and with ``memory`` their copies in memory stop being dirty (an evict
        of the disk copies only: memory keeps them, the disk does not get them back).
        Returns how many blocks left the overflow queue."""
        self.commit()
        st = self.st
        dropped = 0
        with st.lock:
            for job in st.overflow:
                keep = [i for i, k in enumerate(job.keys) if keys is not None and k not in keys]
                if len(keep) == len(job.keys):
                    continue
                dropped += len(job.keys) - len(keep)
                st.overflow_bytes -= (len(job.keys) - len(keep)) * st.layout.block_nbytes
                job.keys = [job.keys[i] for i in keep]
                job.parents = [job.parents[i] for i in keep]
                job.positions = [job.positions[i] for i in keep]
            if memory:  # a pinned block keeps its disk copy (and its write)
                self.res.stop_writing(keys)
                # nor does the next flush's retry of what the disk refused write them back
                st.durability.forget(list(st.durability.unwritten) if keys is None else keys)
        return dropped

    def _write_pass(self) -> bool:
        per_batch = max(1, WRITE_BATCH_BYTES // self.st.layout.block_nbytes)
        with self.st.lock:
            if self.st.closed or not self.st.lower:
                return False
            # the older of the two queues first: overflow always first starved the dirty
            # blocks (and every flush) while puts kept overflowing
            ov, oldest = self.st.overflow, self.st.catalog.oldest_dirty_stamp()
            job = ov.popleft() if ov and (oldest is None or ov[0].stamp < oldest) else None
        if job is not None:
            self.write_overflow(job)
            return True
        jobs = self.take_dirty(per_batch)
        if not jobs:  # none, or all still being copied into memory: overflow may wait
            with self.st.lock:
                job = self.st.overflow.popleft() if self.st.overflow else None
            if job is not None:
                self.write_overflow(job)
                return True
            self.commit()
            return False
        try:
            cpu = [(k, p, d if d.device.type == "cpu" else d.to("cpu"), c) for k, p, d, c in jobs]
        except Exception as e:  # a device error (CUDA's is sticky after a faulting copy)
            log.exception("copying %d dirty blocks off the device failed; they stay "
                          "memory-only", len(jobs))
            self.settle(jobs, why(e))  # unpinned, and flush does not vouch for them
            return True
        durable = self.st.durable
        error: str | None = None  # the durable copy decides whether memory may let them go
        staged = False
        for t, tier in enumerate(self.st.lower):
            items = [BlockWrite(k, p, d) for k, p, d, c in cpu if t < c]
            if tier is durable and isinstance(tier, StagedWrites) and items:
                error = self.stage(tier, items, jobs)
                staged = error is None
                continue
            failed = self.write_tier(tier, items)
            if not tier.volatile and error is None:
                error = failed
        if not staged:  # written (or failed) already: settle now
            self.settle(jobs, error)
        if self.commit_due():
            self.commit()
        return True

    def stage(self, tier: StagedWrites, items: list[BlockWrite], jobs: list[Job]) -> str | None:
        """Stage ``items`` on the durable tier; their blocks settle at the commit. Returns
        why it failed, or None."""
        try:
            batch = tier.stage(items)
        except Exception as e:  # DiskError or worse: these blocks stay memory-only
            log.warning("disk tier write failed, %d blocks stay memory-only: %s", len(items), e)
            return str(e)
        s = self.staged
        if not s.batches:
            s.since = time.monotonic()
        s.batches.append(batch)
        s.jobs.extend(jobs)
        s.nbytes += len(items) * self.st.layout.block_nbytes
        return None

    def commit_due(self) -> bool:
        s = self.staged
        if not s.batches:
            return False
        warm = self.st.warm
        limit = COMMIT_BYTES if warm is None else min(COMMIT_BYTES, warm.slab.nbytes // 4)
        return s.nbytes >= limit or time.monotonic() - s.since >= COMMIT_AGE_S

    def commit(self) -> None:
        """Commit everything staged on the durable tier, then settle its blocks."""
        s, self.staged = self.staged, Staged()
        if not s.batches:
            return
        tier = self.st.durable
        error = None
        try:
            assert isinstance(tier, StagedWrites)
            tier.commit(s.batches)
        except DiskError as e:
            log.warning("disk tier write failed, %d blocks stay memory-only: %s", len(s.jobs), e)
            error = why(e)
        except Exception as e:
            log.exception("disk tier write failed unexpectedly; %d blocks stay memory-only",
                          len(s.jobs))
            error = why(e)
        self.settle(s.jobs, error)

    def settle(self, jobs: list[Job], error: str | None) -> None:
        """Unpin written blocks; with a durable copy made (``error`` None), memory may let
        them go; otherwise Durability keeps ``error`` for flush to report."""
        ok = error is None
        with self.st.lock:
            self.res.written([j[0] for j in jobs], ok, error)
            if not ok:
                self.st.counters.disk_write_dropped += len(jobs)
            if ok and self.st.durable is not None:
                self.st.announce_stored(self.st.durable.name, [j[0] for j in jobs],
                                        [j[1] for j in jobs])
        if ok:
            self.trim()

    def trim(self) -> None:
        """Bring every lower tier within its budget after a write (never a block memory
        holds: its copy there may be the only durable one soon)."""
        cat = self.st.catalog
        for tier in self.st.lower:
            try:
                gone = tier.evict(protect=lambda key: key in cat)
                if gone:
                    with self.st.lock:
                        self.st.announce_removed(tier.name, gone)
            except Exception:
                log.exception("%s tier eviction failed", tier.name)

    def take_dirty(self, limit: int) -> list[Job]:
        """Up to ``limit`` dirty blocks, pinned, with their parent, bytes and how many lower
        tiers (from the first) should get them."""
        with self.st.lock:
            cat = self.st.catalog
            everywhere = len(self.st.lower)
            jobs = []
            for k in self.res.take_dirty(limit):
                warm, hot = self.st.warm, self.st.hot
                if warm is not None and k in warm:
                    data = warm.slab.data[warm.slot(k)]
                elif hot is not None and k in hot:
                    data = hot.slab.data[hot.slot(k)]
                else:
                    continue
                self.res.pin((k,))
                jobs.append((k, cat.parent(k), data, self.st.came_from.pop(k, everywhere)))
            return jobs

    def write_tier(self, tier: LowerTier, items: list[BlockWrite]) -> str | None:
        """``items`` into ``tier``; why it failed (logged), or None."""
        if not items:
            return None
        try:
            tier.write(items)
            return None
        except DiskError as e:
            log.warning("%s tier write failed, %d blocks stay memory-only: %s",
                        tier.name, len(items), e)
            return why(e)
        except Exception as e:
            log.exception("%s tier write failed unexpectedly; %d blocks stay memory-only",
                          tier.name, len(items))
            return why(e)

    def write_overflow(self, job: OverflowJob) -> None:
        ok = False
        base = job.base
        if job.memory is not None:
            base = job.memory.wait()
        if not job.keys:  # every block of it was evicted before the writer got to it
            job.transfer.set_result(base)
            return
        durable = self.st.durable
        failure = ""
        try:
            assert durable is not None  # a put overflows only with a durable tier
            durable.write([  # host_bytes: after the work that produced kv (kvstore.streams)
                BlockWrite(k, par, job.host_bytes(i))
                for i, (k, par) in enumerate(zip(job.keys, job.parents, strict=True))
            ])
            ok = True
        except Exception as e:  # DiskError or worse: the blocks are lost, the engine is not
            log.warning("disk tier write failed, %d blocks of a put were dropped: %s",
                        len(job.keys), e)
            failure = str(e)
        with self.st.lock:
            self.st.overflow_bytes -= len(job.keys) * self.st.layout.block_nbytes
            if not ok:
                self.st.counters.disk_write_dropped += len(job.keys)
                self.st.durability.dropped(len(job.keys), failure)
            elif durable is not None:
                self.st.announce_stored(durable.name, job.keys, job.parents)
        if ok:  # as after any write: overflow alone kept the disk over its budget for good
            self.trim()
        job.transfer.set_result(base + (len(job.keys) if ok else 0))


def why(e: BaseException) -> str:
    """A failed write's cause, as flush's NotDurableError states it."""
    return str(e) if isinstance(e, DiskError) else f"unexpected {type(e).__name__}: {e}"
