"""A synthetic index: records without payload, inserted straight into the index, for timing
what depends only on the index's size (reopening a large store, ``leading_run``). The records
point at segment files that do not exist: only opening, lookups, listing and stats are
meaningful on such a store. :meth:`DiskTier.add_synthetic_records
<kvstore.tiers.disk.DiskTier.add_synthetic_records>` hands this module its context;
:func:`kvstore.tiers.disk.populate_fake_index` builds a whole store so (the ``disk``
benchmark's reopen row, the disk tier's tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvstore.tiers.disk import txn as _txn
from kvstore.tiers.disk.index import (
    BE64,
    DB_BLOCKS,
    DB_CHILDREN,
    DB_LRU,
    DB_META,
    DB_SEGS,
    META_NEXT_SEGMENT,
    META_TOTALS,
    TOTALS,
    U32,
    U64,
    Rec,
    SegInfo,
    encode_record,
    encode_seginfo,
    lru_key,
)

if TYPE_CHECKING:
    from kvstore.namespace import Namespace
    from kvstore.tiers.disk.context import DiskContext

SEGMENT_BLOCKS = 128  # records per fake segment
CHAIN_BLOCKS = 16  # records per chain (parent links within a transaction's sorted keys)
_T0_US = 1_700_000_000_000_000  # created / last access of record i: _T0_US + i


def add_records(ctx: DiskContext, ns: Namespace, n: int, *, txn_size: int = 250_000) -> None:
    """Insert ``n`` records of the registered namespace ``ns`` in write transactions of
    ``txn_size`` records: random keys (seeded: the same index every time), sorted within a
    transaction and chained 16 at a time, each chain's leaf in the LRU index, 128 records per
    fake segment, the totals and the next segment id kept consistent. Meant for an empty
    index: segment ids and access times start from fixed values."""
    sh = ctx.sh
    nb = ns.layout.block_nbytes
    seg_blocks = SEGMENT_BLOCKS
    done = 0
    rng = np.random.default_rng(0)
    while done < n:
        m = min(txn_size, n - done)
        keys = rng.integers(0, 256, (m, 32), dtype=np.uint8)
        keys[:, 0] = rng.integers(0, 256, m)  # random: inserted unsorted below, sorted first
        kb = sorted(bytes(r) for r in keys)
        first = done

        def fn(txn, kb=kb, first=first, m=m):
            blocks, children, lru, segs, meta = (sh.dbs[DB_BLOCKS], sh.dbs[DB_CHILDREN],
                                                 sh.dbs[DB_LRU], sh.dbs[DB_SEGS],
                                                 sh.dbs[DB_META])
            recs = []
            kids = []
            leaves = []
            for j, k in enumerate(kb):
                i = first + j
                parent = kb[j - 1] if j % CHAIN_BLOCKS else None
                if parent is not None:
                    kids.append((ns.id + parent, U32.pack(1)))
                if j % CHAIN_BLOCKS == CHAIN_BLOCKS - 1 or j == m - 1:
                    leaves.append((lru_key(_T0_US + i, ns.id + k), b""))
                recs.append((ns.id + k, encode_record(Rec(
                    0, 0, 1 + i // seg_blocks, 4096 + (i % seg_blocks) * nb, nb, nb, 0,
                    _T0_US + i, _T0_US + i, ns.id, parent))))
            txn.cursor(db=blocks).putmulti(recs, append=False)
            txn.cursor(db=children).putmulti(kids)
            txn.cursor(db=lru).putmulti(leaves)
            nseg0 = first // seg_blocks
            nseg1 = (first + m - 1) // seg_blocks
            for s in range(nseg0, nseg1 + 1):
                cnt = min(seg_blocks, first + m - s * seg_blocks)
                txn.put(BE64.pack(1 + s), encode_seginfo(SegInfo(
                    cnt, 4096 + seg_blocks * nb, seg_blocks * nb, cnt * nb, 0)), db=segs)
            tot = list(TOTALS.unpack(txn.get(META_TOTALS, db=meta)))
            tot[0] += m
            tot[1] += m * nb
            tot[2] += m * nb
            nsegs = (first + m + seg_blocks - 1) // seg_blocks
            tot[3] = nsegs
            tot[4] = nsegs * (4096 + seg_blocks * nb)
            tot[5] = nsegs * seg_blocks * nb
            txn.put(META_TOTALS, TOTALS.pack(*tot), db=meta)
            txn.put(META_NEXT_SEGMENT, U64.pack(nsegs + 1), db=meta)

        _txn.write_raw(ctx, fn)
        done += m
