"""Write transactions of the disk index: every change of the tier goes through
:func:`write_raw` (LMDB errors become :class:`~kvstore.errors.DiskError`) or
:func:`write_ops` (a :class:`~kvstore.tiers.disk.index.WriteOps` keeping the side indexes
consistent), and a segment file emptied by a transaction is unlinked only after it
committed (:func:`unlink_segments`). Each takes the tier's
:class:`~kvstore.tiers.disk.context.DiskContext`.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import lmdb

from kvstore.errors import DiskError
from kvstore.tiers.disk import segments as _seg
from kvstore.tiers.disk import tombstones as _tomb
from kvstore.tiers.disk.index import (
    BE64,
    DB_BLOCKS,
    DB_META,
    DB_SEGS,
    META_NEXT_SEGMENT,
    U64,
    Rec,
    RecordError,
    WriteOps,
    decode_record,
)

if TYPE_CHECKING:
    from kvstore.tiers.disk.context import DiskContext
    from kvstore.tiers.disk.reads import Damage

log = logging.getLogger("kvstore.disk")

_SEGMENT_ID_CHUNK = 64


def hint(e: OSError) -> str:
    """What to do about an OSError of a write, for its message ("" when nothing to say)."""
    if e.errno == errno.ENOSPC:
        return " (disk full: free space or lower the disk capacity)"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return " (directory not writable: fix its permissions or open the tier read-only)"
    return ""


def disk_full(path: str) -> bool:
    """True when the filesystem holding ``path`` has (almost) no space left for writers."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20


def write_raw(ctx: DiskContext, fn: Callable) -> object:
    """Run ``fn(txn)`` in a write transaction of the tier's index; returns its result."""
    try:
        return ctx.sh.write(fn)
    except lmdb.Error as e:
        code = getattr(e, "code", 0)  # LMDB passes system errors (ENOSPC, EIO) through
        code = code if isinstance(code, int) and 0 < code < 4096 else errno.EIO
        if code == errno.EIO and disk_full(ctx.index_dir):
            code = errno.ENOSPC  # LMDB turns a short write on a full disk into EIO
        why = hint(OSError(code, "")) if code != errno.EIO else ""
        raise DiskError(code, f"the disk index at {ctx.index_dir} could not commit: {e}"
                        + why) from e


def segment_in_index(ctx: DiskContext, sid: int) -> bool:
    """Whether the index has a record of segment ``sid`` (True when that cannot be told).

    For a writer whose commit raised: an interrupt (Ctrl-C in ``kvstore compact``, ``verify
    --fix`` or ``import``) is raised at the first bytecode after LMDB's commit returns, most
    likely while the commit's fsync ran, so a commit that raised may have happened. Unlinking
    the new segment then turned every block just committed into it into a miss (a compaction
    lost every block it moved). A file kept wrongly is only an orphan for ``prune``."""
    try:
        with ctx.sh.read() as txn:
            return txn.get(BE64.pack(sid), db=ctx.sh.dbs[DB_SEGS]) is not None
    except Exception:
        return True


def write_ops(ctx: DiskContext, fn: Callable[[WriteOps], object]) -> tuple[object, list[int]]:
    """Run ``fn(ops)`` in a write transaction; returns its result and the segments the
    transaction emptied (for :func:`unlink_segments`, once it committed)."""
    sh = ctx.sh

    def run(txn):
        ops = WriteOps(txn, sh.dbs)
        result = fn(ops)
        ops.finish()
        return result, [sid for sid in ops.emptied if not _still_used(ctx, txn, sid)]

    return write_raw(ctx, run)  # type: ignore[return-value]


def _still_used(ctx: DiskContext, txn, sid: int) -> bool:
    """Whether a record still points into segment ``sid``, whose accounting says it is empty:
    a damaged, missing or altered ``segs`` record counts wrong, and unlinking its file would
    lose the blocks left in it. The records named by the segment's header are looked up (all
    records when the header cannot be read); such a file is kept, with a warning."""
    blocks = ctx.sh.dbs[DB_BLOCKS]
    path = os.path.join(ctx.segdir, _seg.segment_name(sid))
    try:
        obj, start, _size = _seg.read_header(path)
        keys = _seg.header_index_keys(obj, start)
        cks = None if None in keys else keys
    except FileNotFoundError:
        return False
    except (OSError, _seg.SegmentFormatError):  # a damaged header: every record is looked at
        cks = None

    def here(raw: bytes | None) -> bool:
        try:
            return raw is not None and decode_record(raw).segment == sid
        except RecordError:
            return False

    used = (sum(here(txn.get(ck, db=blocks)) for ck in cks) if cks is not None
            else sum(here(v) for _k, v in txn.cursor(db=blocks)))
    if used:
        log.warning("disk tier %s: segment %016x is counted empty but %d record(s) still point "
                    "into it (its segment record is damaged); its file is kept ('kvstore verify "
                    "--fix' recounts)", ctx.path, sid, used)
    return bool(used)


def unlink_segments(ctx: DiskContext, sids: Sequence[int]) -> None:
    """Unlink the files of segments no committed record points at any more."""
    for sid in sids:
        ctx.fds.invalidate(sid)
        try:
            os.unlink(os.path.join(ctx.segdir, _seg.segment_name(sid)))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk tier %s: cannot unlink emptied segment %016x: %s", ctx.path, sid, e)


def quarantine_segments(ctx: DiskContext, sids: Sequence[int]) -> None:
    """Keep the files of segments emptied by dropping damaged records, renamed
    ``<id>.quarantined``: bytes that do not verify against a record may be another block's
    intact bytes (two segment files swapped), which ``kvstore recover --force`` restores.
    Never read as this segment again, never unlinked by the tier."""
    for sid in sids:
        ctx.fds.invalidate(sid)
        src = os.path.join(ctx.segdir, _seg.segment_name(sid))
        dst = os.path.join(ctx.segdir, _seg.quarantine_name(sid))
        try:
            _seg.publish(src, dst)  # never over an existing file
        except FileNotFoundError:
            continue  # a missing segment: nothing to keep
        except OSError as e:
            log.warning("disk tier %s: cannot quarantine segment %016x (%s); its file is "
                        "left where it is", ctx.path, sid, e)
            continue
        log.warning("disk tier %s: no intact block of the index is left in segment %016x: its "
                    "file is kept as %s; `kvstore recover --store %s --force` restores what in "
                    "it still verifies (blocks of another segment, when files were swapped); "
                    "delete it when it is not needed", ctx.path, sid, dst, ctx.path)


def alloc_segment_ids(ctx: DiskContext, n: int) -> list[int]:
    """Unique across processes: ids are reserved in small chunks by an LMDB write txn."""
    meta = ctx.sh.dbs[DB_META]

    def reserve(short: int) -> list[int]:
        want = max(short, _SEGMENT_ID_CHUNK)

        def fn(txn):
            (nxt,) = U64.unpack(txn.get(META_NEXT_SEGMENT, db=meta))
            txn.put(META_NEXT_SEGMENT, U64.pack(nxt + want), db=meta)
            return nxt

        first = write_raw(ctx, fn)
        return list(range(first, first + want))  # type: ignore[arg-type]

    return ctx.segment_ids.take(n, reserve)


def drop_entries(ctx: DiskContext, items: Sequence[tuple[bytes, Rec | None]],
                 namespace_id: bytes | None = None, *,
                 reason: _tomb.Reason = _tomb.Reason.REMOVED,
                 detail: _tomb.Detail = _tomb.Detail.NONE) -> list[bytes]:
    """Remove records if they are still the ones seen (same segment and offset) and, with
    ``namespace_id``, only records of that namespace; each leaves a tombstone saying
    ``reason`` (``kvstore explain``)."""
    blocks = ctx.sh.dbs[DB_BLOCKS]

    def fn(ops: WriteOps) -> list[bytes]:
        gone, traces = [], []
        for key, rec in items:
            raw = ops.txn.get(key, db=blocks)
            if raw is None:
                continue
            try:
                cur = decode_record(raw)
            except RecordError:
                if namespace_id is not None and not key.startswith(namespace_id):
                    continue  # another namespace's key space
                ops.txn.delete(key, db=blocks)  # undecodable: just drop it
                gone.append(key)
                traces.append((key, 0))
                continue
            if namespace_id is not None and cur.namespace_id != namespace_id:
                continue  # a record that lies about its namespace: not the caller's
            if rec is None or (cur.segment, cur.offset) == (rec.segment, rec.offset):
                ops.remove(key, cur)
                gone.append(key)
                traces.append((key, cur.created_us))
        tomb = ctx.sh.dbs.get(_tomb.DB_TOMBSTONES)
        if tomb is not None and traces:
            _tomb.record(ops.txn, tomb, traces, reason, _tomb.TierCode.DISK, ctx.now_us(),
                         detail)
        return gone

    gone, emptied = write_ops(ctx, fn)
    if reason is _tomb.Reason.DAMAGED:  # its bytes may be another block's: kept for recover
        quarantine_segments(ctx, emptied)
    else:
        unlink_segments(ctx, emptied)
    return gone  # type: ignore[return-value]


def drop_damaged(ctx: DiskContext, damaged: Sequence[Damage]) -> None:
    """Drop the index entries of blocks a read found damaged or missing (each only if its
    record is still the one that was read), each with a ``DAMAGED`` tombstone saying why.
    Never raises: a corrupt index must not turn a miss into a crash."""
    for d in damaged:
        try:
            drop_entries(ctx, [(d.key, d.rec)], reason=_tomb.Reason.DAMAGED,
                         detail=_tomb.DETAIL_OF_KIND.get(d.why.split()[0] if d.why else "",
                                                         _tomb.Detail.NONE))
        except Exception as e:
            log.warning("disk tier %s: could not drop damaged entry %s: %s",
                        ctx.path, d.key[-32:].hex()[:16], e)


def apply_touches(ops: WriteOps, touches: dict[bytes, tuple[int, int]]) -> None:
    """Persist buffered accesses (dbkey -> (last access us, hits)) of records still there."""
    for k, (ts, hits) in touches.items():
        rec = ops.get(k)
        if rec is not None:
            ops.update_access(k, rec, ts, hits)
