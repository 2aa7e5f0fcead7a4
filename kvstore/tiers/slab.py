"""A preallocated slab of fixed-size block slots and its slot allocator.

One slab per tier and layout, allocated once: ``[slots, block_nbytes]`` bytes. Nothing is
allocated per block on the hot path; copies move whole runs of adjacent slots at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

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


#: ``madvise`` advice that faults pages in writable without writing them (Linux 5.14+)
MADV_POPULATE_WRITE = 23
#: bytes per ``madvise`` call: the call holds the process's memory-map lock for its length
#: (an ``mmap``/``munmap`` of a foreground allocation waits for it), and pacing checks
#: between calls
_PREFAULT_CHUNK = 2 << 20
#: how often a paused prefault looks whether the foreground went quiet: first, and at most
_PREFAULT_POLL_S = 0.001
_PREFAULT_POLL_MAX_S = 0.008
_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None


def _madvise(addr: int, length: int, advice: int) -> int:
    """``madvise``; 0 or the errno. The GIL is released for the call (ctypes.CDLL)."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        _libc = lib
    if _libc.madvise(addr, length, advice) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


class Prefault:
    """Faults a host slab's pages in on a background thread, front to back (the allocator
    hands out fresh slots in that order), so that the first copy into a slot runs at memcpy
    speed instead of taking a page fault per 4 KiB: on the build machine a first copy into
    fresh memory ran at 0.4x the speed of a copy into resident memory.

    Paced behind foreground I/O (:meth:`pace`): between 2 MiB calls it waits while ``busy()``
    says a fetch or put is in flight, so the first operations after an open do not share
    the CPU, the memory bandwidth and the memory-map lock with it (they ran at 0.4-0.65x
    steady state while an unpaced prefault of 512 MiB ran). It goes on when they are done.

    ``MADV_POPULATE_WRITE`` maps the pages without writing them, so it is safe while other
    threads copy into slots already handed out. Where the kernel lacks it (before Linux 5.14:
    ``EINVAL``) nothing is done and :attr:`error` says why; pages then fault on first touch
    as before. The cost: the slab's memory is resident from open on, as pinned slabs are.
    """

    def __init__(self, data: torch.Tensor, *, busy: Callable[[], bool] | None = None) -> None:
        self.error: str | None = None
        self.done = threading.Event()
        self.faulted = 0  # bytes faulted in so far
        self.pauses = 0  # times it stood aside for foreground I/O
        self._busy = busy
        self._stop = threading.Event()
        start = -(-data.data_ptr() // _PAGE) * _PAGE  # madvise wants whole pages
        end = (data.data_ptr() + data.numel() * data.element_size()) // _PAGE * _PAGE
        self._range = (start, max(start, end))
        self._thread = threading.Thread(target=self._run, name="kvstore-prefault", daemon=True)
        self._thread.start()

    def pace(self, busy: Callable[[], bool] | None) -> None:
        """Stand aside while ``busy()`` is true (checked between calls; None: never)."""
        self._busy = busy

    def _wait_quiet(self) -> None:
        busy = self._busy
        if busy is None or not busy():
            return
        self.pauses += 1
        wait = _PREFAULT_POLL_S
        while not self._stop.wait(wait):
            busy = self._busy
            if busy is None or not busy():
                return
            wait = min(2 * wait, _PREFAULT_POLL_MAX_S)  # a long busy spell: fewer wake-ups

    def _run(self) -> None:
        off, end = self._range
        while off < end:
            self._wait_quiet()
            if self._stop.is_set():
                break
            n = min(_PREFAULT_CHUNK, end - off)
            err = _madvise(off, n, MADV_POPULATE_WRITE)
            if err:
                self.error = f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}"
                break
            off += n
            self.faulted += n
        self.done.set()

    def stop(self) -> None:
        """Stop after the call in progress and wait for the thread (before an unmap)."""
        self._stop.set()
        self._thread.join()


class Slab:
    """``[slots, block_nbytes]`` bytes on one device, viewed as blocks of the layout.

    ``prefault``: fault a host slab's pages in at open, in the background (:class:`Prefault`;
    pinned slabs are resident already, device slabs need none)."""

    def __init__(
        self, layout: KVLayout, capacity_bytes: int, device: torch.device, *, pin_memory: bool,
        shared_path: str | None = None, prefault: bool = False,
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
        #: bytes page-locked for this slab (cudaHostRegister; 0 when not pinned or no CUDA)
        self.pinned_nbytes = 0
        if shared_path is not None:
            if device.type != "cpu":
                raise SizeError("only a host-memory tier can live in shared memory")
            self._mmap = map_shared(shared_path, slots * layout.block_nbytes, create=True)
            try:
                if WRITABLE_HERE:  # elsewhere clients just ask the daemon every lookup
                    self.directory = KeyDirectory.create(directory_path(shared_path), slots)
                self.data = torch.frombuffer(self._mmap, dtype=torch.uint8).view(slots, layout.block_nbytes)
                if pin_memory:  # a failure here must not leave the O_EXCL file behind
                    self.pinned_nbytes = register_pinned(self.data)
            except BaseException:
                self.data = torch.empty((0, layout.block_nbytes), dtype=torch.uint8)
                if self.directory is not None:
                    self.directory.close()
                    self.directory = None
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(directory_path(shared_path))
                with contextlib.suppress(BufferError):
                    self._mmap.close()
                self._mmap = None
                os.unlink(shared_path)
                raise
        elif pin_memory and device.type == "cpu":
            # Our own anonymous mapping, page-locked in place (cudaHostRegister) for exactly
            # its bytes: torch's caching host allocator (pin_memory=True) rounds a request up
            # to a power of two (40 GiB pinned 64 GiB that memcheck never counted) and keeps
            # it pinned after close.
            self._mmap = mmap.mmap(-1, slots * layout.block_nbytes,
                                   mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                self.data = torch.frombuffer(self._mmap, dtype=torch.uint8).view(slots, layout.block_nbytes)
                self.pinned_nbytes = register_pinned(self.data)
            except BaseException:
                self.data = torch.empty((0, layout.block_nbytes), dtype=torch.uint8)
                with contextlib.suppress(BufferError):
                    self._mmap.close()
                self._mmap = None
                raise
        else:
            self.data = torch.empty(
                (slots, layout.block_nbytes), dtype=torch.uint8, device=device,
                pin_memory=pin_memory,
            )
        self.allocator = SlotAllocator(slots)
        self.prefault: Prefault | None = None
        if prefault and device.type == "cpu" and not pin_memory:
            self.prefault = Prefault(self.data)

    def close(self) -> None:
        """Unpin (cudaHostUnregister) and release a host mapping (and a shared one's file,
        which only the creator owns)."""
        if self.prefault is not None:
            self.prefault.stop()
        if self._mmap is None:
            return
        if self.pinned_nbytes:
            unregister_pinned(self.data)  # before the unmap: the driver holds the pages
            self.pinned_nbytes = 0
        self.data = torch.empty((0, self.layout.block_nbytes), dtype=torch.uint8)
        # a view may still be alive somewhere; then the OS frees the mapping at exit
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None
        if self.shared_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shared_path)
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


class HostRegistrar(Protocol):
    """Page-locks host memory in place (``cudaHostRegister``); the seam the tests fake."""

    def available(self) -> bool: ...

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaHostRegistrar:
    """:class:`HostRegistrar` through torch's CUDA runtime bindings (CUDA only)."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def register(self, ptr: int, nbytes: int) -> None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise OSError(f"cudaHostRegister of {nbytes} B failed with error {int(err)}")

    def unregister(self, ptr: int) -> None:
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(err) != 0:
            raise OSError(f"cudaHostUnregister failed with error {int(err)}")


#: the process's registrar (tests swap in a fake)
REGISTRAR: HostRegistrar = CudaHostRegistrar()
_pinned: dict[int, int] = {}  # address -> bytes registered by this process, live
_pinned_lock = threading.Lock()


def register_pinned(t: torch.Tensor) -> int:
    """Page-lock the bytes of host tensor ``t`` (a mapping of ours) so copies to the GPU are
    DMA: exactly ``t``'s bytes, counted in :func:`pinned_bytes` until
    :func:`unregister_pinned`. Returns the bytes registered (0 without CUDA)."""
    nbytes = t.numel() * t.element_size()
    if not nbytes or not REGISTRAR.available():
        return 0
    ptr = t.data_ptr()
    REGISTRAR.register(ptr, nbytes)
    with _pinned_lock:
        _pinned[ptr] = nbytes
    return nbytes


def unregister_pinned(t: torch.Tensor) -> None:
    """Undo :func:`register_pinned` of ``t`` (nothing if it was not registered)."""
    ptr = t.data_ptr()
    with _pinned_lock:
        if _pinned.pop(ptr, None) is None:
            return
    REGISTRAR.unregister(ptr)


def pinned_bytes() -> int:
    """Host bytes this process's slabs hold page-locked now (:mod:`kvstore.memcheck`)."""
    with _pinned_lock:
        return sum(_pinned.values())
