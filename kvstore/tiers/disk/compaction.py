"""Compaction of the disk tier: segments whose live fraction fell below the threshold are
rewritten. Crash-safe: the new segment is written durably and the moved records committed
before an old file is unlinked (a reader in another process that finds the old file gone
re-reads the record and retries once). :func:`rewrite` is also how ``check`` gives blocks
of a segment with a damaged header a fresh one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.errors import DiskError
from kvstore.keys import KEY_BYTES
from kvstore.tiers import codec as _codec
from kvstore.tiers.disk import segments as _seg
from kvstore.tiers.disk.index import (
    BE64,
    DB_BLOCKS,
    DB_SEGS,
    Rec,
    RecordError,
    WriteOps,
    decode_seginfo,
    lookup_record,
)
from kvstore.tiers.disk.reads import read_payload
from kvstore.tiers.disk.records import CompactResult
from kvstore.tiers.disk.txn import (
    alloc_segment_ids,
    drop_damaged,
    hint,
    segment_in_index,
    unlink_segments,
    write_ops,
)

if TYPE_CHECKING:
    from kvstore.tiers.disk.context import DiskContext

log = logging.getLogger("kvstore.disk")



def compact(ctx: DiskContext, thr: float, max_segment_bytes: int,
            progress: Callable[[int, int], None] | None = None) -> CompactResult:
    """Rewrite segments whose live fraction fell below ``thr``. Crash-safe: the new segment
    is durable and the moved records committed before an old file is unlinked. The tier has
    checked that it is writable and persisted its buffered touches. A block found damaged
    leaves the index."""
    sh = ctx.sh
    cands: list[tuple[int, int]] = []
    with sh.read() as txn:
        for k, v in txn.cursor(db=sh.dbs[DB_SEGS]):
            try:
                s = decode_seginfo(v)
            except RecordError:
                continue
            if s.live_bytes < thr * s.data_bytes:
                cands.append((BE64.unpack(k)[0], s.file_bytes))
    total = len(cands)
    sizes = dict(cands)
    moved = after = 0
    emptied: set[int] = set()
    pending: list[tuple[bytes, Rec, bytearray]] = []
    pending_bytes = 0
    limit = min(max_segment_bytes, 256 << 20)

    def flush() -> None:
        nonlocal moved, after, pending, pending_bytes
        if pending:
            m, a, gone = rewrite(ctx, pending)
            moved += m
            after += a
            emptied.update(gone)
            pending, pending_bytes = [], 0

    names: set[bytes] = set()  # tensor names (key hex) are unique within a segment
    for i, (sid, _fbytes) in enumerate(cands):
        for key, rec in _live_records_of(ctx, sid):
            payload, damage = read_payload(ctx, key, rec)
            if payload is None:
                if damage is not None:
                    drop_damaged(ctx, [damage])
                continue
            if key[KEY_BYTES:] in names:  # the same key of another namespace
                flush()
                names.clear()
            names.add(key[KEY_BYTES:])
            pending.append((key, rec, payload))
            pending_bytes += rec.stored_nbytes
            if pending_bytes >= limit:
                flush()
                names.clear()
        if progress is not None:
            progress(i + 1, total)
    flush()
    done = [sid for sid in sizes if sid in emptied or not os.path.exists(
        os.path.join(ctx.segdir, _seg.segment_name(sid)))]
    if done:
        ctx.counters.add("compactions")
    return CompactResult(len(done), sum(sizes[s] for s in done), after, moved)


def _live_records_of(ctx: DiskContext, sid: int) -> list[tuple[bytes, Rec]]:
    path = os.path.join(ctx.segdir, _seg.segment_name(sid))
    try:
        obj, start, _size = _seg.read_header(path)
        keys = _seg.header_index_keys(obj, start)
    except (OSError, _seg.SegmentFormatError) as e:
        log.warning("disk tier %s: cannot read segment %016x for compaction: %s", ctx.path, sid, e)
        return []
    out = []
    sh = ctx.sh
    db = sh.dbs[DB_BLOCKS]
    with sh.read() as txn:
        for key in keys:
            if key is None:
                continue  # not a block of ours, or no namespace to find it under
            rec = lookup_record(txn, db, key)
            if rec is not None and rec.segment == sid:
                out.append((key, rec))
    out.sort(key=lambda kr: kr[1].offset)
    return out


def _entry_for(ctx: DiskContext, ck: bytes, rec: Rec, payload: bytearray) -> _seg.SegmentEntry:
    cname = _codec.CODEC_NAMES.get(rec.codec, "none")
    ns = ctx.namespaces.get(rec.namespace_id)
    if rec.codec == _codec.CODEC_NONE and ns is not None and ns.nbytes == rec.stored_nbytes:
        dtype, shape = ns.st_dtype, ns.shape
    else:
        dtype, shape = "U8", [rec.stored_nbytes]
    return _seg.SegmentEntry(ck[KEY_BYTES:].hex(), dtype, shape, payload, rec.stored_nbytes,
                             _seg.block_meta(cname, rec.raw_nbytes, rec.checksum,
                                             rec.namespace_id, rec.parent))


def rewrite(ctx: DiskContext,
            pending: list[tuple[bytes, Rec, bytearray]]) -> tuple[int, int, list[int]]:
    """Write ``pending`` (dbkey, record, verified stored bytes) into a new segment and move
    the records still pointing where they did to it. Returns (records moved, bytes of the new
    segment (0 when it ended up empty), segments emptied and unlinked)."""
    (sid,) = alloc_segment_ids(ctx, 1)
    entries = [_entry_for(ctx, k, r, p) for k, r, p in pending]
    seg: _seg.OpenSegment | None = None
    try:
        try:
            # locked as a write in flight until its index commit (released below): a prune
            # or check with a short grace unlinked it while the records moved into it
            seg = _seg.create_segment(ctx.segdir, sid, entries, ctx.namespaces.records(
                r.namespace_id for _k, r, _p in pending))
            _seg.finish_segment(seg)
            _seg.fsync_dir(ctx.segdir)
        except OSError as e:
            if seg is not None:  # named but in no record: not left behind as an orphan
                _seg.unlink_if_ours(seg)
            raise DiskError(e.errno, f"compaction cannot write a segment in {ctx.segdir}: "
                            f"{e.strerror or e}" + hint(e)) from e
        path, fsize, offsets = seg.final, seg.size, seg.offsets
        dbytes = sum(e.nbytes for e in entries)
        now = ctx.now_us()

        def fn(ops: WriteOps) -> int:
            ops.add_segment(sid, fsize, dbytes, now)
            m = 0
            for (key, rec, _p), off in zip(pending, offsets, strict=True):
                cur = ops.get(key)
                if cur is None or (cur.segment, cur.offset) != (rec.segment, rec.offset):
                    continue  # deleted or moved meanwhile
                ops.move(key, cur, sid, off)
                m += 1
            return m

        try:
            m, emptied = write_ops(ctx, fn)
        except BaseException:
            if not segment_in_index(ctx, sid):  # an interrupt may come after the commit
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
    finally:
        if seg is not None:
            _seg.release_segment(seg)
    unlink_segments(ctx, emptied)
    return m, (0 if sid in emptied else fsize), emptied
