"""``Store``: the embedded store's public API, delegating each job to the module named for
it (residency, fetch, put, paged, write_back, zero_copy) over one
:class:`~kvstore.store.state.StoreState`."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvstore.api import BorrowedBlocks, PinReceipt, PutGrant
from kvstore.errors import CloseTimeoutError, KVStoreError
from kvstore.hints import PutHint
from kvstore.keys import BlockKey, KeyChain
from kvstore.keys import block_keys as _block_keys
from kvstore.layout import KVLayout
from kvstore.stats import StoreStats, TierStats
from kvstore.store.config import StoreConfig
from kvstore.store.fetch import Fetcher
from kvstore.store.lifetime import track, untrack
from kvstore.store.opening import open_state
from kvstore.store.paged import PagedIO
from kvstore.store.put import Putter
from kvstore.store.residency import Residency
from kvstore.store.write_back import WriteBack
from kvstore.store.writer import WriteBehind
from kvstore.store.zero_copy import LeaseInto, ZeroCopyPlane
from kvstore.transfer import Transfer

if TYPE_CHECKING:
    from kvstore.events.sink import EventSink

log = logging.getLogger("kvstore.store")

#: how long :meth:`Store.close` waits for its last writes to disk by default
DEFAULT_CLOSE_TIMEOUT_S = 30.0


class Store:
    """A tiered KV prefix cache for one model namespace. Create with :func:`open_store`.

    Each job lives in the module named for it; this class wires them together and holds the
    small calls: keys, lookup, pins, flush, stats, lifecycle.
    """

    PutGrant = PutGrant

    def __init__(self, config: StoreConfig, *, events: EventSink | None = None) -> None:
        self.config = config
        self.namespace = config.namespace
        self.layout: KVLayout = config.namespace.layout
        self.namespace_id: bytes = config.namespace.id
        self.device = config.device
        self._closed_event: threading.Event | None = None  # set once closed (begin_close)
        self._close_error: BaseException | None = None
        self.state = st = open_state(config)
        st.events = events
        self.residency = Residency(st)
        self.fetcher = Fetcher(st, self.residency)
        self.putter = Putter(st, self.residency)
        self.paged = PagedIO(st, self.fetcher, self.putter)
        self.write_back = WriteBack(st, self.residency)
        self.zero_copy = ZeroCopyPlane(st, self.residency, self.fetcher)
        if st.lower:
            st.writer = WriteBehind(self.write_back.write_pass, name="kvstore-writer")
        track(self)  # closed (drained, flushed) at interpreter exit if still open

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float | None = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Flush and release every tier. Idempotent; any later call raises StoreClosedError.

        Waits at most ``timeout`` seconds (None: as long as it takes) for the last writes to
        disk, then raises :class:`~kvstore.errors.CloseTimeoutError`: another process holding
        the disk index's write lock (an engine stopped with SIGSTOP mid-commit) never hangs
        ``close`` or the interpreter's exit. What an earlier ``flush()`` returned for is on
        disk either way; the close goes on in the background (the store takes no new calls).
        """
        done = self.begin_close()
        if not done.wait(timeout):
            raise self._close_timed_out(timeout)
        error, self._close_error = self._close_error, None
        if error is not None:
            raise error

    def begin_close(self) -> threading.Event:
        """Start closing (on a thread of its own) and return the event set once closed;
        :meth:`close` waits for it. Stores left open at exit are all started at once."""
        st = self.state
        with st.lock:
            if self._closed_event is not None:
                return self._closed_event
            self._closed_event = done = threading.Event()
            if st.closed or st.forked():
                # a forked child's copy: the threads, files and memory are the parent's to
                # flush and release (its dirty blocks written twice, its shared slab removed)
                st.closed = True
                done.set()
            else:
                st.closing = True  # new calls now fail; what is queued still completes
        untrack(self)
        if done.is_set():
            return done
        try:
            threading.Thread(target=self._close_now, args=(done,), name="kvstore-close",
                             daemon=True).start()
        except RuntimeError:  # no new threads (the interpreter is finalizing): close here
            self._close_now(done)
        return done

    def _close_now(self, done: threading.Event) -> None:
        try:
            self._release()
        except BaseException as e:  # raised by close() in the caller's thread
            self._close_error = e
        finally:
            done.set()

    def _release(self) -> None:
        st = self.state
        if st.engine is not None:
            st.engine.close()  # queued copies complete first
        if st.writer is not None:
            with st.lock:  # blocks the disk refused before get one last try
                self.residency.retry_unwritten()
            st.writer.close()  # drains what is dirty: close() implies flush()
            with st.lock:
                error = st.durability.report()
            if error is not None:
                log.error("closing the store at %s: %s", self.config.path, error)
        with st.lock:
            if st.closed:
                return
            st.closed = True
            for t in st.lower:
                t.close()
            if st.warm is not None:
                st.warm.slab.close()
            if st.events is not None:  # the memory tiers are gone; the disk stays
                for name in ("hot", "warm"):
                    st.events.cleared(name)
            st.hot = st.warm = None
            st.lower = []
            self.residency.clear()

    def _close_timed_out(self, timeout: float | None) -> CloseTimeoutError:
        st = self.state
        pending = None
        if st.lock.acquire(timeout=1.0):  # never wait on a lock the stuck close may hold
            try:
                pending = st.catalog.dirty_count + st.catalog.pinned_count
            finally:
                st.lock.release()
        index = os.path.join(str(self.config.path), "index", "lock.mdb")
        what = "some" if pending is None else f"up to {pending}"
        log.error("closing the store at %s did not finish within %s s", self.config.path,
                  timeout)
        return CloseTimeoutError(
            f"closing the store at {self.config.path} did not finish within {timeout} s: its "
            f"last writes to disk are waiting, most likely for the disk index's write lock, "
            f"which another process holds (an engine stopped with SIGSTOP or hung in a "
            f"commit; `fuser -v {index}` names it). What earlier flush() calls returned for "
            f"is on disk; {what} block(s) put since may not be. Resume or stop that process, "
            f"or pass close(timeout=...) a longer wait (None: no limit); the close goes on in "
            f"the background meanwhile", blocks=pending or 0, path=str(self.config.path))

    @property
    def warm_free_slots(self) -> int:
        """Free slots of the warm tier (0 without one): for leak accounting."""
        with self.state.lock:
            warm = self.state.warm
            return 0 if warm is None else warm.slab.allocator.free_count

    @property
    def closed(self) -> bool:
        return self.state.closed

    # -- keys and lookup ----------------------------------------------------------------
    def block_keys(self, token_ids: object, salt: str | bytes | None = None, *,
                   extras: Sequence[bytes | None] | None = None) -> KeyChain:
        """Keys of every full block of ``token_ids`` (``list`` of 32-byte ``bytes``)."""
        self.state.check_open()
        return _block_keys(self.namespace_id, token_ids, self.layout.block_tokens, salt=salt,
                           extras=extras)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` held by any tier (a miss is 0, not an exception)."""
        return self.residency.lookup(self.state.keys(keys))

    # -- data -----------------------------------------------------------------------------
    def fetch(self, keys: Sequence[bytes], *,
              out: torch.Tensor | None = None) -> Transfer[torch.Tensor]:
        """Copy the leading held blocks of ``keys`` to the store's device (or into ``out``).

        The result ``[n, L, P, T, H, D]`` has ``n <= len(keys)`` blocks: the run stops at the
        first miss or damaged block (damage is counted, never raised). Blocks read from disk
        land in the warm tier; blocks served from a lower tier are promoted into hot.
        """
        return self.fetcher.fetch(keys, out=out)

    def prefetch(self, keys: Sequence[bytes]) -> Transfer[int]:
        """Read the leading held blocks of ``keys`` from disk into the warm tier ahead of
        need; yields the number of leading blocks now held in memory."""
        return self.fetcher.prefetch(keys)

    def put(self, keys: Sequence[bytes], kv: torch.Tensor,
            hint: PutHint | None = None) -> Transfer[int]:
        """Store ``kv`` (``[len(keys), L, P, T, H, D]``) under ``keys``; held keys are skipped.

        Validation is synchronous (raises before anything is queued); the copy completes
        through the returned :class:`Transfer`, whose result is the number of blocks stored.
        ``kv`` must not be modified until the transfer is done. ``hint``
        (:class:`~kvstore.hints.PutHint`): the request's session and priority, for where the
        new blocks start in the memory tiers' eviction order (never what is stored).
        """
        return self.putter.put(keys, kv, hint)

    def load_into(self, keys: Sequence[bytes], pages: Sequence[object], block_ids: object, *,
                  page_size: int | None = None) -> Transfer[int]:
        """Scatter the leading held blocks of ``keys`` into an engine's paged KV cache
        (see :meth:`kvstore.store.paged.PagedIO.load_into`)."""
        return self.paged.load_into(keys, pages, block_ids, page_size=page_size)

    def save_from(self, pages: Sequence[object], block_ids: object, keys: Sequence[bytes], *,
                  page_size: int | None = None, hint: PutHint | None = None) -> Transfer[int]:
        """Gather the blocks for ``keys`` out of an engine's paged KV cache and ``put`` them
        (``hint`` as :meth:`put`'s)."""
        return self.paged.save_from(pages, block_ids, keys, page_size=page_size, hint=hint)

    def evict(self, keys: Sequence[bytes] | None = None, *, tier: str | None = None) -> int:
        """Evict ``keys`` (default: every unpinned block) and return how many left
        (see :meth:`kvstore.store.residency.Residency.evict`).

        An evict from the store (``tier=None``) or from the disk (``tier="disk"``) wins over
        every write of the same keys still in flight: the put copies are waited for, what is
        staged for disk is committed and deleted, the keys leave the overflow queue, so once
        this returns nothing writes them back (a later ``put`` does, as a new block)."""
        st = self.state
        if tier not in (None, "disk") or st.writer is None:
            return self.residency.evict(keys, tier=tier)
        ks = None if keys is None else st.keys(keys)
        wanted = None if ks is None else set(ks)
        with st.lock:
            st.check_open()
            copies = {id(t): t for k, t in st.pending.items() if wanted is None or k in wanted}
        for t in copies.values():  # a put's copy in flight: its blocks become evictable
            with contextlib.suppress(KVStoreError):  # a failed copy stored nothing
                t.wait()
        with self.write_back.pass_lock:  # no writer pass in flight from here on
            queued = self.write_back.revoke(wanted, memory=tier == "disk")
            return queued + self.residency.evict(ks, tier=tier)

    # -- zero copy (kvstore.api.ZeroCopy) -------------------------------------------------
    def borrow_blocks(self, keys: Sequence[bytes]) -> BorrowedBlocks:
        """Pin the leading run of ``keys`` held in memory and return it in place."""
        return self.zero_copy.borrow_blocks(keys)

    def lease_warm(self, keys: Sequence[bytes]) -> tuple[list[BlockKey], list[int]]:
        """Pin the leading held run of ``keys`` in the warm tier; returns it with its slots."""
        return self.zero_copy.lease_warm(keys)

    def lease_into(self, keys: Sequence[bytes],
                   into: Callable[[int], Sequence[torch.Tensor | memoryview]], *,
                   fill: bool = True) -> LeaseInto:
        """:meth:`lease_warm` that reads blocks only on disk straight into ``into(i)`` (the
        host buffers taking block ``i``'s bytes in order, e.g. one engine page per layer),
        verified; blocks held in memory come back as pinned warm slots to copy
        (:class:`~kvstore.store.zero_copy.LeaseInto`). Embedded stores only."""
        return self.zero_copy.lease_into(keys, into, fill=fill)

    def release_lease(self, keys: Sequence[bytes]) -> None:
        self.zero_copy.release_lease(keys)

    def grant_put(self, keys: Sequence[bytes], hint: PutHint | None = None) -> PutGrant:
        """Reserve warm slots for the blocks of ``keys`` not held yet (nothing visible yet);
        ``hint`` as :meth:`put`'s."""
        return self.zero_copy.grant_put(keys, hint)

    def commit_put(self, grant: PutGrant) -> int:
        return self.zero_copy.commit_put(grant)

    def abort_put(self, grant: PutGrant) -> None:
        self.zero_copy.abort_put(grant)

    @property
    def warm_slab(self) -> torch.Tensor | None:
        """The warm tier's ``[slots, block_nbytes]`` bytes (for the daemon's shared memory)."""
        return self.zero_copy.warm_slab

    def lookup_split(self, keys: list[BlockKey]) -> int:
        """:meth:`lookup` of keys already known to be 32-byte ``bytes`` (the daemon)."""
        return self.zero_copy.lookup_split(keys)

    def count_lookups(self, lookups: int, hits: int, misses: int) -> None:
        """Add lookups answered elsewhere (clients probing the daemon's key directory)."""
        self.zero_copy.count_lookups(lookups, hits, misses)

    # -- pins -----------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> PinReceipt:
        """Pin the leading held ``keys`` so they are not evicted; returns a receipt.

        Use as a context manager or call ``receipt.release()`` (or ``store.unpin(keys)``).
        """
        st = self.state
        ks = st.keys(keys)
        with st.lock:
            st.check_open()
            pinned: list[BlockKey] = []
            for k in ks:
                if not self.residency.held(k):
                    break
                pinned.append(k)
            self.residency.pin(pinned)
            return PinReceipt(self.unpin, pinned)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop one pin from each of ``keys``; returns how many were pinned."""
        st = self.state
        ks = st.keys(keys)
        with st.lock:
            if st.closed:
                return 0
            return sum(1 for k in ks if self.residency.unpin_one(k))

    # -- flush / stats ------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Return once every earlier ``put``/``fetch`` copy has landed and every earlier ``put``
        is durable on disk (where there is a disk tier).

        Raises :class:`~kvstore.errors.NotDurableError` (``.blocks``, ``.reason``) when the
        disk could not write some of them (disk full, I/O error); those still in memory are
        served and written again by the next ``flush``.

        Blocks that were evicted from memory before the writer reached them are not waited
        for: they are counted in ``stats().dirty_dropped``.
        """
        st = self.state
        st.check_open()
        if st.engine is not None and not st.engine.drain(timeout):
            raise TimeoutError(f"flush did not finish within {timeout} s (copies in flight)")
        if st.writer is None:
            return
        with st.lock:  # blocks the disk refused before: write them again
            self.residency.retry_unwritten()
            ticket = st.catalog.stamp  # every block and overflow job stamped up to here
        if not st.writer.flush(timeout, ticket):
            raise TimeoutError(f"flush did not finish within {timeout} s")
        with st.lock:
            error = st.durability.report()
        if error is not None:
            raise error

    def stats(self) -> StoreStats:
        """A frozen snapshot of the counters and the tiers' occupancy."""
        st = self.state
        with st.lock:
            st.check_open()
            c = st.counters
            tiers = [
                TierStats(name=t.name, device=str(t.device), capacity_bytes=t.slab.nbytes,
                          used_bytes=t.used_bytes, blocks=len(t), evictions=t.counters.evictions,
                          demotions_in=t.counters.demotions_in,
                          promotions_in=t.counters.promotions_in, policy=t.policy.name,
                          policy_state=t.policy.state())
                for t in (st.hot, st.warm) if t is not None
            ]
            tiers += [t.stats() for t in st.lower]
            bn = self.layout.block_nbytes
            tiers = [replace(t, hits=c.served.get(t.name, 0), hit_bytes=c.served.get(t.name, 0) * bn)
                     for t in tiers]
            return StoreStats(
                lookups=c.lookups, hits=c.hits, misses=c.misses, fetches=c.fetches,
                fetched_blocks=c.fetched_blocks, fetch_short=c.fetch_short, puts=c.puts,
                put_blocks=c.put_blocks, put_duplicates=c.put_duplicates,
                put_dropped=c.put_dropped, damaged=c.damaged, read_misses=c.read_misses,
                dirty_dropped=c.dirty_dropped,
                disk_write_dropped=c.disk_write_dropped,
                pinned_blocks=st.catalog.pinned_count, blocks=len(st.catalog),
                dirty_blocks=st.catalog.dirty_count,
                block_nbytes=self.layout.block_nbytes, tiers=tuple(tiers),
            )
