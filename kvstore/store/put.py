"""put: validation, slot reservation across tiers, the asynchronous copy, overflow to disk."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.hints import PutHint, check_hint
from kvstore.keys import BlockKey
from kvstore.store.copy_engine import Job, copy_done
from kvstore.store.residency import Residency
from kvstore.store.state import StoreState
from kvstore.streams import Event, Handoff, Stream, Streams, begin_copy, handoff, host_wait
from kvstore.tiers.memory import MemoryTier
from kvstore.transfer import Transfer
from kvstore.validate import check_kv

log = logging.getLogger("kvstore.store")
#: puts that find memory full of not-yet-written blocks may queue this much for disk
OVERFLOW_BYTES = 256 << 20


@dataclass(slots=True)
class OverflowJob:
    """Blocks of one put that go from the caller's tensor straight to disk."""

    keys: list[BlockKey]
    parents: list[BlockKey | None]
    kv: torch.Tensor
    positions: list[int]  # rows of kv
    transfer: Transfer[int]
    memory: Transfer[int] | None  # the same put's copy into memory, if any
    base: int  # blocks of the same put stored in memory
    ready: Event | None = None  # recorded on the caller's stream after kv was produced
    streams: Streams | None = None
    stamp: int = 0  # the catalog's stamp when it was queued (flush waits for it)

    def host_bytes(self, i: int) -> torch.Tensor:
        """Block ``positions[i]`` of ``kv`` as host bytes, for the writer thread: after the
        work that produced ``kv`` on the caller's stream (bounded wait; raises
        :class:`~kvstore.errors.TransferError`), never before (kvstore.streams, rule 1)."""
        host_wait(self.ready, what="the work that produced a put's kv")
        row = self.kv[self.positions[i]]
        if self.streams is not None:
            self.streams.access(None, reads=[row], what="put overflow")
        return row.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


class Putter:
    """``put``: validation, slot reservation across tiers, the copy, overflow to disk."""

    def __init__(self, st: StoreState, res: Residency) -> None:
        self.st = st
        self.res = res

    # -- put ------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], kv: torch.Tensor,
            hint: PutHint | None = None) -> Transfer[int]:
        """Store ``kv`` (``[len(keys), L, P, T, H, D]``) under ``keys``; held keys are skipped.

        Validation is synchronous (raises before anything is queued); the copy completes
        through the returned :class:`Transfer`, whose result is the number of blocks stored.
        ``kv`` must not be modified until the transfer is done. ``hint``: where the new blocks
        start in the memory tiers' eviction order (:class:`~kvstore.hints.PutHint`).
        """
        ks = self.st.keys(keys)
        self.check_kv(kv, len(ks))
        check_hint(hint)
        parent = self.st.chain_parent(keys)
        with self.st.lock:
            self.st.check_open()
            start = self.st.hints.start(hint, ks, parent, self.res.held)
            return self.put_locked(ks, parent, kv, start)

    def check_kv(self, kv: torch.Tensor, n: int) -> None:
        check_kv(self.st.layout, self.st.device, kv, n)

    def put_locked(
        self, ks: list[BlockKey], parent: BlockKey | None, kv: torch.Tensor, start: int = 0
    ) -> Transfer[int]:
        c = self.st.counters
        new = self.res.new_blocks(ks, parent)
        new_pos, new_parents = new.positions, new.parents
        c.put_called(new.duplicates, new.dropped)
        if new.duplicates:
            self.res.write_again(ks)
        self.res.touch_chain(ks)
        if not new_pos:
            return Transfer.completed(0)
        # Link every new block to its parent first: a parent with a child may be demoted but
        # is never evicted as a leaf to make room for its own children.
        self.res.link([ks[p] for p in new_pos], new_parents)
        writes: list[tuple[MemoryTier, list[int], list[int]]] = []  # (tier, positions, slots)
        rest = new_pos
        for tier in (self.st.hot, self.st.warm):
            if tier is None or not rest:
                continue
            slots = self.res.reserve(tier, len(rest))
            if slots:
                writes.append((tier, rest[: len(slots)], slots))
                rest = rest[len(slots) :]
        stored = len(new_pos) - len(rest)
        overflow_ok = (
            rest and self.st.durable is not None
            and self.st.overflow_bytes + len(rest) * self.st.layout.block_nbytes <= OVERFLOW_BYTES
        )
        self.res.unlink([ks[p] for p in rest])  # not in memory: the catalog tracks memory only
        written: list[BlockKey] = []
        for tier, pos, slots in writes:
            for p, s in zip(pos, slots, strict=True):
                k = ks[p]
                tier.insert(k, s, start=start)
                written.append(k)
            self.st.announce_stored(tier.name, [ks[p] for p in pos])
        self.res.pin(written)  # pending until the copy lands: not evicted, not read by the writer
        if written:
            # the whole chain again, leaf first, now with its new blocks: inserted root-first,
            # a chain's root would be its oldest block and every eviction would walk past all
            # its descendants to reach the leaf (a full 100,000-block tier took 1.4-4 s per
            # 1,024-block put that way, 5-9 ms now)
            self.res.touch_chain(ks)
        c.put_blocks += stored
        mem: Transfer[int] | None = None
        streams = self.st.engine.streams if self.st.engine is not None else None
        ready = handoff(streams, kv)  # after the work that produced kv (kvstore.streams)
        if writes:
            mem = self.submit_copy(kv, writes, written, stored, ready)
            for k in written:
                self.st.pending[k] = mem
        if overflow_ok:
            # memory is full of blocks that may not go yet: the rest goes straight to disk
            # from the caller's tensor (which must stay unmodified until the put is done)
            overflow: Transfer[int] = Transfer()
            self.st.overflow.append(OverflowJob(
                [ks[p] for p in rest], [new_parents[new_pos.index(p)] for p in rest], kv, rest,
                overflow, mem, stored, ready.ready, streams, self.st.catalog.next_stamp(),
            ))
            self.st.overflow_bytes += len(rest) * self.st.layout.block_nbytes
            c.put_blocks += len(rest)
            if self.st.writer is not None:
                self.st.writer.notify()
            return overflow
        c.put_dropped += len(rest)
        return mem if mem is not None else Transfer.completed(0)

    def submit_copy(
        self, kv: torch.Tensor, writes: list[tuple[MemoryTier, list[int], list[int]]],
        written: list[BlockKey], stored: int, ready: Handoff,
    ) -> Transfer[int]:
        assert self.st.engine is not None
        streams = self.st.engine.streams

        def run(stream: Stream | None) -> list:
            begin_copy(streams, ready, stream)  # wait for the producer of kv
            src = kv.reshape(kv.shape[0], -1).view(torch.uint8) if kv.is_contiguous() else None
            for tier, pos, slots in writes:
                if streams is not None:
                    streams.access(stream, reads=[kv[p] for p in pos],
                                   writes=[tier.slab.data[s] for s in slots], what="put")
                if src is not None and pos[-1] - pos[0] == len(pos) - 1:
                    tier.slab.write(slots, src[pos[0] : pos[-1] + 1], non_blocking=stream is not None)
                else:
                    for p, s in zip(pos, slots, strict=True):
                        tier.slab.block(s).copy_(kv[p], non_blocking=stream is not None)
            return copy_done(stream)

        def finish(ok: bool, error: BaseException | None) -> None:
            with self.st.lock:
                self.finish_copy(written, ok)
            if ok:
                t.set_result(stored)
            else:
                log.warning("a put's copy failed; its %d blocks were not stored: %s", stored, error)
                t.set_result(0)  # a failed copy is a miss later, not an error for the engine
            if ok and self.st.writer is not None:
                self.st.writer.notify()

        t: Transfer[int] = Transfer()
        # puts have a path (and stream) of their own: a step's loads never queue behind the
        # last step's saves; a fetch of a block still copying waits for it (FetchPlan.deps)
        return self.st.engine.submit("d2h", Job(t, run, finish))

    def finish_copy(self, written: list[BlockKey], ok: bool) -> None:
        cat = self.st.catalog
        for k in written:
            self.st.pending.pop(k, None)
        self.res.unpin(written)
        if self.st.closed:
            return
        if ok:
            self.res.stored(written)
            return
        # Nothing of a failed copy may be visible: drop its blocks even if a fetch pinned them
        # meanwhile (such a fetch depends on this put and stops before them). Blocks of later
        # puts chained onto them become unreachable leaves and age out.
        dropped = 0
        for k in reversed(written):
            if k not in cat:
                continue
            for t in (self.st.hot, self.st.warm):
                if t is not None and k in t:
                    t.remove(k)
                    self.st.announce_removed(t.name, [k])
            self.res.unlink((k,))
            dropped += 1
        self.st.counters.put_blocks -= dropped
        self.st.counters.put_dropped += dropped
