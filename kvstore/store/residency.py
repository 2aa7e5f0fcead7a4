"""Where blocks are: the leading held run across tiers, LRU touches, making room (eviction,
demotion, leaf-first removal that keeps what is cached prefix-closed) and ``evict()``.

The store's catalog (links, pins, disk state) changes only through :class:`Residency`'s
methods: the other jobs read it, and ask here to link, pin, mark or forget a block."""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass
from itertools import islice, takewhile

import torch

from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.store.catalog import Catalog
from kvstore.store.state import DISK, HOT, WARM, StoreState
from kvstore.tiers.base import Located, LowerTier
from kvstore.tiers.memory import MemoryTier

#: what a lower tier located, as plain data: (first position, tier name, its handles)
Stretch = tuple[int, str, tuple[bytes, ...]]


def _all_bytes(items: Sequence[object]) -> bool:
    return set(map(type, items)) <= {bytes}


def _run_in(held: dict, ks: list[BlockKey], start: int) -> int:
    """How many of ``ks[start:]`` in a row are keys of ``held``."""
    if not held or start >= len(ks):
        return 0
    return len(list(takewhile(held.__contains__, islice(ks, start, None))))


@dataclass(slots=True)
class NewBlocks:
    """The blocks of a put that are new: their positions in the put and their parents."""

    positions: list[int]
    parents: list[BlockKey | None]
    duplicates: int  # already held, or twice in the put
    dropped: int  # cut off: their prefix is no longer cached


class Residency:
    """Which tier holds which block, and making room; every method expects ``st.lock`` held
    (``evict`` takes it)."""

    def __init__(self, st: StoreState) -> None:
        self.st = st

    def held(self, key: BlockKey) -> bool:
        """Held by a memory tier."""
        return (self.st.hot is not None and key in self.st.hot) or (
            self.st.warm is not None and key in self.st.warm
        )

    def leading_run(self, ks: list[BlockKey],
                    found: list[tuple[int, int, Located]] | None = None,
                    located: Sequence[Stretch] | None = None) -> int:
        """Leading ``ks`` held by memory or a lower tier, consulted in that order one stretch
        at a time (each lower tier answers a whole stretch in one call).

        Each stretch a lower tier holds goes into ``found`` as ``(start, tier index, what
        it located)``: a fetch reads those blocks with it, no second transaction.

        ``located``: what an earlier look (:meth:`placement`, maybe in another process) found
        below memory for these ``ks``; a stretch of it is taken without locating it again
        once the tier still holds its last block (:meth:`_recheck`).
        """
        i, n = 0, len(ks)
        hot = self.st.hot.slots if self.st.hot is not None else {}
        warm = self.st.warm.slots if self.st.warm is not None else {}
        lower = self.st.lower
        hints = self._hints(located, n) if located else None
        while i < n:
            # the hot loop of every lookup: stretches of dict probes run by C-level iterators
            m = 0
            while True:  # a chain may alternate between the memory tiers
                m += _run_in(warm, ks, i + m)
                in_hot = _run_in(hot, ks, i + m)
                if not in_hot:
                    break
                m += in_hot
            if m:
                i += m
                continue
            for t, tier in enumerate(lower):
                got = self._recheck(tier, hints.get(t), ks, i) if hints else None
                if got is None:
                    # a volatile tier (a round trip away) is asked only for what memory lacks
                    j = self.memory_gap(ks, i) if tier.volatile else n
                    got = tier.locate(ks[i:j])
                m = len(got)
                if m:
                    if found is not None:
                        found.append((i, t, got))
                    break
            if m == 0:
                break
            i += m
        return i

    def _hints(self, located: Sequence[Stretch], n: int) -> dict[int, list[Stretch]]:
        """``located`` by lower tier index; what does not fit (an unknown or volatile tier,
        a stretch past ``n``, handles that are not plain bytes) is left out: located again."""
        index = {t.name: i for i, t in enumerate(self.st.lower) if not t.volatile}
        hints: dict[int, list[Stretch]] = {}
        for item in located:
            try:
                start, name, handles = item
                t = index.get(name)
                ok = (t is not None and type(start) is int and start >= 0
                      and 0 < len(handles) <= n - start and _all_bytes(handles))
            except (TypeError, ValueError):
                continue
            if ok:
                hints.setdefault(t, []).append((start, name, tuple(handles)))  # type: ignore[arg-type]
        return hints

    @staticmethod
    def _recheck(tier: LowerTier, stretches: list[Stretch] | None, ks: list[BlockKey],
                 i: int) -> Located | None:
        """The hinted stretch of ``tier`` from ``i`` to its end, with the handles found
        earlier, if the tier still holds its last block: one lookup of one key instead of
        the stretch's. None: no hint covers ``i``, or the last block is gone (the stretch is
        then located again).

        Enough because blocks leave a lower tier after their descendants: eviction is leaf
        first, ``kvstore rm`` takes descendants, and damage a read found is found again by
        the next. A handle gone stale meanwhile (compaction moved the block) is the tier's to
        follow, and every read is verified against a checksum bound to its key: a stale
        handle is a miss or the block's own bytes, never another's. The one removal the
        check misses is ``Store.evict(keys)`` of a block whose descendants it keeps: such a
        block is read from its handle if its bytes are still there (its own, verified)."""
        for start, _name, handles in stretches or ():
            end = start + len(handles)
            if start <= i < end:
                last = tier.locate(ks[end - 1:end])
                if not len(last) or last.handles is None:
                    return None
                return Located(tuple(ks[i:end]), handles[i - start:-1] + last.handles)
        return None

    def memory_gap(self, ks: list[BlockKey], i: int) -> int:
        """The end of the stretch of ``ks`` from ``i`` that no memory tier holds."""
        j = i
        while j < len(ks) and not self.held(ks[j]):
            j += 1
        return j

    def lookup(self, ks: list[BlockKey],
               found: list[tuple[int, int, Located]] | None = None) -> int:
        """Leading ``ks`` held by any tier, counted as one lookup (takes the lock);
        ``found`` as :meth:`leading_run`'s."""
        with self.st.lock:
            self.st.check_open()
            n = self.leading_run(ks, found)
            self.st.counters.looked_up(len(ks), n)
            return n

    def placement(self, ks: list[BlockKey]) -> tuple[int, list[Stretch]]:
        """:meth:`lookup` that also returns what the lower tiers located, as plain data (a
        ``located`` for :meth:`leading_run`, maybe in another process): ``(start, tier name,
        handles)`` per stretch, for tiers whose handles are bytes (the disk's index records)."""
        found: list[tuple[int, int, Located]] = []
        lower = self.st.lower  # close() rebinds it to []: keep the list the lookup indexes
        n = self.lookup(ks, found)
        stretches: list[Stretch] = []
        for start, t, loc in found:
            hs = loc.handles
            if hs is not None and not lower[t].volatile and _all_bytes(hs):
                stretches.append((start, lower[t].name, tuple(hs)))  # type: ignore[arg-type]
        return n, stretches

    # -- the catalog: every change of it is one of these ------------------------------------
    def link(self, keys: Iterable[BlockKey], parents: Iterable[BlockKey | None]) -> None:
        """``keys`` enter the catalog under their parents (a put links its new blocks before
        making room: a parent with a child is never evicted as a leaf for its children)."""
        add = self.st.catalog.add
        for k, par in zip(keys, parents, strict=True):
            add(k, par)

    def unlink(self, keys: Sequence[BlockKey]) -> None:
        """``keys`` leave the catalog, last first (blocks that got no slot after all)."""
        forget = self.st.catalog.forget
        for k in reversed(keys):
            forget(k)

    def pin(self, keys: Iterable[BlockKey]) -> None:
        """One pin on each of ``keys``: not evicted, not taken by the writer, until unpinned."""
        self.st.catalog.pin_many(keys)

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        """Drop one pin from each of ``keys`` (those not pinned are skipped)."""
        self.st.catalog.unpin_many(keys)

    def unpin_one(self, key: BlockKey) -> bool:
        """Drop one pin from ``key``; False if it was not pinned."""
        return self.st.catalog.unpin(key)

    def stored(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` landed in memory by a put: dirty for the writer under ``"always"``."""
        if self.st.writer is not None and self.st.disk_admission.on_store:
            mark = self.st.catalog.mark_dirty
            for k in keys:
                mark(k)

    def used(self, keys: Iterable[BlockKey]) -> bool:
        """A fetch or lease uses ``keys`` (held in memory): under ``"second-hit"`` one used
        a second time becomes dirty for the writer. True if the admission counts uses."""
        if self.st.writer is None or not self.st.disk_admission.on_reuse:
            return False
        cat = self.st.catalog
        for k in keys:
            if cat.use(k) >= 2:
                cat.mark_dirty(k)
        return True

    def read_from_below(self, key: BlockKey, parent: BlockKey | None, tier: int) -> None:
        """``key`` joins memory from lower tier ``tier``: on disk already if that is the
        first lower tier; from one below it (another host's, via Redis) it is dirty, to be
        copied into the tiers above that one too."""
        cat = self.st.catalog
        if key in cat:
            return
        cat.add(key, parent)
        if tier > 0:
            cat.mark_dirty(key)
            self.st.came_from[key] = tier
        else:
            cat.set_on_disk(key)

    def take_dirty(self, limit: int) -> list[BlockKey]:
        """Up to ``limit`` blocks waiting for the writer, oldest first, off the dirty list.

        A block whose copy into memory is still in flight (a put, a demotion) stays on the
        list: its slot does not hold its bytes yet (second-hit admission can mark it dirty on
        a fetch before the copy lands); the copy's completion wakes the writer again."""
        cat = self.st.catalog
        keys = cat.take_dirty(limit)
        pending = self.st.pending
        if pending and any(k in pending for k in keys):
            for k in keys:
                if k in pending:
                    cat.mark_dirty(k)
            keys = [k for k in keys if k not in pending]
        return keys

    def written(self, keys: Iterable[BlockKey], ok: bool, reason: str | None = None) -> None:
        """The writer's pass over ``keys`` ended: unpinned, with a lower copy if ``ok``;
        if not, Durability keeps them for flush to report (``reason``) and retry."""
        cat = self.st.catalog
        ks = list(keys)
        for k in ks:
            cat.unpin(k)
            if ok:
                cat.set_on_disk(k)  # a lower copy exists (disk, or remote alone)
        if ok:  # on disk now: a refusal of an earlier write of theirs is settled
            self.st.durability.forget(ks)
        else:
            self.st.durability.failed(ks, cat, reason)

    def write_again(self, keys: Iterable[BlockKey]) -> None:
        """A put names ``keys`` again: those memory holds that no lower tier has and nothing
        is writing (their disk copy was evicted with ``evict(tier="disk")``, which keeps
        memory's) are dirty again, so the put stores them anew, as the evict promises. Before,
        such a put was a no-op duplicate and the next flush vouched for blocks not on disk."""
        if self.st.writer is None or not self.st.disk_admission.on_store:
            return
        cat, refused = self.st.catalog, self.st.durability.unwritten  # those: the next flush
        for k in keys:
            if (k in cat and not cat.on_disk(k) and not cat.is_dirty(k) and not cat.is_pinned(k)
                    and k not in refused):
                cat.mark_dirty(k)

    def stop_writing(self, keys: Iterable[BlockKey] | None) -> None:
        """``keys`` (None: every block) in memory stop waiting for the writer, pinned ones
        aside (a pinned block keeps its disk copy and its write)."""
        cat = self.st.catalog
        for k in list(cat.keys()) if keys is None else keys:
            if cat.is_pinned(k):
                continue
            cat.discard_dirty(k)
            self.st.came_from.pop(k, None)

    def retry_unwritten(self) -> int:
        """Blocks the disk refused that memory still holds are dirty again (flush, close)."""
        return self.st.durability.retry(self.st.catalog)

    def clear(self) -> None:
        """The store closed: the catalog is empty."""
        self.st.catalog = Catalog()

    def touch_chain(self, keys: list[BlockKey]) -> None:
        # leaf first, root last: roots are the newest, so LRU meets leaves first
        rev = keys[::-1]
        for tier in (self.st.hot, self.st.warm):
            if tier is not None:
                tier.touch(rev)

    # -- room -----------------------------------------------------------------------------
    def disk_run(self, ks: list[BlockKey]) -> int:
        """Leading ``ks`` already in the durable lower tier (so a put need not keep them)."""
        durable = self.st.durable
        if durable is None or not ks or self.held(ks[0]):
            return 0
        return len(durable.locate(ks))

    def new_blocks(self, ks: list[BlockKey], parent: BlockKey | None,
                   skip: Set[BlockKey] = frozenset()) -> NewBlocks:
        """Which of ``ks`` a put stores: not held (in memory, in the leading disk run, or in
        ``skip``), not twice, and hanging off a cached parent; it stops at the first block
        whose prefix is no longer cached (``lookup`` could never reach it)."""
        on_disk = self.disk_run(ks)
        out = NewBlocks([], [], 0, 0)
        seen: set[BlockKey] = set()  # a key twice in one put must not take two slots
        prev = parent
        for i, k in enumerate(ks):
            if i < on_disk or self.held(k) or k in skip or k in seen:
                out.duplicates += 1
            elif (prev is None or self.held(prev) or prev in skip
                  or (out.positions and ks[out.positions[-1]] == prev) or (i and i - 1 < on_disk)
                  or (i == 0 and self.st.durable is not None and self.disk_run([prev]) == 1)):
                out.positions.append(i)
                out.parents.append(prev)
                seen.add(k)
            else:
                out.dropped = len(ks) - i
                break
            prev = k
        return out

    def reserve(self, tier: MemoryTier, n: int) -> list[int]:
        """Up to ``n`` free slots of ``tier``, evicting or demoting LRU blocks as needed.

        Dirty blocks (not yet on disk) are never given up for room: when memory is full of
        them, a put sends its remaining blocks straight to disk (or drops and counts them).
        """
        slots = tier.allocate(n)
        while len(slots) < n and self.evict_one(tier):
            slots.extend(tier.allocate(n - len(slots)))
        return slots

    def evict_one(self, tier: MemoryTier) -> bool:
        """Free one slot of ``tier``; False if no block can go.

        A victim (in the tier's eviction order, never pinned) with a copy in the other memory
        tier just loses this copy; one that is on disk leaves memory; a hot block with no lower
        copy is demoted to warm; a block leaving the store must be a leaf (prefix-closure) and
        must not be waiting for the disk writer.
        """
        first = tier.policy.peek()  # most evictions take the best victim: no iterator
        if first is None:
            return False
        if self._free(tier, first):
            return True
        # live iteration in the tier's eviction order: the first change of ``tier`` ends it
        return any(key is not first and self._free(tier, key) for key in tier.iter_victims())

    def _free(self, tier: MemoryTier, key: BlockKey) -> bool:
        """Free ``key``'s slot of ``tier`` if it may go (see :meth:`evict_one`)."""
        cat = self.st.catalog
        if cat.is_pinned(key):
            return False
        other_tier = self.st.warm if tier is self.st.hot else self.st.hot
        if (other_tier is not None and key in other_tier) or cat.on_disk(key):
            tier.remove(key, for_room=True)
            tier.counters.evictions += 1
            self.st.announce_removed(tier.name, [key])
            if not self.held(key):
                cat.forget(key)  # still on disk
            return True
        if tier is self.st.hot and self.st.warm is not None and self.demote(key):
            return True
        if cat.has_children(key) or cat.is_dirty(key):
            return False
        tier.remove(key, for_room=True)
        tier.counters.evictions += 1
        self.st.announce_removed(tier.name, [key])
        cat.forget(key)
        self.st.durability.left_memory(key)  # a block the disk refused is gone now
        return True

    def demote(self, key: BlockKey) -> bool:
        """Move hot block ``key`` into a warm slot, freeing its hot slot now.

        With streams (CUDA) the copy is only enqueued here, on the copy engine's ``d2h``
        stream (:meth:`_demote_async`): the lock is held for the enqueue, never across the
        copy, and the caller's stream is not used. Without streams, one block's host copy.
        """
        hot, warm = self.st.hot, self.st.warm
        assert hot is not None and warm is not None
        self.st.catalog.pin(key)  # keep it in hot while warm makes room
        try:
            slots = self.reserve(warm, 1)
        finally:
            self.st.catalog.unpin(key)
        if not slots:
            return False
        src, dst = hot.slot(key), slots[0]
        eng = self.st.engine
        if eng is not None and eng.streams is not None:
            self._demote_async(key, hot.slab.data[src : src + 1], warm.slab.data[dst : dst + 1])
        else:
            warm.slab.data[dst].copy_(hot.slab.data[src])
        warm.insert(key, dst)
        warm.counters.demotions_in += 1
        self.st.announce_stored(warm.name, [key])
        hot.remove(key, for_room=True)
        hot.counters.evictions += 1
        self.st.announce_removed(hot.name, [key])
        return True

    def _demote_async(self, key: BlockKey, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Enqueue the hot -> warm copy of ``key`` on the ``d2h`` stream (kvstore.streams).

        Before: the hot slot's earlier writers and readers are done (it was unpinned: their
        events were seen complete), as are the warm slot's. After: the freed hot slot's next
        writer is a put on this same stream (behind the copy) or a promotion on ``h2d``, which
        waits on the copy's event, enqueued now; the warm copy stays pinned (no eviction, no
        writer) and pending (a fetch waits for its transfer) until the ``d2h`` worker sees
        the event complete. A copy that fails drops the block (its hot copy is gone).
        """
        from kvstore.errors import StoreClosedError
        from kvstore.store.copy_engine import Job
        from kvstore.streams import host_wait
        from kvstore.transfer import Transfer

        eng = self.st.engine
        assert eng is not None and eng.streams is not None
        streams = eng.streams
        d2h, h2d = eng.stream("d2h"), eng.stream("h2d")
        assert d2h is not None and h2d is not None
        with streams.use(d2h):
            streams.access(d2h, reads=[src], writes=[dst], what="demotion")
            dst.copy_(src, non_blocking=True)
            done = d2h.record_event()
        h2d.wait_event(done)
        t: Transfer[int] = Transfer()
        cat = self.st.catalog
        cat.pin(key)
        self.st.pending[key] = t
        dirty = cat.is_dirty(key)
        if dirty:  # the writer reads the warm slot on the host: not before the copy lands
            cat.discard_dirty(key)

        def settle(ok: bool) -> None:  # under the lock
            if self.st.pending.get(key) is t:
                del self.st.pending[key]
            cat.unpin(key)
            if self.st.closed or key not in cat:
                return
            if ok:
                if dirty:
                    cat.mark_dirty(key)
                return
            warm = self.st.warm
            if warm is not None and key in warm:  # its bytes may be partial: never visible
                warm.remove(key)
                self.st.announce_removed(warm.name, [key])
            if not self.held(key):
                if dirty:
                    self.st.counters.dirty_dropped += 1
                cat.forget(key)

        def finish(ok: bool, error: BaseException | None) -> None:
            with self.st.lock:
                settle(ok)
            t.set_result(1 if ok else 0)  # a fetch planned on it stops before a failed one

        try:
            eng.submit("d2h", Job(t, lambda stream: [done], finish))
        except StoreClosedError:  # the engine is closing: settle here
            try:
                host_wait(done, what="a demotion")
                ok = True
            except Exception:
                ok = False
            settle(ok)
            t.set_result(1 if ok else 0)

    # -- evict ----------------------------------------------------------------------------
    def evict(self, keys: Sequence[bytes] | None = None, *, tier: str | None = None) -> int:
        """Evict ``keys`` (default: every unpinned block) and return how many left.

        ``tier=None`` removes the blocks from the store (memory and disk), together with their
        descendants held in memory, so what remains stays prefix-closed. ``tier="hot"`` /
        ``"warm"`` frees only that tier: a block with no copy elsewhere is demoted
        (hot -> warm) where there is room, else removed like ``tier=None``. ``tier="disk"``
        deletes only the disk copies. Pinned blocks (and so their ancestors) stay.
        """
        if tier not in (None, HOT, WARM, DISK):
            raise ConfigError(f"tier must be None, 'hot', 'warm' or 'disk', got {tier!r}")
        ks = None if keys is None else self.st.keys(keys)
        with self.st.lock:
            self.st.check_open()
            cat = self.st.catalog
            if tier is None:
                targets = list(cat.keys()) if ks is None else [k for k in ks if k in cat]
                removed = set(self.remove_subtrees(targets))
                for low in self.st.lower:
                    if not low.volatile:
                        # what memory still holds stays (pinned, or an ancestor of a pin)
                        gone = [BlockKey(k) for k in low.delete(ks, keep=cat.__contains__)]
                        self.st.announce_removed(low.name, gone)
                        removed.update(gone)
                return len(removed)
            if tier == DISK:
                low = self.lower_named(DISK)
                if low is None:
                    return 0
                gone = [BlockKey(k) for k in low.delete(ks, keep=cat.is_pinned)]
                for k in gone:
                    cat.clear_on_disk(k)
                self.st.announce_removed(low.name, gone)
                return len(gone)
            t = self.st.hot if tier == HOT else self.st.warm
            if t is None:
                return 0
            other = self.st.warm if t is self.st.hot else self.st.hot
            count = 0
            for k in list(t.keys()) if ks is None else ks:
                if k not in t or cat.is_pinned(k):
                    continue
                if (other is not None and k in other) or cat.on_disk(k):
                    t.remove(k)
                    t.counters.evictions += 1
                    self.st.announce_removed(t.name, [k])
                    if not self.held(k):
                        cat.forget(k)
                    count += 1
                elif t is self.st.hot and self.st.warm is not None and self.demote(k):
                    count += 1
                else:  # the block and its descendants leave: each counts
                    count += len(self.remove_subtrees([k]))
            return count

    def lower_named(self, name: str) -> LowerTier | None:
        for t in self.st.lower:
            if t.name == name:
                return t
        return None

    def remove_subtrees(self, roots: list[BlockKey]) -> list[BlockKey]:
        """Remove ``roots`` and their memory-held descendants from memory, leaves first."""
        cat = self.st.catalog
        removed: list[BlockKey] = []
        for root in roots:
            if root not in cat:
                continue
            for k in cat.descendants_postorder(root):
                if k not in cat or cat.is_pinned(k) or cat.has_children(k):
                    continue
                for t in (self.st.hot, self.st.warm):
                    if t is not None and k in t:
                        t.remove(k)
                        t.counters.evictions += 1
                        self.st.announce_removed(t.name, [k])
                if cat.is_dirty(k):
                    self.st.counters.dirty_dropped += 1
                cat.forget(k)
                removed.append(k)
        self.st.durability.forget(removed)  # evicted on purpose: not flush's to report
        return removed
