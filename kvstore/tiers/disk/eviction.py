"""Eviction of the disk tier: leaf-first LRU down to the capacity. Only blocks without
children on disk are candidates (the ``lru`` database holds exactly the leaves, oldest first),
so a prefix-closed set of blocks stays prefix-closed; a parent whose last child is chosen
becomes a candidate in the same pass.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.keys import KEY_BYTES
from kvstore.tiers.disk import tombstones as _tomb
from kvstore.tiers.disk.index import (
    DB_BLOCKS,
    DB_CHILDREN,
    DB_LRU,
    U32,
    RecordError,
    WriteOps,
    decode_record,
    lookup_record,
    lru_key,
    parent_dbkey,
)
from kvstore.tiers.disk.txn import unlink_segments, write_ops

if TYPE_CHECKING:
    from kvstore.tiers.disk.context import DiskContext

_SELECT_BATCH = 50_000


def evict_to_budget(ctx: DiskContext, capacity_bytes: int,
                    protect: Callable[[bytes], bool] | None = None) -> list[bytes]:
    """Evict leaf-first LRU until stored bytes <= ``capacity_bytes``. Never evicts a key for
    which ``protect(key)`` is true, nor a block with children on disk. ``protect`` is called
    inside a read transaction and must not call back into this tier. The tier has checked
    that it is writable and persisted its buffered touches."""
    sh = ctx.sh
    evicted: list[bytes] = []
    while True:
        excess = ctx.totals()[1] - capacity_bytes
        if excess <= 0:
            break
        victims = _select_victims(ctx, excess, protect)
        if not victims:
            break
        children_db = sh.dbs[DB_CHILDREN]

        def fn(ops: WriteOps, victims=victims, children_db=children_db) -> list[bytes]:
            done, traces = [], []
            for ck in victims:
                rec = ops.get(ck)
                if rec is None or ops.txn.get(ck, db=children_db) is not None:
                    continue  # gone, or gained a child meanwhile
                ops.remove(ck, rec)
                done.append(ck[KEY_BYTES:])
                traces.append((ck, rec.created_us))
            tomb = sh.dbs.get(_tomb.DB_TOMBSTONES)
            if tomb is not None and traces:  # so that explain can say "evicted", and when
                _tomb.record(ops.txn, tomb, traces, _tomb.Reason.EVICTED, _tomb.TierCode.DISK,
                             ctx.now_us())
            return done

        done, emptied = write_ops(ctx, fn)
        unlink_segments(ctx, emptied)
        evicted.extend(done)
        ctx.counters.add("evictions", len(done))
        if not done:
            break
    return evicted


def _select_victims(ctx: DiskContext, excess: int,
                    protect: Callable[[bytes], bool] | None) -> list[bytes]:
    """Leaves in LRU order (and parents as their last child goes) until ``excess`` bytes."""
    sh = ctx.sh
    blocks, children_db, lru = sh.dbs[DB_BLOCKS], sh.dbs[DB_CHILDREN], sh.dbs[DB_LRU]
    chosen: list[bytes] = []
    freed = 0
    sim: dict[bytes, int] = {}
    heap: list[bytes] = []
    with sh.read() as txn:
        cur = txn.cursor(db=lru)
        ok = cur.first()
        while freed < excess and len(chosen) < _SELECT_BATCH:
            ck = cur.key() if ok else None
            if ck is None and not heap:
                break
            if heap and (ck is None or heap[0] < ck):
                lk = heapq.heappop(heap)
            else:
                lk = ck
                ok = cur.next()
            key = lk[8:]  # the dbkey
            if protect is not None and protect(key[KEY_BYTES:]):
                continue
            rec = lookup_record(txn, blocks, key)
            if rec is None:
                continue
            chosen.append(key)
            freed += rec.stored_nbytes
            p = parent_dbkey(rec)
            if p is not None:
                n = sim.get(p)
                if n is None:
                    c = txn.get(p, db=children_db)
                    n = 0 if c is None else U32.unpack(c)[0]
                n -= 1
                sim[p] = n
                if n == 0:
                    praw = txn.get(p, db=blocks)
                    if praw is not None:
                        with contextlib.suppress(RecordError):
                            heapq.heappush(heap, lru_key(decode_record(praw).last_access_us, p))
    return chosen
