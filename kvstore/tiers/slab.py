"""A preallocated slab of fixed-size block slots and its slot allocator.

One slab per tier and layout, allocated once: ``[slots, block_nbytes]`` bytes. Nothing is
allocated per block on the hot path; copies move whole runs of adjacent slots at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvstore.errors import SizeError
from kvstore.layout import KVLayout


def runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Coalesce ``slots`` into ``(position, first_slot, length)`` runs of adjacent slots."""
    n = len(slots)
    i = 0
    while i < n:
        j = i + 1
        while j < n and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, slots[i], j - i
        i = j


class SlotAllocator:
    """Hands out slot indices, preferring adjacent runs so that copies coalesce."""

    __slots__ = ("capacity", "_next", "_free")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._next = 0  # slots >= _next were never handed out
        self._free: list[int] = []

    @property
    def free_count(self) -> int:
        return self.capacity - self._next + len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer if the slab is full)."""
        out: list[int] = []
        fresh = min(n, self.capacity - self._next)
        if fresh:
            out.extend(range(self._next, self._next + fresh))
            self._next += fresh
        if len(out) < n and self._free:
            take = min(n - len(out), len(self._free))
            # the free list is popped from its end; sorting what we take keeps runs adjacent
            got = self._free[-take:]
            del self._free[-take:]
            got.sort()
            out.extend(got)
        return out

    def release(self, slot: int) -> None:
        self._free.append(slot)


class Slab:
    """``[slots, block_nbytes]`` bytes on one device, viewed as blocks of the layout."""

    def __init__(
        self, layout: KVLayout, capacity_bytes: int, device: torch.device, *, pin_memory: bool
    ) -> None:
        slots = capacity_bytes // layout.block_nbytes
        if slots < 1:
            raise SizeError(
                f"capacity {capacity_bytes} B is smaller than one block ({layout.block_nbytes} B "
                "for this layout); raise it or pass 0 to disable the tier"
            )
        self.layout = layout
        self.device = device
        self.slots = slots
        self.pinned = pin_memory
        self.data = torch.empty(
            (slots, layout.block_nbytes), dtype=torch.uint8, device=device, pin_memory=pin_memory
        )
        self.allocator = SlotAllocator(slots)

    @property
    def nbytes(self) -> int:
        return self.slots * self.layout.block_nbytes

    def block(self, slot: int) -> torch.Tensor:
        """Typed view of one slot: ``[L, P, T, H, D]``."""
        return self.data[slot].view(self.layout.dtype).view(self.layout.block_shape)

    def read(self, slots: Sequence[int], dst: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Copy ``slots`` into ``dst`` (``[len(slots), block_nbytes]`` uint8, any device)."""
        for pos, first, length in runs(slots):
            dst[pos : pos + length].copy_(self.data[first : first + length], non_blocking=non_blocking)

    def write(self, slots: Sequence[int], src: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Copy ``src`` (``[len(slots), block_nbytes]`` uint8, any device) into ``slots``."""
        for pos, first, length in runs(slots):
            self.data[first : first + length].copy_(src[pos : pos + length], non_blocking=non_blocking)
