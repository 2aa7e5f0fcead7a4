"""Writes of the disk tier: checking and encoding the blocks (checksum, optional zstd),
grouping them into segments (at most ``max_segment_bytes``, a key once per segment), writing
the segments and committing their records.

Durable on return: each segment is written under a temp name, fsynced and linked into place
(never over an existing file), the directory fsynced, then one LMDB transaction
(synchronous) commits the records. On error :class:`~kvstore.errors.DiskError` is raised,
the new segment files are removed and nothing new is visible.

A write is two steps that a caller may also take apart: :func:`stage_blocks` writes each
segment's bytes in one sequential pass (``writev`` of the header and the blocks straight from
the caller's memory, in 32 MiB chunks each handed to the device as it is written), and
:func:`commit_staged` makes any number of staged batches durable and visible with one fsync
per file, one directory fsync and one index transaction. The store's write-behind stages
what it has and commits once it has drained (before ``flush`` returns) or has staged enough.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvstore.errors import DiskError, NamespaceMismatchError, TensorMismatchError
from kvstore.tiers import codec as _codec
from kvstore.tiers.base import check_key
from kvstore.tiers.disk import segments as _seg
from kvstore.tiers.disk.index import DB_BLOCKS, Rec, WriteOps, dbkey
from kvstore.tiers.disk.records import DiskWrite, NsCache, as_buffer
from kvstore.tiers.disk.txn import (
    alloc_segment_ids,
    apply_touches,
    hint,
    segment_in_index,
    unlink_segments,
    write_ops,
)

if TYPE_CHECKING:
    from kvstore.tiers.disk.context import DiskContext

log = logging.getLogger("kvstore.disk")

_csum = _seg.block_checksum

#: a block to write: (key, parent, namespace id, its namespace, its bytes)
Prepared = tuple[bytes, bytes | None, bytes, NsCache, memoryview]
#: an encoded block: (key, parent, namespace id, codec id, checksum, raw bytes, segment entry)
Encoded = tuple[bytes, bytes | None, bytes, int, int, int, _seg.SegmentEntry]


class WriteOptions(NamedTuple):
    """The tier's settings a write follows."""

    codec: str  # "none" or "zstd"
    zstd_level: int
    max_segment_bytes: int


@dataclass(slots=True)
class StagedWrite:
    """Segments written under temp names and not yet committed (:func:`stage_blocks`): their
    blocks are neither durable nor visible until :func:`commit_staged`. ``parents``: the
    dbkeys of their parents that were in the index when they were staged (and not staged
    with them): one gone by the commit was evicted or removed meanwhile."""

    segments: list[tuple[int, _seg.OpenSegment, list[Encoded]]] = field(default_factory=list)
    parents: set[bytes] = field(default_factory=set)

    @property
    def nbytes(self) -> int:
        return sum(seg.size for _sid, seg, _group in self.segments)


def write_blocks(ctx: DiskContext, opts: WriteOptions, items: Sequence[DiskWrite]) -> list[bytes]:
    """Write blocks durably; returns the keys newly written (present keys are skipped).
    Raises DiskError (disk full, read-only directory, I/O error) with nothing visible."""
    return commit_staged(ctx, [stage_blocks(ctx, opts, items)])


def stage_blocks(ctx: DiskContext, opts: WriteOptions, items: Sequence[DiskWrite]) -> StagedWrite:
    """Check, encode and write blocks into new segments (one sequential pass each, handed to
    the device as it goes) without making them durable or visible: :func:`commit_staged`
    does, for any number of staged batches at once (one fsync per file, one directory fsync,
    one index commit), or :func:`abort_staged` removes them. Present keys are skipped.
    Raises DiskError with nothing left behind."""
    todo, parents = _prepare(ctx, items)
    if not todo:
        return StagedWrite()
    try:
        staged = _stage_new(ctx, opts, todo)
        staged.parents = parents
        return staged
    except DiskError:
        ctx.counters.add("write_errors")
        raise
    except OSError as e:
        ctx.counters.add("write_errors")
        raise _disk_error(ctx, e) from e


def _disk_error(ctx: DiskContext, e: OSError) -> DiskError:
    return DiskError(e.errno, f"cannot write to the disk tier at {ctx.path}: "
                     f"{e.strerror or e}" + hint(e))


def _prepare(ctx: DiskContext, items: Sequence[DiskWrite]) -> tuple[list[Prepared], set[bytes]]:
    """The items checked, less those already present in their namespace; and the dbkeys of
    their parents present in the index (the parents not among them)."""
    sh = ctx.require_writable()
    prepared: list[Prepared] = []
    for i, it in enumerate(items):
        if not isinstance(it, DiskWrite):
            raise TypeError(f"write_blocks takes DiskWrite items, got {type(it).__name__}")
        key = check_key(it.key, f"items[{i}].key")
        parent = None if it.parent is None else check_key(it.parent, f"items[{i}].parent")
        ns_id = check_key(it.namespace_id, f"items[{i}].namespace_id")
        ns = ctx.namespaces.get(ns_id)
        if ns is None:
            raise NamespaceMismatchError(
                f"namespace {ns_id.hex()[:16]} is not registered with the disk tier at "
                f"{ctx.path}; call register_namespace(ns) first"
            )
        buf = as_buffer(it.data, f"items[{i}].data")
        if len(buf) != ns.nbytes:
            raise TensorMismatchError(
                f"items[{i}].data has {len(buf)} bytes; a block of this namespace has {ns.nbytes}"
            )
        prepared.append((key, parent, ns_id, ns, buf))
    if not prepared:
        return [], set()
    db = sh.dbs[DB_BLOCKS]
    seen: set[bytes] = set()
    todo = []
    parents: set[bytes] = set()
    with sh.read() as txn:
        for p in prepared:
            ck = p[2] + p[0]  # present *in this namespace*: another's record is no reason
            if ck in seen or txn.get(ck, db=db) is not None:
                continue
            seen.add(ck)
            todo.append(p)
        for p in todo:
            pk = None if p[1] is None else p[2] + p[1]
            if pk is not None and pk not in seen and pk not in parents \
                    and txn.get(pk, db=db) is not None:
                parents.add(pk)
    return todo, parents


def _encode(ctx: DiskContext, opts: WriteOptions, todo: list[Prepared]) -> list[Encoded]:
    def one(p):
        key, parent, ns_id, ns, buf = p
        csum = _csum(key, ns_id, buf)
        cid, payload = _codec.CODEC_NONE, None
        if opts.codec == "zstd":
            cid, payload = _codec.compress(buf, ns.itemsize, opts.zstd_level)
        if cid == _codec.CODEC_NONE:
            entry = _seg.SegmentEntry(key.hex(), ns.st_dtype, ns.shape, buf, len(buf),
                                      _seg.block_meta("none", len(buf), csum, ns_id, parent))
        else:
            entry = _seg.SegmentEntry(key.hex(), "U8", [len(payload)], payload, len(payload),
                                      _seg.block_meta(_codec.CODEC_NAMES[cid], len(buf), csum,
                                                      ns_id, parent))
        return (key, parent, ns_id, cid, csum, len(buf), entry)

    if opts.codec == "zstd" and len(todo) > 1:
        return list(ctx.thread_pool().map(one, todo))
    return [one(p) for p in todo]


def _group(max_segment_bytes: int, encoded: list[Encoded]) -> list[list[Encoded]]:
    groups: list[list[Encoded]] = [[]]
    size = 0
    names: set[bytes] = set()  # tensor names (key hex) are unique within a segment
    for e in encoded:
        n = e[6].nbytes
        if groups[-1] and (size + n > max_segment_bytes or e[0] in names):
            groups.append([])
            size = 0
            names.clear()
        groups[-1].append(e)
        names.add(e[0])
        size += n
    return groups


def _stage_new(ctx: DiskContext, opts: WriteOptions, todo: list[Prepared]) -> StagedWrite:
    encoded = _encode(ctx, opts, todo)
    groups = _group(opts.max_segment_bytes, encoded)
    sids = alloc_segment_ids(ctx, len(groups))
    staged = StagedWrite()
    try:
        for sid, group in zip(sids, groups, strict=True):
            seg = _seg.create_segment(ctx.segdir, sid, [g[6] for g in group],
                                      ctx.namespaces.records(g[2] for g in group))
            staged.segments.append((sid, seg, group))
    except BaseException:
        abort_staged([staged])
        raise
    return staged


def abort_staged(staged: Sequence[StagedWrite]) -> None:
    """Remove staged segments that will not be committed."""
    for s in staged:
        for _sid, seg, _group in s.segments:
            _seg.discard_segment(seg)
        s.segments.clear()


def commit_staged(ctx: DiskContext, staged: Sequence[StagedWrite]) -> list[bytes]:
    """Make staged batches durable and visible together: fsync and name every segment,
    fsync the directory once, commit every record in one index transaction. Returns the keys
    newly written. On error (DiskError) every staged segment is removed, nothing is visible,
    and the batches are empty (commit or abort each batch once)."""
    segs = [(sid, seg, group) for s in staged for sid, seg, group in s.segments]
    if not segs:
        return []
    parents = set().union(*(s.parents for s in staged))
    try:
        new, emptied = _commit(ctx, segs, parents)
    except DiskError:
        ctx.counters.add("write_errors")
        raise
    except OSError as e:
        ctx.counters.add("write_errors")
        raise _disk_error(ctx, e) from e
    finally:
        for s in staged:
            s.segments.clear()
            s.parents.clear()
    unlink_segments(ctx, emptied)
    ctx.counters.add("blocks_written", len(new))
    return new


def _commit(ctx: DiskContext, segs: list, parents: set[bytes]) -> tuple[list[bytes], list[int]]:
    ctx.require_writable()
    committed = False
    published: list[str] = []
    try:
        for _sid, seg, _group in segs:
            _seg.finish_segment(seg)  # the device has most of it already: kicked as written
            published.append(seg.final)
        _seg.fsync_dir(ctx.segdir)
        now = ctx.now_us()
        touches = ctx.touches.take()

        def fn(ops: WriteOps) -> list[bytes]:
            new = []
            cut = _below_gone_parents(ctx, ops, segs, parents)
            for sid, seg, group in segs:
                ops.add_segment(sid, seg.size, sum(g[6].nbytes for g in group), now)
                for (key, parent, ns_id, cid, csum, raw_n, entry), off in zip(
                        group, seg.offsets, strict=True):
                    ck = dbkey(ns_id, key)
                    if ck in cut or ops.txn.get(ck, db=ops.blocks) is not None:
                        continue  # cut off, or written meanwhile (another process, a batch)
                    ops.insert(ck, Rec(cid, 0, sid, off, entry.nbytes, raw_n, csum, now, now,
                                       ns_id, parent))
                    new.append(key)
            apply_touches(ops, touches)
            return new

        try:
            new, emptied = write_ops(ctx, fn)
        except BaseException:
            # one transaction adds every segment: the first one tells whether it committed
            # (an interrupt may come after the commit; see txn.segment_in_index)
            committed = bool(segs) and segment_in_index(ctx, segs[0][0])
            if not committed:
                ctx.touches.restore(touches)
            raise
        committed = True
    finally:
        if not committed:
            for _sid, seg, _group in segs:
                _seg.discard_segment(seg)
            for path in published:  # ours, named, but no record points at them
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for _sid, seg, _group in segs:  # in the index (or gone): no longer in flight
            _seg.release_segment(seg)
    return new, emptied  # type: ignore[return-value]


def _below_gone_parents(ctx: DiskContext, ops: WriteOps, segs: list,
                        parents: set[bytes]) -> set[bytes]:
    """The blocks of this commit not to commit: those whose parent was in the index when
    they were staged and is gone now — another process evicted or removed it meanwhile (its
    eviction saw no child: this one was not committed yet) — and every block of the commit
    below them. Committed, no lookup could reach them. Decided inside the commit's write
    transaction (LMDB serialises writers across processes), so a parent cannot go between
    this check and the commit; a parent not in the index when staged is a write in flight
    (an earlier block of the same put, or another process's), as before."""
    if not parents:
        return set()
    children: dict[bytes, list[bytes]] = {}
    staged: set[bytes] = set()
    for _sid, _s, group in segs:
        for key, parent, ns_id, *_rest in group:
            ck = dbkey(ns_id, key)
            staged.add(ck)
            if parent is not None:
                children.setdefault(dbkey(ns_id, parent), []).append(ck)
    gone = [p for p in parents if p not in staged and ops.txn.get(p, db=ops.blocks) is None]
    cut: set[bytes] = set()
    stack = [c for p in gone for c in children.get(p, ())]
    while stack:
        ck = stack.pop()
        if ck not in cut:
            cut.add(ck)
            stack.extend(children.get(ck, ()))
    if cut:
        log.info("disk tier %s: %d block(s) not committed: their parent was evicted or removed "
                 "meanwhile (by another process), so no lookup could reach them", ctx.path, len(cut))
    return cut
