"""Segment files of the disk tier: append-only safetensors files (``docs/format.md``).

A segment is written once, by one ``write_blocks`` batch or one compaction pass, under a
temporary name, fsynced and linked into place (never over an existing file: ids are never
reused); it is never modified afterwards and is unlinked only after the index no longer
references it. Tensor name = key hex.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from kvstore.errors import HeaderFormatError
from kvstore.filemodes import file_mode_in
from kvstore.header_json import load_header
from kvstore.keys import KEY_BYTES
from kvstore.tiers.disk.inflight import create_locked

SEGMENT_SUFFIX = ".safetensors"
#: flags of every read-only open of a segment: O_NONBLOCK so that a path that is not a
#: regular file (a FIFO left in its place) opens at once and then fails its reads (a
#: counted miss) instead of blocking the reading thread forever; no effect on files
SEGMENT_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
TEMP_SUFFIX = ".tmp"
SEGMENT_RE = re.compile(r"^([0-9a-f]{16})\.safetensors$")
TEMP_RE = re.compile(r"^([0-9a-f]{16})\.tmp$")
#: a segment file that reads found damaged until no record pointed into it: kept under this
#: name (never unlinked by the tier, prune or verify) for ``kvstore recover --force``, which
#: restores what in it still verifies (another segment's intact blocks, when two files were
#: swapped)
QUARANTINE_SUFFIX = ".quarantined"
QUARANTINE_RE = re.compile(r"^([0-9a-f]{16})\.quarantined$")
#: Header + data of a segment is aligned like safetensors does it: header padded with spaces
#: so that the data section starts at a multiple of 8.
HEADER_ALIGN = 8
#: Headers larger than this are refused when parsing (safetensors' own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
SEGMENT_FORMAT = "2"

# torch dtype name (kvstore.layout.dtype_name) -> safetensors dtype
ST_DTYPES: dict[str, str] = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int8": "I8",
    "uint8": "U8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
# bytes per element of each dtype name (without importing torch)
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_U64 = struct.Struct("<Q")
_xxh3 = xxhash.xxh3_64_intdigest
IOV_MAX = 512
#: bytes per writev; each is handed to the device right away (:func:`kick_writeback`)
_WRITE_CHUNK = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = None
_NO_SYNC_FILE_RANGE = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ESPIPE)


class SegmentFormatError(HeaderFormatError):
    """A segment file's header is not a valid kvstore safetensors header."""


def segment_name(segment_id: int) -> str:
    return f"{segment_id:016x}{SEGMENT_SUFFIX}"


def temp_name(segment_id: int) -> str:
    return f"{segment_id:016x}{TEMP_SUFFIX}"


def quarantine_name(segment_id: int) -> str:
    return f"{segment_id:016x}{QUARANTINE_SUFFIX}"


@dataclass(slots=True)
class SegmentEntry:
    """One tensor of a segment: a block's stored bytes and how safetensors should see them."""

    name: str  # key hex
    dtype: str  # safetensors dtype ("BF16", ..., "U8")
    shape: list[int]
    payload: object  # buffer with the stored bytes (memoryview, bytes, numpy array)
    nbytes: int
    meta: str  # per-block metadata value (see block_meta)


def block_checksum(key: bytes, namespace_id: bytes, data: object) -> int:
    """xxh3_64 of a block's raw bytes, seeded with xxh3_64(namespace id ‖ key).

    The seed binds the checksum to the block's identity: bytes that are valid for one key (a
    swapped index record, a wrong offset, another namespace's block) fail for every other key.
    """
    return _xxh3(data, seed=_xxh3(namespace_id + key))


def block_meta(codec: str, raw_nbytes: int, checksum: int, namespace_id: bytes,
               parent: bytes | None) -> str:
    """``"<codec>;<raw_nbytes>;<block_checksum 16 hex>;<namespace 64 hex>;<parent 64 hex or empty>"``."""
    return f"{codec};{raw_nbytes};{checksum:016x};{namespace_id.hex()};{parent.hex() if parent else ''}"


#: ``__metadata__`` key prefix of the namespace records a segment carries (one per namespace
#: of its blocks), so that ``kvstore recover`` can rebuild the index from segments alone
NAMESPACE_META_PREFIX = "kvstore.namespace."


def encode_header(segment_id: int, entries: Sequence[SegmentEntry],
                  namespaces: Mapping[bytes, bytes] | None = None) -> tuple[bytes, list[int]]:
    """The first ``8 + N`` bytes of a segment and each entry's absolute file offset.
    ``namespaces``: namespace id -> its index record (msgpack), written as hex."""
    meta: dict[str, str] = {"kvstore.format": SEGMENT_FORMAT, "kvstore.segment": f"{segment_id:016x}"}
    for nid in sorted(namespaces or ()):
        meta[NAMESPACE_META_PREFIX + nid.hex()] = namespaces[nid].hex()  # type: ignore[index]
    for e in entries:
        meta[e.name] = e.meta
    parts = ['"__metadata__":' + json.dumps(meta, separators=(",", ":"), ensure_ascii=True)]
    begin = 0
    rel = []
    for e in entries:
        end = begin + e.nbytes
        parts.append(
            json.dumps(e.name) + ":" + json.dumps(
                {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [begin, end]},
                separators=(",", ":"))
        )
        rel.append(begin)
        begin = end
    body = ("{" + ",".join(parts) + "}").encode("ascii")
    pad = (-(8 + len(body))) % HEADER_ALIGN
    body += b" " * pad
    start = 8 + len(body)
    return _U64.pack(len(body)) + body, [start + r for r in rel]


def parse_header(head: bytes) -> tuple[dict, int]:
    """Parse a header body (without the 8-byte length). Returns (json dict, data start)."""
    try:  # bounded in size and depth: a hostile header is a SegmentFormatError, not a crash
        obj = load_header(head, what="segment header", max_bytes=MAX_HEADER_BYTES)
    except HeaderFormatError as e:
        raise SegmentFormatError(str(e)) from None
    return obj, 8 + len(head)


def read_header(path: str) -> tuple[dict, int, int]:
    """Read and parse a segment's header. Returns (json dict, data start, file size)."""
    fd = os.open(path, SEGMENT_READ_FLAGS)
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, 8, 0)
        if len(first) < 8:
            raise SegmentFormatError(f"{path}: shorter than the 8-byte header length")
        (n,) = _U64.unpack(first)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise SegmentFormatError(f"{path}: header length {n} is out of range")
        head = os.pread(fd, n, 8)
        if len(head) != n:
            raise SegmentFormatError(f"{path}: truncated header")
    finally:
        os.close(fd)
    obj, start = parse_header(head)
    return obj, start, size


def header_tensors(obj: dict, data_start: int) -> dict[str, tuple[int, int]]:
    """``name -> (absolute offset, nbytes)`` of every tensor in a parsed header."""
    out = {}
    for name, info in obj.items():
        if name == "__metadata__":
            continue
        try:
            b, e = info["data_offsets"]
            b, e = int(b), int(e)
        except (KeyError, TypeError, ValueError, OverflowError):  # (int(1e999): OverflowError)
            raise SegmentFormatError(f"tensor {name!r} has no valid data_offsets") from None
        if e < b or b < 0:
            raise SegmentFormatError(f"tensor {name!r} has invalid data_offsets")
        out[name] = (data_start + b, e - b)
    return out


def header_index_keys(obj: dict, data_start: int) -> list[bytes | None]:
    """The index key (namespace id + block key) of each tensor of a parsed header, in
    :func:`header_tensors` order; None for one whose name or metadata names no block
    (SegmentFormatError for invalid offsets, as :func:`header_tensors`)."""
    meta = obj.get("__metadata__")
    meta = meta if isinstance(meta, dict) else {}
    out: list[bytes | None] = []
    for name in header_tensors(obj, data_start):
        try:
            key = bytes.fromhex(name)
            ns = bytes.fromhex(str(meta.get(name, "")).split(";")[3])
        except (ValueError, IndexError):
            out.append(None)
            continue
        out.append(ns + key if len(key) == len(ns) == KEY_BYTES else None)
    return out


def kick_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``offset`` of ``fd`` to the device now, without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``): the device writes a segment while its next
    bytes are still being copied in, so the fsync at the end waits for the last chunk only,
    not for the whole file. A hint: durability still comes from the fsync; where the call is
    missing or refused, nothing happens."""
    global _sync_file_range
    if _sync_file_range is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _sync_file_range = fn or False
    if (_sync_file_range and _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) != 0
            and ctypes.get_errno() in _NO_SYNC_FILE_RANGE):  # not here at all: stop asking
        _sync_file_range = False


def _write_all(fd: int, bufs: list) -> None:
    """writev every buffer completely (handles short writes and the per-call limits), in
    chunks of about ``_WRITE_CHUNK`` bytes, each handed to the device as it is written."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if len(v)]
    i = 0
    written = 0
    while i < len(views):
        chunk = []
        total = 0
        j = i
        while j < len(views) and len(chunk) < IOV_MAX and total < _WRITE_CHUNK:
            chunk.append(views[j])
            total += len(views[j])
            j += 1
        n = os.writev(fd, chunk)
        if n <= 0:
            raise OSError(5, "writev wrote nothing")  # EIO
        kick_writeback(fd, written, n)
        written += n
        # advance past n bytes
        while n and i < len(views):
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


def publish(tmp: str, final: str) -> None:
    """Give the complete file ``tmp`` the name ``final`` *without ever replacing* a file of
    that name: ``link`` + ``unlink`` (``rename`` would silently overwrite). Segment ids are
    never reused, so an existing ``final`` means an id was handed out twice (an index restored
    from a backup, say): FileExistsError, and the existing file stays as it was. Filesystems
    without hard links use ``renameat2(RENAME_NOREPLACE)``."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "segment file already exists; segment ids are never "
                              "reused, so it is not overwritten", final) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK,
                           errno.EXDEV, errno.ENOSYS):
            raise
        _rename_noreplace(tmp, final)
        return
    os.unlink(tmp)


_RENAME_NOREPLACE = 1
_renameat2 = None


def _rename_noreplace(src: str, dst: str) -> None:
    global _renameat2
    if _renameat2 is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "renameat2", None)
        if fn is None:
            _renameat2 = False
        else:
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
            _renameat2 = fn
    if _renameat2:
        import ctypes

        at_fdcwd = -100
        if _renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst),
                      _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "segment file already exists; segment ids are "
                                  "never reused, so it is not overwritten", dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), dst)
    # last resort (no hard links, no RENAME_NOREPLACE): check, then rename
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "segment file already exists; segment ids are never "
                              "reused, so it is not overwritten", dst)
    os.rename(src, dst)


@dataclass(slots=True)
class OpenSegment:
    """A segment written under its temp name, not yet durable nor named (:func:`create_segment`
    then :func:`finish_segment`, or :func:`discard_segment`)."""

    fd: int
    tmp: str
    final: str
    size: int
    offsets: list[int]  # absolute data offset of each entry


def create_segment(segdir: str, segment_id: int, entries: Sequence[SegmentEntry],
                   namespaces: Mapping[bytes, bytes] | None = None) -> OpenSegment:
    """Write a segment's bytes under its temp name (``O_EXCL``) in one sequential pass, each
    chunk handed to the device as it goes; the file stays open for :func:`finish_segment`,
    under a shared ``flock`` until :func:`release_segment` (or :func:`discard_segment`): the
    mark of a write in flight that ``check``/``prune`` leave alone whatever the file's mtime
    says (:mod:`.inflight`; a clock that jumped forward made it look old). On error the temp
    file is removed and the OSError propagates."""
    header, offsets = encode_header(segment_id, entries, namespaces)
    tmp = os.path.join(segdir, temp_name(segment_id))
    final = os.path.join(segdir, segment_name(segment_id))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    mode = file_mode_in(segdir)  # 0600, or 0640 in a store shared with a group, whatever the umask
    fd = create_locked(tmp, flags, mode)
    seg = OpenSegment(fd, tmp, final, len(header) + sum(e.nbytes for e in entries), offsets)
    try:
        _write_all(fd, [header, *(e.payload for e in entries)])
    except BaseException:
        discard_segment(seg)
        raise
    return seg


def finish_segment(seg: OpenSegment) -> None:
    """Make a created segment durable (fsync) and :func:`publish` it under its final name
    (never replacing an existing file). The caller fsyncs the directory, commits the index,
    then calls :func:`release_segment` (the file stays open and locked until then: named but
    not yet in the index, it is still a write in flight). On error the temp file is removed,
    the file closed and nothing is left under the final name (FileExistsError when a file of
    that name exists already: it is left as it was)."""
    try:
        os.fsync(seg.fd)
        publish(seg.tmp, seg.final)
    except BaseException:
        unlink_if_ours(seg)  # linked, then the temp name's unlink failed: no orphan left
        release_segment(seg)
        with contextlib.suppress(OSError):
            os.unlink(seg.tmp)
        raise


def unlink_if_ours(seg: OpenSegment) -> None:
    """Unlink ``seg.final`` if it names this segment's file (still open): never a file of
    that name that is someone else's."""
    with contextlib.suppress(OSError):
        if seg.fd >= 0 and os.path.samestat(os.fstat(seg.fd), os.lstat(seg.final)):
            os.unlink(seg.final)


def release_segment(seg: OpenSegment) -> None:
    """Close a segment's file (and drop its in-flight lock) once its index commit is done."""
    if seg.fd >= 0:
        with contextlib.suppress(OSError):
            os.close(seg.fd)
        seg.fd = -1


def discard_segment(seg: OpenSegment) -> None:
    """Close and remove a created segment that will not be finished (or its file, if it was)."""
    if seg.fd >= 0:
        with contextlib.suppress(OSError):
            os.close(seg.fd)
        seg.fd = -1
    with contextlib.suppress(OSError):
        os.unlink(seg.tmp)


def write_segment(segdir: str, segment_id: int, entries: Sequence[SegmentEntry],
                  namespaces: Mapping[bytes, bytes] | None = None) -> tuple[str, int, list[int]]:
    """Write a segment durably: :func:`create_segment`, then :func:`finish_segment`. The caller
    fsyncs the directory.

    Returns ``(final path, file size, absolute data offset of each entry)``. On any error the
    temp file is removed and the OSError propagates; nothing is left under the final name
    (FileExistsError when a file of that name exists already: it is left as it was).
    """
    seg = create_segment(segdir, segment_id, entries, namespaces)
    finish_segment(seg)
    release_segment(seg)
    return seg.final, seg.size, seg.offsets


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Read up to ``len(buf)`` bytes at ``offset`` straight into ``buf``; returns bytes read
    (less than ``len(buf)`` only at end of file)."""
    total = 0
    n_all = len(buf)
    while total < n_all:
        n = os.preadv(fd, [buf[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


#: reads that verify a block as they go move this many bytes per call: a piece is hashed
#: while it is still in the core's cache (L2), so a block costs one pass over memory instead
#: of a read pass and a hash pass (page-cache reads of 32 MiB blocks: 0.66x -> 0.79x raw)
VERIFY_CHUNK = 256 << 10


def pread_checksum(fd: int, bufs: Sequence[memoryview], offset: int, key: bytes,
                   namespace_id: bytes, chunk: int = VERIFY_CHUNK) -> tuple[int, int]:
    """Read consecutive file bytes at ``offset`` into ``bufs`` in order (one block's buffer,
    or its pieces), ``chunk`` bytes at a time, hashing each piece as it lands; returns
    (bytes read, :func:`block_checksum` of them). Fewer bytes than the buffers hold only at
    end of file (the checksum then covers what was read)."""
    h = xxhash.xxh3_64(seed=_xxh3(namespace_id + key))
    total = 0
    for buf in bufs:
        done, n_all = 0, len(buf)
        while done < n_all:
            end = min(done + chunk, n_all)
            n = os.preadv(fd, [buf[done:end]], offset + total)
            if n == 0:
                return total, h.intdigest()
            h.update(buf[done:done + n])
            done += n
            total += n
    return total, h.intdigest()


def parts_checksum(key: bytes, namespace_id: bytes, parts: Sequence[memoryview]) -> int:
    """:func:`block_checksum` of the concatenation of ``parts`` (a block held in pieces)."""
    if len(parts) == 1:
        return block_checksum(key, namespace_id, parts[0])
    h = xxhash.xxh3_64(seed=_xxh3(namespace_id + key))
    for v in parts:
        h.update(v)
    return h.intdigest()


def preadv_all(fd: int, bufs: list[memoryview], offset: int) -> int:
    """Read consecutive file bytes at ``offset`` into ``bufs`` in order (scatter read); returns
    the bytes read (less than the total only at end of file)."""
    views = list(bufs)
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n == 0:
            break
        total += n
        advance(views, n)
    return total


def advance(views: list, n: int) -> None:
    """Drop the first ``n`` bytes from ``views`` (buffers of a vectored read or write that
    moved only ``n`` bytes), so the next call carries on where this one stopped."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


class _FdEntry:
    __slots__ = ("fd", "refs", "dead")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.refs = 0
        self.dead = False


class FdCache:
    """Bounded LRU of read-only fds of segment files, refcounted so that an fd is never closed
    while a read is using it. Segment ids are never reused and segments are immutable, so a
    cached fd always reads the bytes that were written under its id."""

    def __init__(self, segdir: str, capacity: int = 256) -> None:
        self.segdir = segdir
        self.capacity = max(1, capacity)
        self._lock = threading.Lock()
        self._map: OrderedDict[int, _FdEntry] = OrderedDict()

    def acquire(self, segment_id: int) -> _FdEntry:
        """An open fd for the segment (raises FileNotFoundError when the file is gone)."""
        with self._lock:
            e = self._map.get(segment_id)
            if e is not None:
                # a file unlinked by another process (compaction) is reopened by name, which
                # frees its space and makes the caller re-read the index record
                try:
                    gone = os.fstat(e.fd).st_nlink == 0
                except OSError:
                    gone = True
                if not gone:
                    self._map.move_to_end(segment_id)
                    e.refs += 1
                    return e
                self._drop_locked(segment_id)
        fd = os.open(os.path.join(self.segdir, segment_name(segment_id)), SEGMENT_READ_FLAGS)
        e = _FdEntry(fd)
        e.refs = 1
        with self._lock:
            old = self._map.get(segment_id)
            if old is not None:  # another thread opened it meanwhile: use that one
                os.close(fd)
                old.refs += 1
                self._map.move_to_end(segment_id)
                return old
            self._map[segment_id] = e
            while len(self._map) > self.capacity:
                sid = next(iter(self._map))
                self._drop_locked(sid)
        return e

    def release(self, e: _FdEntry) -> None:
        with self._lock:
            e.refs -= 1
            if e.dead and e.refs == 0:
                os.close(e.fd)
                e.fd = -1

    def _drop_locked(self, segment_id: int) -> None:
        e = self._map.pop(segment_id, None)
        if e is None:
            return
        e.dead = True
        if e.refs == 0:
            os.close(e.fd)
            e.fd = -1

    def invalidate(self, segment_id: int) -> None:
        with self._lock:
            self._drop_locked(segment_id)

    def close(self) -> None:
        with self._lock:
            for sid in list(self._map):
                self._drop_locked(sid)

    def abandon(self) -> None:
        """After fork: close the inherited fds without touching the (maybe held) lock."""
        for e in list(self._map.values()):
            with contextlib.suppress(OSError):
                os.close(e.fd)
        self._map = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)
