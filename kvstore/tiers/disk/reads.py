"""Reads of the disk tier: planning (adjacent raw blocks of a segment become one ``preadv``,
the runs of a segment one task of a reading thread), reading straight into the caller's
buffers (a destination may be one buffer or the pieces of one block, e.g. an engine's
per-layer pages: one iovec each), verification against the checksum bound to key and
namespace, and damage reporting:
a missing segment, short read, bad checksum or undecodable payload is ``DAMAGED``, counted,
logged and reported (:class:`Damage`, in the :class:`ReadResult`) — never raised, never
``OK`` with wrong bytes; a block whose record is gone by now (evicted) or that cannot be
read now (:data:`NOT_DAMAGE`) is ``MISSING``, its entry kept. Reads never write the index: the tier drops the
entries of what they report (``txn.drop_damaged``). A segment gone meanwhile (compacted by
another process) is looked up again and read once more.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvstore.errors import StoreClosedError, TensorMismatchError
from kvstore.keys import KEY_BYTES
from kvstore.ratelog import Every
from kvstore.tiers import codec as _codec
from kvstore.tiers.base import ReadStatus, check_key
from kvstore.tiers.disk import segments as _seg
from kvstore.tiers.disk.index import DB_BLOCKS, Rec, RecordError, decode_record
from kvstore.tiers.disk.records import as_buffer

if TYPE_CHECKING:
    import torch

    from kvstore.tiers.disk.context import DiskContext

    #: a destination: a CPU uint8 buffer, or the pieces of one block in order (tensors or
    #: byte memoryviews, e.g. one per engine page)
    Dst = torch.Tensor | Sequence[torch.Tensor | memoryview]

log = logging.getLogger("kvstore.disk")

_csum = _seg.block_checksum
_RUN_BYTES = 8 << 20  # one preadv reads at most this many adjacent bytes
_RUN_IOVS = 256

#: errors of this process or of the system, not of the segment (out of descriptors or
#: memory, a file made unreadable to us): the block is not served, but its bytes may be
#: intact, so its entry stays (dropped, the emptied segment file was unlinked: a process at
#: its descriptor limit deleted every flushed block it tried to read)
NOT_DAMAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EINTR,
                        errno.EACCES, errno.EPERM})
#: the reason :func:`read_rec` gives for such a read
UNAVAILABLE = "unavailable"
_UNREADABLE_LOG = Every(10.0)  # such reads are logged at most every 10 s

#: one read of a run: (index into the request, its record or None when it is read alone)
Run = list[tuple[int, Rec | None]]
#: one destination's bytes: the buffers that take a block's bytes in order (one, or the
#: pieces of a scattered destination)
Parts = list[memoryview]


class Damage(NamedTuple):
    """A block a read found missing or damaged (its index entry is to be dropped, if
    ``rec`` is still its record: None when the record itself did not decode)."""

    key: bytes  # the dbkey
    rec: Rec | None
    status: ReadStatus
    why: str


@dataclass(slots=True)
class ReadResult:
    """What a read found: one status per key, and the blocks found damaged."""

    statuses: list[ReadStatus]
    damaged: list[Damage] = field(default_factory=list)


@dataclass(slots=True)
class _Reading:
    """One read in progress: the tier's context and what it found damaged so far (the
    reading threads append to it)."""

    ctx: DiskContext
    damaged: list[Damage] = field(default_factory=list)


def _size(parts: Parts) -> int:
    return sum(len(v) for v in parts)


def _as_parts(d: Dst, what: str) -> Parts:
    if not isinstance(d, (list, tuple)):
        return [as_buffer(d, what)]
    if not d:
        raise TensorMismatchError(f"{what} is an empty list of pieces; pass one block's "
                                  "buffers in order")
    parts = list(d)
    for j, x in enumerate(parts):
        if type(x) is not memoryview:
            parts[j] = as_buffer(x, f"{what}[{j}]")
        elif x.readonly or x.format != "B" or not x.c_contiguous:
            raise TensorMismatchError(f"{what}[{j}] must be a writable, contiguous byte "
                                      "memoryview (memoryview(...).cast('B'))")
    return parts


def per_segment(runs: list[Run], parts: int = 1) -> list[list[Run]]:
    """The runs of one segment as one task, in file order, so that a thread reads a file
    front to back (with a file descriptor of its own: its own readahead). Runs of a file
    spread over threads through one descriptor interleave on its readahead state, which then
    stops reading ahead: measured 174 ms instead of 89 ms for 256 MiB cold on this machine.
    With fewer segments than ``parts`` (the reading threads), a segment's runs are cut into
    contiguous pieces so every thread has a stretch (page-cache reads are copies: they need
    the cores). Runs without a record (damaged, compressed) stay tasks of their own."""
    tasks: list[list[Run]] = []
    by_seg: dict[int, list[Run]] = {}
    for run in runs:
        rec = run[0][1]
        if rec is None:
            tasks.append([run])
        elif rec.segment in by_seg:
            by_seg[rec.segment].append(run)
        else:
            by_seg[rec.segment] = task = [run]
            tasks.append(task)
    if 0 < len(by_seg) < parts:
        pieces = -(-parts // len(by_seg))
        split: list[list[Run]] = []
        for task in tasks:
            rec = task[0][0][1]
            if rec is None or len(task) < 2:
                split.append(task)
                continue
            step = -(-len(task) // pieces)
            split.extend(task[i : i + step] for i in range(0, len(task), step))
        tasks = split
    return tasks


def _check_mirrors(mirrors: Sequence[torch.Tensor | None], dsts: Sequence[torch.Tensor]) -> None:
    if len(mirrors) != len(dsts):
        raise TensorMismatchError(f"read_many got {len(dsts)} destinations but {len(mirrors)} "
                                  "mirrors; pass one mirror (or None) per destination")
    for i, (m, d) in enumerate(zip(mirrors, dsts, strict=True)):
        if m is not None and isinstance(d, (list, tuple)):
            raise TensorMismatchError(f"mirrors[{i}] is given for a scattered destination; "
                                      "mirror only whole-block destinations")
        if m is not None and (m.shape != d.shape or m.dtype != d.dtype):
            raise TensorMismatchError(f"mirrors[{i}] is {tuple(m.shape)} {m.dtype}, its "
                                      f"destination {tuple(d.shape)} {d.dtype}; they must match")


def _mirror(idx: Iterable[int], out: list, dsts: Sequence[torch.Tensor],
            mirrors: Sequence[torch.Tensor | None] | None) -> None:
    if mirrors is None:
        return
    for i in idx:
        m = mirrors[i]
        if m is not None and out[i] is ReadStatus.OK:
            m.copy_(dsts[i])



def read_many(ctx: DiskContext, keys: Sequence[bytes],
              dsts: Sequence[Dst],
              mirrors: Sequence[torch.Tensor | None] | None, namespace_id: bytes | None,
              records: Sequence[bytes | None] | None) -> ReadResult:
    """:meth:`DiskTier.read_many <kvstore.tiers.disk.DiskTier.read_many>`. ``dsts[i]`` is one
    CPU uint8 buffer or a list of them that takes block ``i``'s bytes in order (its pieces:
    one iovec each in the block's ``preadv``). The tier has checked that it is open."""
    rd = _Reading(ctx)
    sh = ctx.sh
    if len(keys) != len(dsts):
        raise TensorMismatchError(f"read_many got {len(keys)} keys but {len(dsts)} destinations")
    if mirrors is not None:
        _check_mirrors(mirrors, dsts)
    keys = [check_key(k, "key") for k in keys]
    bufs = [_as_parts(d, f"dsts[{i}]") for i, d in enumerate(dsts)]
    db = sh.dbs[DB_BLOCKS]
    if records is not None and namespace_id is not None and len(records) == len(keys):
        ns = check_key(namespace_id, "namespace_id")
        keys = [ns + k for k in keys]  # from here on: LMDB keys
        raws = list(records)
    else:
        with sh.read() as txn:
            keys = rd.ctx.namespaces.dbkeys(txn, keys, namespace_id)  # from here on: LMDB keys
            raws = [txn.get(k, db=db) for k in keys]
    out: list[ReadStatus | None] = [None] * len(keys)
    if len(keys) <= 1:
        for i in range(len(keys)):
            out[i] = _read_one(rd, keys[i], raws[i], bufs[i])
        _mirror(range(len(keys)), out, dsts, mirrors)
        return ReadResult(out, rd.damaged)  # type: ignore[arg-type]
    nb = [sum(map(len, p)) for p in bufs]  # each destination's bytes, summed once
    runs = _plan_runs(rd, keys, raws, nb, out)
    width, chunk = reading_shape(ctx, runs)
    tasks = per_segment(runs, width)
    args = (keys, raws, bufs, nb, out, dsts, mirrors, chunk)
    _drain_with_helpers(rd, collections.deque(tasks), min(width, len(tasks)), args)
    return ReadResult([ReadStatus.DAMAGED if st is None else st for st in out], rd.damaged)


def _drain_with_helpers(rd: _Reading, queue: collections.deque, width: int, args: tuple) -> None:
    """``width`` threads take the tasks in order from one queue: the calling thread, which
    would only wait otherwise, and ``width - 1`` of the pool's. Every task runs to its end
    before this returns, also when the caller's part raised: a reading thread still copying
    into a destination or mirror afterwards could overwrite a slot that the caller has
    meanwhile handed to another fetch. With ``width`` 1 the caller reads alone (the pool is
    not touched)."""

    def drain() -> None:
        while True:
            try:
                task = queue.popleft()
            except IndexError:
                return
            _read_runs_safe(rd, task, *args)

    futures: list[concurrent.futures.Future[None]] = []
    if width > 1:
        pool = rd.ctx.thread_pool()
        futures = [pool.submit(drain) for _ in range(width - 1)]
    try:
        drain()
    finally:
        # a helper that has not started (the pool busy with another read) would find the
        # queue empty: it is cancelled rather than waited for, so a read never waits behind
        # another; one that has started is finishing a task and is waited for
        running = [f for f in futures if not f.cancel()]
        concurrent.futures.wait(running)
    for f in running:
        f.result()  # _read_runs_safe does not raise; a pool shutting down may


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
#: bytes per ``preadv`` when the blocks come from the device: large reads keep it busy (1 GiB
#: cold, 4 reading threads, ÷ a raw sequential read in the same run, 2 MiB / 32 MiB blocks:
#: 256 KiB pieces 0.65x / 0.67x, 4 MiB 0.86-0.87x / 0.94-0.97x, 16 MiB 0.92-0.97x /
#: 0.99-1.10x); from the page cache the small :data:`segments.VERIFY_CHUNK` hashes in cache
COLD_CHUNK = 16 << 20


def reading_shape(ctx: DiskContext, runs: list[Run]) -> tuple[int, int]:
    """(threads, bytes per read) for ``runs``. From the page cache: one thread per core and
    ``VERIFY_CHUNK`` pieces (copies and hashes that need the cores; more threads than cores
    only trade them: a 32 MiB load took ~10.5 ms on 4 threads, ~8.8 on 2, on 2 cores). From
    the device: the whole pool (``read_threads``) and ``COLD_CHUNK`` reads, since the reads
    wait on it. Told apart by one ``RWF_NOWAIT`` read of the first and the last block's
    first page (EAGAIN when it is not cached); where that cannot tell, the pool's width and
    the small pieces."""
    width = ctx.read_threads
    cached = _in_page_cache(ctx, runs)
    if cached is None:
        return width, _seg.VERIFY_CHUNK
    if cached:
        return min(width, os.cpu_count() or 1), _seg.VERIFY_CHUNK
    return width, COLD_CHUNK


def _in_page_cache(ctx: DiskContext, runs: list[Run]) -> bool | None:
    if not _RWF_NOWAIT or not runs:
        return None
    first, last = runs[0][0][1], runs[-1][-1][1]
    if first is None or last is None:
        return None
    page = bytearray(4096)
    for rec in (first, last):
        try:
            fe = ctx.fds.acquire(rec.segment)
        except OSError:
            return None
        try:
            os.preadv(fe.fd, [page], rec.offset, _RWF_NOWAIT)
        except BlockingIOError:  # EAGAIN: that page is not in the page cache
            return False
        except OSError:  # EOPNOTSUPP and the like: cannot tell
            return None
        finally:
            ctx.fds.release(fe)
    return True


def _read_runs_safe(rd: _Reading, runs, keys, raws, bufs, nb, out, dsts, mirrors,
                    chunk: int) -> None:
    """``_read_runs``, with any unexpected failure turned into DAMAGED for its blocks (a
    corrupt index, a failed drop): a read never raises for bad data."""
    try:
        _read_runs(rd, runs, keys, raws, bufs, nb, out, dsts, mirrors, chunk)
    except (StoreClosedError, TensorMismatchError):
        raise
    except Exception as e:  # damage of any kind is a counted miss
        idx = [i for run in runs for i, _rec in run if out[i] is not ReadStatus.OK]
        log.warning("disk tier %s: reading %d block(s) failed (%s: %s); treating them as "
                    "damaged", rd.ctx.path, len(idx), type(e).__name__, e)
        rd.ctx.counters.add("read_damaged", len(idx))
        for run in runs:
            for i, _rec in run:
                out[i] = ReadStatus.DAMAGED


def _read_runs(rd: _Reading, runs, keys, raws, bufs, nb, out, dsts, mirrors,
               chunk: int) -> None:
    rec = runs[0][0][1]
    fd = -1
    if rec is not None and len(runs) > 1:  # a stretch of one segment: its own descriptor
        with contextlib.suppress(OSError):  # gone? the shared path knows what to do
            fd = os.open(os.path.join(rd.ctx.segdir, _seg.segment_name(rec.segment)),
                         _seg.SEGMENT_READ_FLAGS)
    try:
        for run in runs:
            _read_run(rd, run, keys, raws, bufs, nb, out, fd, chunk)
            if mirrors is not None:
                _mirror([i for i, _rec in run], out, dsts, mirrors)
    finally:
        if fd >= 0:
            os.close(fd)


def _plan_runs(rd: _Reading, keys, raws, nb: list[int], out) -> list[Run]:
    """Group the reads: blocks stored raw and adjacent in one segment (in request order or
    not) become one ``preadv`` with one iovec per destination (up to _RUN_BYTES)."""
    runs: list[Run] = []
    by_seg: dict[int, list[tuple[int, Rec]]] = {}
    for i, raw in enumerate(raws):
        if raw is None:
            rd.ctx.counters.add("read_missing")
            out[i] = ReadStatus.MISSING
            continue
        try:
            rec = decode_record(raw)
        except RecordError:
            runs.append([(i, None)])
            continue
        if (rec.codec == _codec.CODEC_NONE and rec.stored_nbytes == rec.raw_nbytes
                == nb[i]):
            by_seg.setdefault(rec.segment, []).append((i, rec))
        else:
            runs.append([(i, None)])
    for items in by_seg.values():
        items.sort(key=lambda ir: ir[1].offset)
        run: Run = []
        end = size = 0
        for i, rec in items:
            if run and (rec.offset != end or size >= _RUN_BYTES or len(run) >= _RUN_IOVS):
                runs.append(run)
                run, size = [], 0
            run.append((i, rec))
            end = rec.offset + rec.stored_nbytes
            size += rec.stored_nbytes
        if run:
            runs.append(run)
    return runs


def _read_run(rd: _Reading, run, keys, raws, bufs, nb, out, fd: int, chunk: int) -> None:
    if len(run) == 1 or run[0][1] is None:
        for i, _rec in run:
            out[i] = _read_one(rd, keys[i], raws[i], bufs[i])
        return
    fe = None
    if fd < 0:
        try:
            fe = rd.ctx.fds.acquire(run[0][1].segment)
        except OSError:
            fe = None
    done = 0  # blocks of the run read and verified (or found damaged)
    try:
        if fe is not None or fd >= 0:
            done = _read_verified(rd, run, keys, bufs, nb, out, fd if fd >= 0 else fe.fd, chunk)
    finally:
        if fe is not None:
            rd.ctx.fds.release(fe)
    # missing file, short read, I/O error: the rest per block, with retry/damage logic
    for i, _rec in run[done:]:
        out[i] = _read_one(rd, keys[i], raws[i], bufs[i])


def _read_verified(rd: _Reading, run, keys, bufs, nb, out, fd: int, chunk: int) -> int:
    """Read the adjacent raw blocks of ``run`` and verify each, in pieces of about ``chunk``
    bytes (blocks that small in one ``preadv``, a larger block piece by piece), so that
    from the page cache each block is hashed while it is in the CPU's cache
    (``VERIFY_CHUNK``) and from the device each read is large (``COLD_CHUNK``). Returns
    how many blocks were settled; it stops at the first read that fails or comes back
    short."""
    ok = done = 0
    n_run = len(run)
    try:
        while done < n_run:
            i, rec = run[done]
            if nb[i] > chunk:  # a large block: read and hash piece by piece
                n, csum = _seg.pread_checksum(fd, bufs[i], rec.offset, keys[i][KEY_BYTES:],
                                               rec.namespace_id, chunk)
                if n != nb[i]:
                    return done
                ok += _settle(rd, keys[i], rec, csum, out, i)
                done += 1
                continue
            # small blocks: as many as fit one piece, one preadv (of at most IOV_MAX iovecs:
            # a block given as one page per layer is many)
            end, size, iovs = done, 0, 0
            while end < n_run and (end == done or (
                    size + nb[run[end][0]] <= chunk
                    and iovs + len(bufs[run[end][0]]) <= _seg.IOV_MAX)):
                size += nb[run[end][0]]
                iovs += len(bufs[run[end][0]])
                end += 1
            views = [v for j, _ in run[done:end] for v in bufs[j]]
            if _seg.preadv_all(fd, views, rec.offset) != size:
                return done
            for j, rj in run[done:end]:
                ok += _settle(rd, keys[j], rj, _seg.parts_checksum(keys[j][KEY_BYTES:],
                                                                 rj.namespace_id, bufs[j]), out, j)
            done = end
        return done
    except OSError:
        return done
    finally:
        rd.ctx.counters.add("reads_ok", ok)


def _settle(rd: _Reading, key: bytes, rec: Rec, csum: int, out, i: int) -> int:
    if csum == rec.checksum:
        out[i] = ReadStatus.OK
        return 1
    out[i] = damaged(rd, key, rec, ReadStatus.DAMAGED, "checksum_mismatch")
    return 0


def read_one(ctx: DiskContext, key: bytes, raw: bytes | None,
             buf: memoryview | Parts) -> ReadResult:
    """Read and verify one block (``key``: its dbkey) given its index record ``raw``."""
    rd = _Reading(ctx)
    return ReadResult([_read_one(rd, key, raw, buf)], rd.damaged)


def _read_one(rd: _Reading, key: bytes, raw: bytes | None, buf: memoryview | Parts) -> ReadStatus:
    if isinstance(buf, list):
        if len(buf) == 1:
            buf = buf[0]
        else:  # pieces: read whole into a bounce buffer (the rare path), then hand them out
            whole = memoryview(bytearray(_size(buf)))
            status = _read_one(rd, key, raw, whole)
            if status is ReadStatus.OK:
                at = 0
                for v in buf:
                    v[:] = whole[at:at + len(v)]
                    at += len(v)
            return status
    if raw is None:
        rd.ctx.counters.add("read_missing")
        return ReadStatus.MISSING
    try:
        rec = decode_record(raw)
    except RecordError as e:
        return damaged(rd, key, None, ReadStatus.DAMAGED, f"index record does not decode: {e}")
    if rec.raw_nbytes != len(buf):
        ns = rd.ctx.namespaces.get(rec.namespace_id)
        if ns is None or ns.nbytes != len(buf):  # the caller's buffer is wrong
            raise TensorMismatchError(
                f"destination has {len(buf)} bytes but block {key[-KEY_BYTES:].hex()[:16]} has "
                f"{rec.raw_nbytes}"
            )
        return damaged(rd, key, rec, ReadStatus.DAMAGED,
                             f"bad_record (raw size {rec.raw_nbytes} != {ns.nbytes})")
    for attempt in range(2):
        status, why = read_rec(rd.ctx, key, rec, buf)
        if status is ReadStatus.OK:
            rd.ctx.counters.add("reads_ok")
            return status
        if why.startswith(UNAVAILABLE):  # not the block's fault: a miss, its entry kept
            rd.ctx.counters.add("read_missing")
            if _UNREADABLE_LOG.due():  # once per stretch, not once per block
                log.warning("disk tier %s: block %s cannot be read now (%s); not served, its "
                            "index entry kept", rd.ctx.path, key[-KEY_BYTES:].hex()[:16], why)
            return ReadStatus.MISSING
        if why != "missing_segment" or attempt:
            break
        # the segment is gone: compaction or eviction in another process? re-read the
        # record and retry once
        cur = rd.ctx.get_rec(key)
        if cur is None:
            rd.ctx.counters.add("read_missing")
            return ReadStatus.MISSING
        if (cur.segment, cur.offset) == (rec.segment, rec.offset):
            break
        rec = cur
    return damaged(rd, key, rec, ReadStatus.DAMAGED, why)  # a missing segment too: bytes gone


def read_rec(ctx: DiskContext, key: bytes, rec: Rec, buf: memoryview) -> tuple[ReadStatus, str]:
    """Read one record's bytes into ``buf`` and verify. Returns (status, reason).
    ``key``: the block key or its dbkey."""
    key = key[-KEY_BYTES:]
    fds = ctx.fds
    try:
        fe = fds.acquire(rec.segment)
    except FileNotFoundError:
        return ReadStatus.MISSING, "missing_segment"
    except OSError as e:
        return _os_error(e, "segment cannot be opened")
    try:
        if rec.codec == _codec.CODEC_NONE:
            if rec.stored_nbytes != len(buf):
                return ReadStatus.DAMAGED, "bad_record"
            n, csum = _seg.pread_checksum(fe.fd, [buf], rec.offset, key, rec.namespace_id)
            if n != len(buf):
                return ReadStatus.DAMAGED, f"short_segment (read {n} of {len(buf)} bytes)"
            if csum != rec.checksum:
                return ReadStatus.DAMAGED, "checksum_mismatch"
            return ReadStatus.OK, ""
        else:
            payload = bytearray(rec.stored_nbytes)
            n = _seg.pread_into(fe.fd, memoryview(payload), rec.offset)
            if n != rec.stored_nbytes:
                return ReadStatus.DAMAGED, f"short_segment (read {n} of {rec.stored_nbytes} bytes)"
            try:
                _codec.decompress_into(rec.codec, payload, np.frombuffer(buf, dtype=np.uint8))
            except _codec.CodecError as e:
                return ReadStatus.DAMAGED, f"checksum_mismatch (payload does not decode: {e})"
    except OSError as e:
        return _os_error(e, "read error")
    finally:
        fds.release(fe)
    if _csum(key, rec.namespace_id, buf) != rec.checksum:
        return ReadStatus.DAMAGED, "checksum_mismatch"
    return ReadStatus.OK, ""


def _os_error(e: OSError, what: str) -> tuple[ReadStatus, str]:
    """An OSError of a read: damage, or (:data:`NOT_DAMAGE`) a read that cannot be made now."""
    if e.errno in NOT_DAMAGE:
        return ReadStatus.MISSING, f"{UNAVAILABLE} ({what}: {e})"
    return ReadStatus.DAMAGED, f"{what}: {e}"


def damaged(rd: _Reading, key: bytes, rec: Rec | None, status: ReadStatus, why: str) -> ReadStatus:
    rd.ctx.counters.add("read_missing" if status is ReadStatus.MISSING else "read_damaged")
    where = f"segment {rec.segment:016x} offset {rec.offset}" if rec else "index"
    log.warning("disk tier %s: block %s is %s (%s, %s); dropping its index entry",
                rd.ctx.path, key[-KEY_BYTES:].hex()[:16], status.value, why, where)
    rd.damaged.append(Damage(key, rec, status, why))
    return status


def read_payload(ctx: DiskContext, key: bytes,
                 rec: Rec) -> tuple[bytearray | None, Damage | None]:  # key: the dbkey
    """Stored bytes of a record, verified; None when moved meanwhile or damaged (then with
    the :class:`Damage`, whose entry the caller drops)."""
    rd = _Reading(ctx)
    payload = bytearray(rec.stored_nbytes)
    status, why = ReadStatus.OK, ""
    try:
        fe = rd.ctx.fds.acquire(rec.segment)
    except FileNotFoundError:
        return None, None  # moved or removed meanwhile (another process compacted it)
    except OSError as e:
        status, why = _os_error(e, "segment cannot be opened")
        if status is ReadStatus.MISSING:  # not the block's fault: left where it is
            log.warning("disk tier %s: block %s cannot be read now (%s); left in place",
                        ctx.path, key[-KEY_BYTES:].hex()[:16], why)
            return None, None
    else:
        try:
            n = _seg.pread_into(fe.fd, memoryview(payload), rec.offset)
        finally:
            rd.ctx.fds.release(fe)
        if n != rec.stored_nbytes:
            status, why = ReadStatus.DAMAGED, "short_segment"
        elif rec.codec == _codec.CODEC_NONE:
            if _csum(key[KEY_BYTES:], rec.namespace_id, payload) != rec.checksum:
                status, why = ReadStatus.DAMAGED, "checksum_mismatch"
        else:
            out = np.empty(rec.raw_nbytes, dtype=np.uint8)
            try:
                _codec.decompress_into(rec.codec, payload, out)
                if _csum(key[KEY_BYTES:], rec.namespace_id, out) != rec.checksum:
                    status, why = ReadStatus.DAMAGED, "checksum_mismatch"
            except _codec.CodecError as e:
                status, why = ReadStatus.DAMAGED, f"checksum_mismatch ({e})"
    if status is not ReadStatus.OK:
        damaged(rd, key, rec, status, why)
        return None, rd.damaged[0]
    return payload, None


