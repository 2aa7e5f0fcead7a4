"""Making room and evicting: LRU, demotion, leaf-first removal (prefix-closure), evict()."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.storeops import DISK, HOT, WARM
from kvstore.tiers.memory import MemoryTier


class RoomOps:
    """Eviction (mixin of :class:`kvstore.store.Store`)."""

    # -- room -----------------------------------------------------------------------------
    def _disk_run(self, ks: list[BlockKey]) -> int:
        """Leading ``ks`` already on disk (so a put need not keep them)."""
        if self._disk is None or not ks or self._held(ks[0]):
            return 0
        return self._disk.leading_run(ks, self.namespace_id)

    def _reserve(self, tier: MemoryTier, n: int) -> list[int]:
        """Up to ``n`` free slots of ``tier``, evicting or demoting LRU blocks as needed.

        Dirty blocks (not yet on disk) are never given up for room: when memory is full of
        them, a put sends its remaining blocks straight to disk (or drops and counts them).
        """
        slots = tier.allocate(n)
        while len(slots) < n and self._evict_one(tier):
            slots.extend(tier.allocate(n - len(slots)))
        return slots

    def _evict_one(self, tier: MemoryTier) -> bool:
        """Free one slot of ``tier``; False if no block can go.

        A victim (oldest first, never pinned) with a copy in the other memory tier just
        loses this copy; one that is on disk leaves memory; a hot block with no lower copy is
        demoted to warm; a block leaving the store must be a leaf (prefix-closure) and must
        not be waiting for the disk writer.
        """
        cat = self._catalog
        other_tier = self._warm if tier is self._hot else self._hot
        # live iteration: every branch that changes ``tier`` returns right after
        for key in tier.iter_lru():
            if cat.is_pinned(key):
                continue
            if (other_tier is not None and key in other_tier) or cat.on_disk(key):
                tier.remove(key)
                tier.counters.evictions += 1
                if not self._held(key):
                    cat.forget(key)  # still on disk
                return True
            if tier is self._hot and self._warm is not None and self._demote(key):
                return True
            if cat.has_children(key) or cat.is_dirty(key):
                continue
            tier.remove(key)
            tier.counters.evictions += 1
            cat.forget(key)
            return True
        return False

    def _demote(self, key: BlockKey) -> bool:
        hot, warm = self._hot, self._warm
        assert hot is not None and warm is not None
        self._catalog.pin(key)  # keep it in hot while warm makes room
        try:
            slots = self._reserve(warm, 1)
        finally:
            self._catalog.unpin(key)
        if not slots:
            return False
        warm.slab.data[slots[0]].copy_(hot.slab.data[hot.slot(key)])
        warm.insert(key, slots[0])
        warm.counters.demotions_in += 1
        hot.remove(key)
        hot.counters.evictions += 1
        return True

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
        ks = None if keys is None else self._keys(keys)
        with self._lock:
            self._check_open()
            cat = self._catalog
            if tier is None:
                targets = list(cat.keys()) if ks is None else [k for k in ks if k in cat]
                removed = set(self._remove_subtrees(targets))
                if self._disk is not None:
                    on_disk = self._namespace_disk_keys() if ks is None else ks
                    doomed = [k for k in on_disk if k not in cat]
                    if doomed:
                        # only this namespace's records: keys of another tenant stay
                        gone = self._disk_delete(doomed)
                        removed.update(gone)
                return len(removed)
            if tier == DISK:
                if self._disk is None:
                    return 0
                targets = self._namespace_disk_keys() if ks is None else ks
                doomed = [k for k in targets if not cat.is_pinned(k)]
                gone = self._disk_delete(doomed)
                for k in gone:
                    cat.clear_on_disk(k)
                return len(gone)
            t = self._hot if tier == HOT else self._warm
            if t is None:
                return 0
            other = self._warm if t is self._hot else self._hot
            count = 0
            for k in list(t.keys()) if ks is None else ks:
                if k not in t or cat.is_pinned(k):
                    continue
                if (other is not None and k in other) or cat.on_disk(k):
                    t.remove(k)
                    t.counters.evictions += 1
                    if not self._held(k):
                        cat.forget(k)
                    count += 1
                elif (t is self._hot and self._warm is not None and self._demote(k)) or (
                    self._remove_subtrees([k])
                ):
                    count += 1
            return count

    def _disk_delete(self, keys: list[BlockKey]) -> list[BlockKey]:
        """Delete this namespace's disk records of ``keys``; returns the keys that went."""
        assert self._disk is not None
        return [BlockKey(k) for k in self._disk.delete_owned(keys, self.namespace_id)]

    def _namespace_disk_keys(self) -> list[BlockKey]:
        assert self._disk is not None
        return [BlockKey(r.key) for r in self._disk.records(self.namespace_id)]

    def _remove_subtrees(self, roots: list[BlockKey]) -> list[BlockKey]:
        """Remove ``roots`` and their memory-held descendants from memory, leaves first."""
        cat = self._catalog
        removed: list[BlockKey] = []
        for root in roots:
            if root not in cat:
                continue
            for k in cat.descendants_postorder(root):
                if k not in cat or cat.is_pinned(k) or cat.has_children(k):
                    continue
                for t in (self._hot, self._warm):
                    if t is not None and k in t:
                        t.remove(k)
                        t.counters.evictions += 1
                if cat.is_dirty(k):
                    self._counters.dirty_dropped += 1
                cat.forget(k)
                removed.append(k)
        return removed
