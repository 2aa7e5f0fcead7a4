"""The zero-copy data plane: leases on warm slots and granted puts (the sidecar daemon's
shared memory), and borrowed blocks (a pinned in-place view, no fetch copy)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore.api import BorrowedBlocks, PutGrant
from kvstore.errors import ConfigError, StoreClosedError
from kvstore.hints import PutHint, check_hint
from kvstore.keys import BlockKey
from kvstore.store.copy_engine import Job
from kvstore.store.fetch import Fetcher, FetchPlan
from kvstore.store.residency import Residency, Stretch
from kvstore.store.state import StoreState
from kvstore.tiers.slab import paired_runs
from kvstore.transfer import Transfer

log = logging.getLogger("kvstore.store")


@dataclass(frozen=True, slots=True)
class LeaseInto:
    """What :meth:`ZeroCopyPlane.lease_into` placed: the leading ``n`` blocks. Those at
    ``copies`` ((position, warm slot), in order) are held in memory and left to the caller
    to copy, pinned until :meth:`ZeroCopyPlane.release_lease` of ``pinned``; the others were
    read and verified straight into their destinations."""

    n: int
    pinned: tuple[BlockKey, ...]
    copies: tuple[tuple[int, int], ...]


class ZeroCopyPlane:
    """Blocks read and written in place in the store's memory: warm-slot leases and granted
    puts (the daemon's shared-memory data plane), borrowed blocks (a pinned view instead of a
    fetch copy). The store is a :class:`kvstore.api.ZeroCopy` through this."""

    def __init__(self, st: StoreState, res: Residency, fetcher: Fetcher) -> None:
        self.st = st
        self.res = res
        self.fetcher = fetcher
        # granted puts not yet committed or aborted, by identity: a grant is used once, and
        # only in the store that made it (its slots are this store's); one committed or
        # aborted before, or another store's, would map keys onto slots that may hold other
        # blocks by now
        self.grants: dict[int, PutGrant] = {}

    # -- shared-memory data plane (used by the sidecar daemon) -------------------------------
    def lookup_split(self, keys: list[BlockKey]) -> int:
        """:meth:`lookup` for keys the daemon split from one wire blob: each is known to be a
        32-byte ``bytes``, so the per-key type checks are skipped (the 1,024-key round trip
        is latency-critical)."""
        return self.res.lookup(keys)

    def count_lookups(self, lookups: int, hits: int, misses: int) -> None:
        """Add lookups answered elsewhere (the daemon's clients probe its key directory
        themselves) to this store's counters."""
        with self.st.lock:
            self.st.counters.looked_up(hits + misses, hits, calls=lookups)

    def lease_warm(self, keys: Sequence[bytes]) -> tuple[list[BlockKey], list[int]]:
        """Pin the leading held run of ``keys`` *in the warm tier* and return it with its slots.

        Blocks only on disk are read into the warm tier first. The caller reads the slots
        (e.g. through a shared-memory mapping of the warm slab) and must then call
        :meth:`release_lease` with the returned keys. The run may be shorter than a lookup
        said (damage, or no room to stage a block).
        """
        ks = self.st.keys(keys)
        self.st.check_open()  # a closed store has no warm tier either: say it is closed
        if self.st.warm is None:
            raise ConfigError("leases need a warm tier (cpu_capacity > 0)")
        t, plan, _ = self.fetcher.submit(ks, self.st.chain_parent(keys), None, want_result=False)
        t.wait()
        with self.st.lock:
            self.st.check_open()
            warm = self.st.warm
            got: list[BlockKey] = []
            slots: list[int] = []
            for k in ks:
                if k not in warm or k in self.st.pending:
                    break
                got.append(k)
                slots.append(warm.slot(k))
            self.res.pin(got)
            warm.touch(reversed(got))
            self._count_lease(plan, len(ks), len(got))
            return got, slots

    def _count_lease(self, plan: FetchPlan, asked: int, n: int) -> None:
        """A lease counts as a fetch of its ``n`` leading blocks (under the lock)."""
        self.st.counters.fetched(asked, n)
        self.fetcher.count_served(plan, n)

    def lease_into(self, keys: Sequence[bytes],
                   into: Callable[[int], Sequence[torch.Tensor | memoryview]],
                   *, fill: bool = True, located: Sequence[Stretch] | None = None) -> LeaseInto:
        """:meth:`lease_warm` that reads blocks only on disk straight into the caller's memory.

        ``into(i)`` gives the writable host buffers (CPU uint8 tensors or byte memoryviews)
        that take block ``i``'s bytes in order, e.g. one engine page per layer: one iovec
        each in the block's ``preadv``, verified by the reading threads like any read. Their
        warm copies are read afterwards, behind the caller's back (as ``fetch`` does), unless
        ``fill`` is False (they then stay on disk only: a caller whose cores are all busy
        right after the load, like a CPU engine's forward, would pay for that read). Blocks
        held in memory come back as warm slots for the caller to copy, pinned. The run may
        be shorter than a lookup said (damage, a put still copying); a destination past it
        may have been written. With a volatile tier (Redis) in the plan this is
        :meth:`lease_warm` (its blocks come back as slots).

        ``located``: what :meth:`placement` found below memory for these ``keys`` (maybe in
        another process, a while ago). A stretch of it is read with the handles found then
        once the tier still holds the stretch's last block (one key looked up, not the
        stretch: a tier evicts leaf first), else located again; every block read is verified
        against the checksum bound to its key, so a stale handle gives a miss or the block's
        own bytes, never another's (:meth:`Residency.leading_run`).
        """
        ks = self.st.keys(keys)
        self.st.check_open()  # a closed store has no warm tier either: say it is closed
        if self.st.warm is None:
            raise ConfigError("leases need a warm tier (cpu_capacity > 0)")
        parent = self.st.chain_parent(keys)
        with self.st.lock:
            self.st.check_open()
            # without fill, no warm slot is reserved: nothing in warm is evicted for copies
            # that will not be made
            plan = self.fetcher.plan(ks, parent, want_result=True, warm_copies=fill,
                                     located=located)
            if any(self.st.lower[plan.tier_of(p)].volatile for p, _ in plan.lower):
                self.fetcher.release_plan(plan, ok=False)
                plan = None
        if plan is None:
            got, slots = self.lease_warm(keys)
            return LeaseInto(len(got), tuple(got), tuple(enumerate(slots)))
        job = self.fetcher.job(plan, len(ks))
        try:
            if plan.lower:  # without fill they have no warm slot: nothing is copied later
                self.fetcher.read_into(plan, into)
            lease = self._pin_into(plan, ks)
        except BaseException:
            with self.st.lock:
                self.fetcher.release_plan(plan, ok=False)
            raise
        job.settle_direct(True)
        return lease

    def _pin_into(self, plan: FetchPlan, ks: list[BlockKey]) -> LeaseInto:
        """Cut the run at the first block neither read nor held in warm (a put still copying,
        a hot-only block), pin the held ones for the caller, count the fetch."""
        with self.st.lock:
            self.st.check_open()
            read = {p for p, _ in plan.lower}
            in_warm = dict(plan.warm)
            pending = self.st.pending
            copies: list[tuple[int, int]] = []
            n = plan.valid
            for i in range(plan.valid):
                if i in read:
                    continue
                s = in_warm.get(i)
                if s is None or (pending and ks[i] in pending):
                    n = i
                    break
                copies.append((i, s))
            plan.valid = n
            copies = [(i, s) for i, s in copies if i < n]
            pinned = [ks[i] for i, _ in copies]
            self.res.pin(pinned)
            self._count_lease(plan, len(ks), n)
            return LeaseInto(n, tuple(pinned), tuple(copies))

    def placement(self, keys: Sequence[bytes]) -> tuple[int, list[Stretch]]:
        """:meth:`~kvstore.store.Store.lookup` that also returns what the lower tiers located
        for the run, as plain data to hand to :meth:`lease_into` later (the vLLM connector's
        scheduler finds the blocks, its worker loads them): ``(n, [(first position, tier
        name, handles), ...])``, the stretches of tiers whose handles are bytes (the disk's
        index records)."""
        return self.res.placement(self.st.keys(keys))

    def memory_run(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` a memory tier (hot or warm) holds now: what a load can
        copy without reading a lower tier (the vLLM connector loads a hit held in memory
        synchronously and one that must come from below asynchronously)."""
        ks = self.st.keys(keys)
        with self.st.lock:
            self.st.check_open()
            n = 0
            for k in ks:
                if not self.res.held(k):
                    break
                n += 1
            return n

    def release_lease(self, keys: Sequence[bytes]) -> None:
        """Release what :meth:`lease_warm` pinned."""
        with self.st.lock:
            self.res.unpin(BlockKey(bytes(k)) for k in keys)

    def grant_put(self, keys: Sequence[bytes], hint: PutHint | None = None) -> PutGrant:
        """Reserve warm slots for the blocks of ``keys`` not held yet (nothing visible yet).

        Fill ``grant.slots`` with the blocks at ``grant.positions``, then call
        :meth:`commit_put` (or :meth:`abort_put`). Blocks that find no room are left out.
        ``hint``: as :meth:`~kvstore.store.put.Putter.put`'s.
        """
        ks = self.st.keys(keys)
        check_hint(hint)
        parent = self.st.chain_parent(keys)
        self.st.check_open()
        if self.st.warm is None:
            raise ConfigError("granted puts need a warm tier (cpu_capacity > 0)")
        with self.st.lock:
            self.st.check_open()
            c = self.st.counters
            # granted keys count as held: their blocks are being written by another process
            new = self.res.new_blocks(ks, parent, self.st.granted)
            grant = PutGrant([ks[p] for p in new.positions], new.parents, new.positions, [],
                             new.duplicates, self.st.hints.start(hint, ks, parent, self.res.held))
            c.put_called(grant.duplicates, new.dropped)
            self.res.link(grant.keys, grant.parents)  # protects the parents while we make room
            slots = self.res.reserve(self.st.warm, len(grant.keys)) if grant.keys else []
            self.res.unlink(grant.keys[len(slots):])
            c.put_dropped += len(grant.keys) - len(slots)
            del grant.keys[len(slots):], grant.parents[len(slots):], grant.positions[len(slots):]
            grant.slots = slots
            self.st.granted.update(grant.keys)
            self.res.pin(grant.keys)
            self.grants[id(grant)] = grant
            return grant

    def commit_put(self, grant: PutGrant) -> int:
        """Publish a granted put whose slots were filled; returns the blocks stored (0 for a
        grant already committed or aborted, or made by another store: nothing is published)."""
        with self.st.lock:
            if self.st.closed:
                return 0
            if not self._take_grant(grant):
                log.warning("commit_put of a grant this store does not hold (committed or "
                            "aborted already, or another store's): nothing stored")
                return 0
            warm = self.st.warm
            assert warm is not None
            for k, s in zip(grant.keys, grant.slots, strict=True):
                self.st.granted.discard(k)
                warm.insert(k, s, start=grant.start)
            self.res.unpin(grant.keys)
            self.res.stored(grant.keys)
            self.st.counters.put_blocks += len(grant.keys)
            self.st.announce_stored("warm", grant.keys)
            self.res.touch_chain(grant.keys)
        if grant.keys and self.st.writer is not None:
            self.st.writer.notify()
        return len(grant.keys)

    def abort_put(self, grant: PutGrant) -> None:
        """Give back a granted put's slots (a client died mid-put): nothing becomes visible.
        A grant already committed or aborted, or another store's, is left alone."""
        with self.st.lock:
            if self.st.closed or not self._take_grant(grant):
                return
            warm, cat = self.st.warm, self.st.catalog
            assert warm is not None
            self.res.unpin(grant.keys)
            self.res.unlink([k for k in grant.keys if k in cat and not self.res.held(k)][::-1])
            for k, s in zip(grant.keys, grant.slots, strict=True):
                self.st.granted.discard(k)
                warm.release(s)
            self.st.counters.put_dropped += len(grant.keys)

    def _take_grant(self, grant: PutGrant) -> bool:
        """Whether ``grant`` is this store's and still open; it is not any more (under lock)."""
        held = self.grants.get(id(grant))
        if held is None or held is not grant:
            return False
        del self.grants[id(grant)]
        return True

    @property
    def warm_slab(self) -> torch.Tensor | None:
        """The warm tier's ``[slots, block_nbytes]`` bytes (for the daemon's shared memory)."""
        return None if self.st.warm is None else self.st.warm.slab.data

    # -- borrowed blocks ----------------------------------------------------------------
    def borrow_blocks(self, keys: Sequence[bytes]) -> BorrowedBlocks:
        """Pin the leading run of ``keys`` held in memory on the store's device and return it
        in place (see :class:`BorrowedBlocks`). Blocks elsewhere (disk, another device, a put
        still copying) end the run: ``fetch`` the rest. A miss is an empty result."""
        ks = self.st.keys(keys)
        lay = self.st.layout
        tiers = [t for t in (self.st.hot, self.st.warm)
                 if t is not None and t.slab.data.device == self.st.device]
        with self.st.lock:
            self.st.check_open()
            where: list[tuple[int, int]] = []  # (tier index, slot)
            pending = self.st.pending
            for k in ks:
                if pending and k in pending:
                    break
                for ti, t in enumerate(tiers):
                    s = t.slots.get(k)
                    if s is not None:
                        where.append((ti, s))
                        break
                else:
                    break
            got = ks[: len(where)]
            self.res.pin(got)
            self.res.touch_chain(got)
            self.st.counters.fetched(len(ks), len(got))
        n = len(got)
        try:
            zero_copy = n > 0 and all(ti == where[0][0] for ti, _ in where) and all(
                s == where[0][1] + i for i, (_, s) in enumerate(where))
            if zero_copy:
                first = where[0][1]
                rows = tiers[where[0][0]].slab.data[first : first + n]
                blocks = rows.view(lay.dtype).view(lay.batch_shape(n))
            elif n == 0:
                blocks = torch.empty(lay.batch_shape(0), dtype=lay.dtype, device=self.st.device)
            else:
                blocks = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device=self.st.device)
                flat = blocks.view(n, -1).view(torch.uint8)
                for ti, t in enumerate(tiers):
                    mine = [(p, s) for p, (tj, s) in enumerate(where) if tj == ti]
                    for d, s, m in paired_runs(mine):
                        flat[d : d + m].copy_(t.slab.data[s : s + m])
        except BaseException:
            self.unpin_borrowed(got)
            raise
        return BorrowedBlocks(blocks, got, zero_copy, self.unpin_borrowed)

    def unpin_borrowed(self, keys: list[BlockKey]) -> None:
        """Release borrowed blocks. With streams, their slots stay pinned until the work the
        caller queued on its stream so far (kernels still reading the view) has completed: an
        event recorded now, awaited by the copy engine, then the unpin (kvstore.streams)."""
        eng = self.st.engine
        if keys and eng is not None and eng.streams is not None:
            done = eng.streams.event()
            done.record(eng.streams.current())
            t: Transfer[int] = Transfer()

            def unpin(ok: bool, error: BaseException | None) -> None:
                self._unpin(keys)  # also when the event failed: never pinned for ever
                t.set_result(len(keys))

            try:
                eng.submit("h2d", Job(t, lambda stream: [done], unpin))
                return
            except StoreClosedError:
                pass
        self._unpin(keys)

    def _unpin(self, keys: list[BlockKey]) -> None:
        with self.st.lock:
            if not self.st.closed:
                self.res.unpin(keys)
