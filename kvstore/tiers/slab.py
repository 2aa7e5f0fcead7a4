"""A preallocated slab of fixed-size block slots and its slot allocator.

One slab per tier and layout, allocated once: ``[slots, block_nbytes]`` bytes. Nothing is
allocated per block on the hot path; copies move whole runs of adjacent slots at once.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator, Sequence

import torch

from kvstore.errors import SizeError
from kvstore.layout import KVLayout
from kvstore.tiers.key_directory import WRITABLE_HERE, KeyDirectory


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


def paired_runs(items: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """Coalesce ``(a, b)`` pairs into ``(a, b, length)`` runs where both ``a`` and ``b`` are
    consecutive (e.g. result positions and slab rows)."""
    i, n = 0, len(items)
    while i < n:
        j = i + 1
        while j < n and items[j][0] == items[j - 1][0] + 1 and items[j][1] == items[j - 1][1] + 1:
            j += 1
        yield items[i][0], items[i][1], j - i
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
        """Up to ``n`` free slots (fewer if the slab is full).

        Slots freed earlier go first: their pages are already resident, where a never-used
        slot costs a page fault per 4 KiB on first touch; only then fresh, adjacent slots.
        """
        out: list[int] = []
        if self._free:
            take = min(n, len(self._free))
            # the free list is popped from its end; sorting what we take keeps runs adjacent
            got = self._free[-take:]
            del self._free[-take:]
            got.sort()
            out.extend(got)
        fresh = min(n - len(out), self.capacity - self._next)
        if fresh > 0:
            out.extend(range(self._next, self._next + fresh))
            self._next += fresh
        return out

    def release(self, slot: int) -> None:
        self._free.append(slot)


class Slab:
    """``[slots, block_nbytes]`` bytes on one device, viewed as blocks of the layout."""

    def __init__(
        self, layout: KVLayout, capacity_bytes: int, device: torch.device, *, pin_memory: bool,
        shared_path: str | None = None,
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
        self.shared_path = shared_path
        self._mmap: mmap.mmap | None = None
        #: key -> slot table the slab's other users probe (shared slabs only)
        self.directory: KeyDirectory | None = None
        if shared_path is not None:
            if device.type != "cpu":
                raise SizeError("only a host-memory tier can live in shared memory")
            self._mmap = map_shared(shared_path, slots * layout.block_nbytes, create=True)
            try:
                if WRITABLE_HERE:  # elsewhere clients just ask the daemon every lookup
                    self.directory = KeyDirectory.create(directory_path(shared_path), slots)
            except BaseException:
                self._mmap.close()
                os.unlink(shared_path)
                raise
            self.data = torch.frombuffer(self._mmap, dtype=torch.uint8).view(slots, layout.block_nbytes)
            if pin_memory:
                register_pinned(self.data)
        else:
            self.data = torch.empty(
                (slots, layout.block_nbytes), dtype=torch.uint8, device=device,
                pin_memory=pin_memory,
            )
        self.allocator = SlotAllocator(slots)

    def close(self) -> None:
        """Release a shared-memory mapping (and its file, which only the creator owns)."""
        if self._mmap is not None and self.shared_path is not None:
            if self.pinned:
                unregister_pinned(self.data)
            self.data = torch.empty((0, self.layout.block_nbytes), dtype=torch.uint8)
            # a view may still be alive somewhere; then the OS frees the mapping at exit
            with contextlib.suppress(BufferError):
                self._mmap.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shared_path)
            self._mmap = None
            if self.directory is not None:
                self.directory.close()
                self.directory = None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(directory_path(self.shared_path))

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


def directory_path(slab_path: str) -> str:
    """Where the key directory of the shared slab at ``slab_path`` lives."""
    return slab_path + ".keys"


def map_shared(path: str, nbytes: int, *, create: bool) -> mmap.mmap:
    """Map ``nbytes`` of the file ``path`` (created owner-only when ``create``)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size < nbytes:
            raise SizeError(f"shared memory {path} is smaller than expected ({nbytes} B)")
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def register_pinned(t: torch.Tensor) -> None:
    """Page-lock a host mapping so copies to the GPU are DMA (CUDA only)."""
    if torch.cuda.is_available() and t.numel():
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) != 0:
            raise OSError(f"cudaHostRegister failed with error {int(err)}")


def unregister_pinned(t: torch.Tensor) -> None:
    if torch.cuda.is_available() and t.numel():
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
