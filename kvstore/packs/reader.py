"""Reading and verifying a prefix pack: everything is checked before the caller can use any
of it — the header (canonical), the exact file length, the manifest's checksum, the parent
indices (each block's parent comes earlier in the pack, so any prefix of it is
prefix-closed), unique keys, and every block against its checksum.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.packs.format import (
    MANIFEST_BYTES,
    PackError,
    PackHeader,
    manifest_checksum,
    parse_header,
    read_header_length,
)
from kvstore.tiers.disk import block_checksum

__all__ = ["OpenPack", "open_pack", "read_pack_header"]

#: verification progress: (bytes verified, bytes in all)
Progress = Callable[[int, int], None]


def read_pack_header(path: str) -> PackHeader:
    """The header of the pack at ``path`` (checked), without reading its data."""
    fd = _open_regular(path)
    try:
        return _read_header(fd, path)
    finally:
        os.close(fd)


_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def _check_regular(path: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    what = next((w for is_it, w in _NOT_REGULAR if is_it(mode)), "a special file")
    raise PackError("not_a_pack", f"{path} is {what}, not a regular file: a pack is a regular "
                    "file written by 'kvstore export' (copy the pack into a file first); "
                    "nothing was read from it")


def _open_regular(path: str) -> int:
    """A descriptor of the regular file at ``path``; :class:`PackError` for anything else (a
    FIFO, a device, a directory, a socket), which is never read: reading a FIFO would wait
    for a writer, a device could be endless. Checked before opening (so nothing special is
    opened at all) and again on the descriptor, opened non-blocking (so a file swapped for a
    FIFO meanwhile cannot hang the open)."""
    try:
        _check_regular(path, os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise PackError("missing", f"no pack at {path}: the file does not exist") from None
    try:
        _check_regular(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_header(fd: int, path: str) -> PackHeader:
    size = os.fstat(fd).st_size
    first = os.pread(fd, 8, 0)
    n = read_header_length(first, size, path)
    header = first + os.pread(fd, n, 8)
    if len(header) != 8 + n:
        raise PackError("truncated", f"{path} is truncated inside its header")
    h = parse_header(header, path)
    if size != h.file_bytes:
        kind = "truncated" if size < h.file_bytes else "altered"
        raise PackError(kind, f"{path} is {size} bytes, but a pack of {h.blocks} block(s) of "
                        f"this layout is {h.file_bytes}: "
                        + ("truncated (copy it again)" if kind == "truncated" else
                           "bytes were appended to it"))
    return h


@dataclass(slots=True)
class OpenPack:
    """A verified pack, mapped: its manifest and a view of each block's raw bytes. Close it
    (or use it as a context manager) when done; block views must be released first."""

    path: str
    header: PackHeader
    keys: list[bytes]
    parents: list[int]  # -1: no parent (the first block of a prompt)
    checksums: list[int]
    _mm: mmap.mmap

    def block(self, i: int) -> memoryview:
        """The raw bytes of block ``i`` (a view into the mapping)."""
        h = self.header
        start = h.blocks_start + i * h.block_nbytes
        return memoryview(self._mm)[start : start + h.block_nbytes]

    def buffer(self) -> mmap.mmap:
        """The whole mapping (copy-on-write: nothing written through it reaches the file)."""
        return self._mm

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive (an exception's frame)
            self._mm.close()

    def __enter__(self) -> OpenPack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_pack(path: str, *, progress: Progress | None = None) -> OpenPack:
    """Open and verify the pack at ``path`` completely; :class:`PackError` (naming what is
    wrong) when anything does not check out. Nothing is written anywhere."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    fd = _open_regular(path)  # one descriptor for the header and the mapping
    try:
        h = _read_header(fd, path)
        # copy-on-write: torch.frombuffer wants a writable buffer; the file is never written
        mm = mmap.mmap(fd, h.file_bytes, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        with _advise(mm):
            keys, parents, sums = _manifest(mm, h, path)
            _verify_blocks(mm, h, keys, sums, path, progress)
    except BaseException:
        mm.close()
        raise
    return OpenPack(path, h, keys, parents, sums, mm)


class _advise:
    """MADV_WILLNEED while verifying: the kernel reads ahead and keeps the pages, which the
    import writes from next (SEQUENTIAL would drop them behind the verification)."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm = mm

    def __enter__(self) -> None:
        if hasattr(mmap, "MADV_WILLNEED"):
            self.mm.madvise(mmap.MADV_WILLNEED)

    def __exit__(self, *exc: object) -> None:
        pass


def _manifest(mm: mmap.mmap, h: PackHeader, path: str) -> tuple[list[bytes], list[int], list[int]]:
    n = h.blocks
    start = h.manifest_start
    raw = mm[start : start + MANIFEST_BYTES * n]
    if manifest_checksum(raw) != h.manifest_xxh3:
        raise PackError("altered", f"{path}: the manifest (keys, parents, checksums) does not "
                        "match its checksum")
    keys = [raw[32 * i : 32 * i + 32] for i in range(n)]
    parents = list(struct.unpack_from(f"<{n}q", raw, 32 * n))
    sums = list(struct.unpack_from(f"<{n}Q", raw, 40 * n))
    if len(set(keys)) != n:
        raise PackError("altered", f"{path}: a key appears twice in the manifest")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise PackError("altered", f"{path}: block {i} names parent {p}; a parent must "
                            "come earlier in the pack (or be -1)")
    return keys, parents, sums


def _verify_blocks(mm: mmap.mmap, h: PackHeader, keys: list[bytes], sums: list[int],
                   path: str, progress: Progress | None) -> None:
    nb = h.block_nbytes
    view = memoryview(mm)
    total = h.blocks * nb
    try:
        step = max(1, (64 << 20) // nb)  # progress every ~64 MiB
        for i, (k, s) in enumerate(zip(keys, sums, strict=True)):
            start = h.blocks_start + i * nb
            if block_checksum(k, h.namespace_id, view[start : start + nb]) != s:
                raise PackError("altered", f"{path}: block {i} (key {k.hex()[:16]}) does not "
                                "match its checksum: the pack is damaged; nothing was imported")
            if progress is not None and (i + 1) % step == 0:
                progress((i + 1) * nb, total)
    finally:
        view.release()
    if progress is not None:
        progress(total, total)
