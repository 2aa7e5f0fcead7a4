"""Memory tiers: a slab, a key -> slot map and LRU order over the blocks it holds."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.tiers.slab import Slab


@dataclass(slots=True)
class TierCounters:
    evictions: int = 0  # blocks that left this tier to make room or on request
    demotions_in: int = 0  # blocks copied in from the tier above
    promotions_in: int = 0  # blocks copied in from a tier below


class MemoryTier:
    """One memory tier (``hot`` on the engine's device, ``warm`` in host memory).

    Not thread-safe: the store serialises access under its lock.
    """

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        capacity_bytes: int,
        device: torch.device,
        *,
        pin_memory: bool = False,
        shared_path: str | None = None,
        prefault: bool = False,
    ) -> None:
        self.name = name
        self.layout = layout
        self.device = device
        self.slab = Slab(layout, capacity_bytes, device, pin_memory=pin_memory,
                         shared_path=shared_path, prefault=prefault)
        self.capacity_bytes = capacity_bytes
        self._slots: dict[BlockKey, int] = {}
        # oldest first; the store touches a chain leaf-to-root so roots stay newest
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()
        self.counters = TierCounters()

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def used_bytes(self) -> int:
        return len(self._slots) * self.layout.block_nbytes

    def slot(self, key: BlockKey) -> int:
        return self._slots[key]

    def keys(self) -> Iterator[BlockKey]:
        return iter(self._slots)

    def lru_order(self) -> list[BlockKey]:
        """Keys oldest first (a snapshot, safe to mutate the tier while iterating it)."""
        return list(self._lru)

    def iter_lru(self) -> Iterator[BlockKey]:
        """Keys oldest first, live: the tier must not change before the iteration ends (a
        snapshot of a 100,000-block tier per eviction made a full tier's puts quadratic)."""
        return iter(self._lru)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Mark ``keys`` used now, in order (the last one becomes the newest)."""
        lru = self._lru
        if not lru:
            return
        move = lru.move_to_end
        for k in keys:
            if k in lru:
                move(k)

    def allocate(self, n: int) -> list[int]:
        return self.slab.allocator.allocate(n)

    def release(self, slot: int) -> None:
        self.slab.allocator.release(slot)

    def insert(self, key: BlockKey, slot: int) -> None:
        """Publish a filled slot under ``key``."""
        d = self.slab.directory
        if d is not None and key in self._slots:
            d.remove(key)  # republished under another slot: one entry per key
        self._slots[key] = slot
        self._lru[key] = None
        if d is not None:
            d.insert(key, slot)

    def remove(self, key: BlockKey) -> None:
        """Drop ``key`` and free its slot."""
        slot = self._slots.pop(key)
        del self._lru[key]
        d = self.slab.directory
        if d is not None:
            d.remove(key)
        self.slab.allocator.release(slot)
