"""The background writer's passes: dirty blocks and put overflow into disk segments."""

from __future__ import annotations

import logging

import torch

from kvstore.keys import BlockKey
from kvstore.store.put import OverflowJob
from kvstore.store.residency import Residency
from kvstore.store.state import StoreState

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
        """One batch of the background writer: dirty blocks -> one disk segment, and the
        remote tier when there is one."""
        disk, remote = self.st.disk, self.st.remote
        per_batch = max(1, WRITE_BATCH_BYTES // self.st.layout.block_nbytes)
        with self.st.lock:
            if self.st.closed or (disk is None and remote is None):
                return False
            job = self.st.overflow.popleft() if self.st.overflow else None
        if job is not None:
            self.write_overflow(disk, job)
            return True
        with self.st.lock:
            cat = self.st.catalog
            batch = cat.take_dirty(per_batch)
            if not batch:
                return False
            jobs: list[tuple[BlockKey, BlockKey | None, torch.Tensor, bool]] = []
            for k in batch:
                warm, hot = self.st.warm, self.st.hot
                if warm is not None and k in warm:
                    data = warm.slab.data[warm.slot(k)]
                elif hot is not None and k in hot:
                    data = hot.slab.data[hot.slot(k)]
                else:
                    continue
                cat.pin(k)
                skip_remote = k in self.st.skip_remote
                self.st.skip_remote.discard(k)
                jobs.append((k, cat.parent(k), data, skip_remote))
        cpu = [(k, p, d if d.device.type == "cpu" else d.to("cpu"), sr) for k, p, d, sr in jobs]
        ok = self.write_disk_batch(disk, cpu) if disk is not None else True
        if remote is not None:
            self.write_remote_batch(remote, [(k, d) for k, _, d, sr in cpu if not sr])
        with self.st.lock:
            for k, *_ in jobs:
                self.st.catalog.unpin(k)
                if ok:
                    self.st.catalog.set_on_disk(k)  # a lower copy exists (disk, or remote alone)
            if not ok:
                self.st.counters.disk_write_dropped += len(jobs)
            cat = self.st.catalog
        if ok and disk is not None:
            try:
                disk.evict_to_budget(protect=lambda key: key in cat)
            except Exception:
                log.exception("disk tier eviction failed")
        return True

    def write_disk_batch(self, disk, jobs: list) -> bool:
        from kvstore.errors import DiskError
        from kvstore.tiers.disk import DiskWrite

        try:
            disk.write_blocks([DiskWrite(k, p, self.st.namespace_id, d) for k, p, d, _ in jobs])
            return True
        except DiskError as e:
            log.warning("disk tier write failed, %d blocks stay memory-only: %s", len(jobs), e)
        except Exception:
            log.exception("disk tier write failed unexpectedly; %d blocks stay memory-only", len(jobs))
        return False

    def write_remote_batch(self, remote, items: list[tuple[BlockKey, torch.Tensor]]) -> None:
        from kvstore.tiers.remote import RemoteWrite

        if not items:
            return
        try:  # failures are counted by the remote tier; the engine never sees them
            remote.write_blocks([RemoteWrite(k, self.st.namespace_id, d, self.st.layout.itemsize)
                                 for k, d in items])
        except Exception:
            log.exception("remote tier write failed")

    def write_overflow(self, disk, job: OverflowJob) -> None:
        from kvstore.tiers.disk import DiskWrite

        ok = False
        base = job.base
        if job.memory is not None:
            base = job.memory.wait()
        try:
            items = [
                DiskWrite(k, par, self.st.namespace_id,
                          job.kv[p].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
                for k, par, p in zip(job.keys, job.parents, job.positions, strict=True)
            ]
            disk.write_blocks(items)
            ok = True
        except Exception as e:  # DiskError or worse: the blocks are lost, the engine is not
            log.warning("disk tier write failed, %d blocks of a put were dropped: %s",
                        len(job.keys), e)
        with self.st.lock:
            self.st.overflow_bytes -= len(job.keys) * self.st.layout.block_nbytes
            if not ok:
                self.st.counters.disk_write_dropped += len(job.keys)
        job.transfer.set_result(base + (len(job.keys) if ok else 0))
