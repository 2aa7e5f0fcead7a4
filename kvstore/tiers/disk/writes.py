"""Writes of the disk tier: checking and encoding the blocks (checksum, optional zstd),
grouping them into segments (at most ``max_segment_bytes``, a key once per segment), writing
the segments and committing their records.

Durable on return: each segment is written under a temp name, fsynced and linked into place
(never over an existing file), the directory fsynced, then one LMDB transaction
(synchronous) commits the records. On error :class:`~kvstore.errors.DiskError` is raised,
the new segment files are removed and nothing new is visible.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

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
    unlink_segments,
    write_ops,
)

if TYPE_CHECKING:
    from kvstore.tiers.disk.tier import DiskTier

_csum = _seg.block_checksum

#: a block to write: (key, parent, namespace id, its namespace, its bytes)
Prepared = tuple[bytes, bytes | None, bytes, NsCache, memoryview]
#: an encoded block: (key, parent, namespace id, codec id, checksum, raw bytes, segment entry)
Encoded = tuple[bytes, bytes | None, bytes, int, int, int, _seg.SegmentEntry]


def write_blocks(t: DiskTier, items: Sequence[DiskWrite]) -> list[bytes]:
    """Write blocks durably; returns the keys newly written (present keys are skipped).
    Raises DiskError (disk full, read-only directory, I/O error) with nothing visible."""
    sh = t._ensure_writable()
    prepared: list[Prepared] = []
    for i, it in enumerate(items):
        if not isinstance(it, DiskWrite):
            raise TypeError(f"write_blocks takes DiskWrite items, got {type(it).__name__}")
        key = check_key(it.key, f"items[{i}].key")
        parent = None if it.parent is None else check_key(it.parent, f"items[{i}].parent")
        ns_id = check_key(it.namespace_id, f"items[{i}].namespace_id")
        ns = t._namespace(ns_id)
        if ns is None:
            raise NamespaceMismatchError(
                f"namespace {ns_id.hex()[:16]} is not registered with the disk tier at "
                f"{t.path}; call register_namespace(ns) first"
            )
        buf = as_buffer(it.data, f"items[{i}].data")
        if len(buf) != ns.nbytes:
            raise TensorMismatchError(
                f"items[{i}].data has {len(buf)} bytes; a block of this namespace has {ns.nbytes}"
            )
        prepared.append((key, parent, ns_id, ns, buf))
    if not prepared:
        return []
    db = sh.dbs[DB_BLOCKS]
    seen: set[bytes] = set()
    todo = []
    with sh.read() as txn:
        for p in prepared:
            ck = p[2] + p[0]  # present *in this namespace*: another's record is no reason
            if ck in seen or txn.get(ck, db=db) is not None:
                continue
            seen.add(ck)
            todo.append(p)
    if not todo:
        return []
    try:
        return _write_new(t, todo)
    except DiskError:
        t._counters.add("write_errors")
        raise
    except OSError as e:
        t._counters.add("write_errors")
        raise DiskError(e.errno, f"cannot write to the disk tier at {t.path}: "
                        f"{e.strerror or e}" + hint(e)) from e


def _encode(t: DiskTier, todo: list[Prepared]) -> list[Encoded]:
    def one(p):
        key, parent, ns_id, ns, buf = p
        csum = _csum(key, ns_id, buf)
        cid, payload = _codec.CODEC_NONE, None
        if t.codec == "zstd":
            cid, payload = _codec.compress(buf, ns.itemsize, t.zstd_level)
        if cid == _codec.CODEC_NONE:
            entry = _seg.SegmentEntry(key.hex(), ns.st_dtype, ns.shape, buf, len(buf),
                                      _seg.block_meta("none", len(buf), csum, ns_id, parent))
        else:
            entry = _seg.SegmentEntry(key.hex(), "U8", [len(payload)], payload, len(payload),
                                      _seg.block_meta(_codec.CODEC_NAMES[cid], len(buf), csum,
                                                      ns_id, parent))
        return (key, parent, ns_id, cid, csum, len(buf), entry)

    if t.codec == "zstd" and len(todo) > 1:
        return list(t._get_pool().map(one, todo))
    return [one(p) for p in todo]


def _group(t: DiskTier, encoded: list[Encoded]) -> list[list[Encoded]]:
    groups: list[list[Encoded]] = [[]]
    size = 0
    names: set[bytes] = set()  # tensor names (key hex) are unique within a segment
    for e in encoded:
        n = e[6].nbytes
        if groups[-1] and (size + n > t.max_segment_bytes or e[0] in names):
            groups.append([])
            size = 0
            names.clear()
        groups[-1].append(e)
        names.add(e[0])
        size += n
    return groups


def _write_new(t: DiskTier, todo: list[Prepared]) -> list[bytes]:
    encoded = _encode(t, todo)
    groups = _group(t, encoded)
    sids = alloc_segment_ids(t, len(groups))
    written: list[tuple[int, str, int, int, list[int], list[Encoded]]] = []
    committed = False
    try:
        for sid, group in zip(sids, groups, strict=True):
            path, fsize, offsets = _seg.write_segment(
                t._segdir, sid, [g[6] for g in group],
                t._ns_records(g[2] for g in group))
            written.append((sid, path, fsize, sum(g[6].nbytes for g in group), offsets, group))
        _seg.fsync_dir(t._segdir)
        now = t._now_us()
        touches = t._take_touches()

        def fn(ops: WriteOps) -> list[bytes]:
            new = []
            for sid, _path, fsize, dbytes, offsets, group in written:
                ops.add_segment(sid, fsize, dbytes, now)
                for (key, parent, ns_id, cid, csum, raw_n, entry), off in zip(group, offsets, strict=True):
                    ck = dbkey(ns_id, key)
                    if ops.txn.get(ck, db=ops.blocks) is not None:
                        continue  # written meanwhile by another process: ours is dead bytes
                    ops.insert(ck, Rec(cid, 0, sid, off, entry.nbytes, raw_n, csum, now, now,
                                       ns_id, parent))
                    new.append(key)
            apply_touches(ops, touches)
            return new

        try:
            new, emptied = write_ops(t, fn)
        except BaseException:
            t._restore_touches(touches)
            raise
        committed = True
    finally:
        if not committed:
            for _sid, path, *_ in written:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    unlink_segments(t, emptied)
    t._counters.add("blocks_written", len(new))
    return new
