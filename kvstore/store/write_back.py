"""The background writer's passes: dirty blocks and put overflow into disk segments."""

from __future__ import annotations

import logging

import torch

from kvstore.errors import DiskError
from kvstore.keys import BlockKey
from kvstore.store.put import OverflowJob
from kvstore.store.residency import Residency
from kvstore.store.state import StoreState
from kvstore.tiers.base import BlockWrite, LowerTier

log = logging.getLogger("kvstore.store")
#: how much the background writer puts into one segment
WRITE_BATCH_BYTES = 64 << 20


class WriteBack:
    """The background writer's passes: dirty blocks into disk segments (and the remote
    tier), put overflow straight to disk."""

    def __init__(self, st: StoreState, res: Residency) -> None:
        self.st = st
        self.res = res

    def write_pass(self) -> bool:
        """One batch of the background writer: overflow of a put straight to the durable
        tier, else dirty blocks into every lower tier (one disk segment, one remote pipeline)."""
        per_batch = max(1, WRITE_BATCH_BYTES // self.st.layout.block_nbytes)
        with self.st.lock:
            if self.st.closed or not self.st.lower:
                return False
            job = self.st.overflow.popleft() if self.st.overflow else None
        if job is not None:
            self.write_overflow(job)
            return True
        jobs = self.take_dirty(per_batch)
        if not jobs:
            return False
        cpu = [(k, p, d if d.device.type == "cpu" else d.to("cpu"), c) for k, p, d, c in jobs]
        ok = True
        for t, tier in enumerate(self.st.lower):
            items = [BlockWrite(k, p, d) for k, p, d, c in cpu if t < c]
            wrote = self.write_tier(tier, items)
            if not tier.volatile:  # the durable copy decides whether memory may let them go
                ok = ok and wrote
        with self.st.lock:
            cat = self.st.catalog
            for k, *_ in jobs:
                cat.unpin(k)
                if ok:
                    cat.set_on_disk(k)  # a lower copy exists (disk, or remote alone)
            if not ok:
                self.st.counters.disk_write_dropped += len(jobs)
        if ok:
            for tier in self.st.lower:
                try:
                    tier.evict(protect=lambda key: key in cat)
                except Exception:
                    log.exception("%s tier eviction failed", tier.name)
        return True

    def take_dirty(self, limit: int) -> list[tuple[BlockKey, BlockKey | None, torch.Tensor, int]]:
        """Up to ``limit`` dirty blocks, pinned, with their parent, bytes and how many lower
        tiers (from the first) should get them."""
        with self.st.lock:
            cat = self.st.catalog
            everywhere = len(self.st.lower)
            jobs = []
            for k in cat.take_dirty(limit):
                warm, hot = self.st.warm, self.st.hot
                if warm is not None and k in warm:
                    data = warm.slab.data[warm.slot(k)]
                elif hot is not None and k in hot:
                    data = hot.slab.data[hot.slot(k)]
                else:
                    continue
                cat.pin(k)
                jobs.append((k, cat.parent(k), data, self.st.came_from.pop(k, everywhere)))
            return jobs

    def write_tier(self, tier: LowerTier, items: list[BlockWrite]) -> bool:
        """``items`` into ``tier``; False (logged) if it failed."""
        if not items:
            return True
        try:
            tier.write(items)
            return True
        except DiskError as e:
            log.warning("%s tier write failed, %d blocks stay memory-only: %s",
                        tier.name, len(items), e)
        except Exception:
            log.exception("%s tier write failed unexpectedly; %d blocks stay memory-only",
                          tier.name, len(items))
        return False

    def write_overflow(self, job: OverflowJob) -> None:
        ok = False
        base = job.base
        if job.memory is not None:
            base = job.memory.wait()
        durable = self.st.durable
        try:
            assert durable is not None  # a put overflows only with a durable tier
            durable.write([
                BlockWrite(k, par,
                           job.kv[p].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
                for k, par, p in zip(job.keys, job.parents, job.positions, strict=True)
            ])
            ok = True
        except Exception as e:  # DiskError or worse: the blocks are lost, the engine is not
            log.warning("disk tier write failed, %d blocks of a put were dropped: %s",
                        len(job.keys), e)
        with self.st.lock:
            self.st.overflow_bytes -= len(job.keys) * self.st.layout.block_nbytes
            if not ok:
                self.st.counters.disk_write_dropped += len(job.keys)
        job.transfer.set_result(base + (len(job.keys) if ok else 0))
