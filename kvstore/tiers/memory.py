"""Memory tiers: a slab, a key -> slot map, an eviction order (:mod:`kvstore.tiers.policy`)
over the blocks it holds and an admission (:mod:`kvstore.tiers.admission`) that decides where
in that order a new block starts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from kvstore.keys import BlockKey
from kvstore.layout import KVLayout
from kvstore.tiers.admission import DEFAULT_ADMISSION, Admission, place, tier_admission
from kvstore.tiers.policy import EvictionPolicy, make_policy
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
        eviction: str = "lru",
        admission: str = DEFAULT_ADMISSION,
    ) -> None:
        self.name = name
        self.layout = layout
        self.device = device
        self.slab = Slab(layout, capacity_bytes, device, pin_memory=pin_memory,
                         shared_path=shared_path, prefault=prefault)
        self.capacity_bytes = capacity_bytes
        self._slots: dict[BlockKey, int] = {}
        # the store touches a chain leaf-to-root, so in LRU order roots stay newest
        # None under "always": insert and remove skip it
        self.admission: Admission | None = tier_admission(admission, self.slab.slots)
        # probation is always available: a put's hint may start its blocks there
        self.policy: EvictionPolicy = make_policy(eviction, self.slab.slots, probation=True)
        # the per-block hot paths go straight to the policy: no call of ours in between
        self.iter_victims = self.policy.victims  # type: ignore[method-assign]
        self.touch = self.policy.touch  # type: ignore[method-assign]
        self.counters = TierCounters()

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def slots(self) -> Mapping[BlockKey, int]:
        """Key -> slot of every block this tier holds, read-only: the store's per-key loops
        probe it directly (no call per key); it changes only through insert and remove."""
        return self._slots

    @property
    def used_bytes(self) -> int:
        return len(self._slots) * self.layout.block_nbytes

    def slot(self, key: BlockKey) -> int:
        return self._slots[key]

    def keys(self) -> Iterator[BlockKey]:
        return iter(self._slots)

    def lru_order(self) -> list[BlockKey]:
        """Keys in eviction order, best victim first (a snapshot, safe to mutate the tier
        while iterating it); oldest first under ``"lru"``."""
        return self.policy.order()  # type: ignore[return-value]

    def iter_victims(self) -> Iterator[BlockKey]:
        """Keys in eviction order, live: the tier must not change before the iteration ends
        (a snapshot of a 100,000-block tier per eviction made a full tier's puts quadratic)."""
        return self.policy.victims()  # type: ignore[return-value]

    iter_lru = iter_victims

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Mark ``keys`` used now, leaf first (the last one, the chain's root, is newest)."""
        self.policy.touch(keys)

    def allocate(self, n: int) -> list[int]:
        return self.slab.allocator.allocate(n)

    def release(self, slot: int) -> None:
        self.slab.allocator.release(slot)

    def insert(self, key: BlockKey, slot: int, *, start: int = 0) -> None:
        """Publish a filled slot under ``key``; ``start``: where a new block starts in the
        order (:meth:`~kvstore.tiers.admission.HintAdmission.start`: ``PROBATION`` or uses)."""
        d = self.slab.directory
        if d is not None and key in self._slots:
            d.remove(key)  # republished under another slot: one entry per key
        # a key the tier has not seen lately starts at the victim end (second-hit)
        place(self.policy, self.admission, key, start, new=key not in self._slots)
        self._slots[key] = slot
        if d is not None:
            d.insert(key, slot)

    def remove(self, key: BlockKey, *, for_room: bool = False) -> None:
        """Drop ``key`` and free its slot; ``for_room``: evicted or demoted to make room (the
        policy learns from those), not removed on request."""
        slot = self._slots.pop(key)
        self.policy.remove(key, for_room=for_room)
        if for_room and self.admission is not None:
            self.admission.evicted(key)
        d = self.slab.directory
        if d is not None:
            d.remove(key)
        self.slab.allocator.release(slot)
