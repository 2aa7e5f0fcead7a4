"""A disk tier whose index holds many records without their payload: what the ``disk``
benchmark reopens to time a large index (``populate_fake_index``). The records point at
segment files that do not exist: only opening, ``leading_run`` and other index-only operations
are meaningful on such a store.

The disk tier's tests use it too (re-exported by ``tests/support/disk.py``). Nothing in the
store imports this module.
"""

from __future__ import annotations

import numpy as np

from kvstore.namespace import Namespace
from kvstore.tiers.disk import DiskTier


def populate_fake_index(path: str, n: int, ns: Namespace, *, txn_size: int = 250_000) -> None:
    """Create a disk tier whose index holds ``n`` records pointing at fake segments (no
    payload files), inserted directly in a few big LMDB transactions: chains of 16 blocks,
    leaves in the LRU index, consistent totals. For reopen-time measurements only."""
    from kvstore.tiers.disk import index as di

    t = DiskTier(path, capacity_bytes=1 << 50)
    t.register_namespace(ns)
    sh = t._sh
    nb = ns.layout.block_nbytes
    seg_blocks = 128
    done = 0
    rng = np.random.default_rng(0)
    while done < n:
        m = min(txn_size, n - done)
        keys = rng.integers(0, 256, (m, 32), dtype=np.uint8)
        keys[:, 0] = rng.integers(0, 256, m)  # random: inserted unsorted below, sorted first
        kb = sorted(bytes(r) for r in keys)
        first = done

        def fn(txn, kb=kb, first=first, m=m):
            blocks, children, lru, segs, meta = (sh.dbs[di.DB_BLOCKS], sh.dbs[di.DB_CHILDREN],
                                                 sh.dbs[di.DB_LRU], sh.dbs[di.DB_SEGS],
                                                 sh.dbs[di.DB_META])
            recs = []
            kids = []
            leaves = []
            for j, k in enumerate(kb):
                i = first + j
                parent = kb[j - 1] if j % 16 else None
                if parent is not None:
                    kids.append((ns.id + parent, di.U32.pack(1)))
                if j % 16 == 15 or j == m - 1:
                    leaves.append((di.lru_key(1_700_000_000_000_000 + i, ns.id + k), b""))
                recs.append((ns.id + k, di.encode_record(di.Rec(
                    0, 0, 1 + i // seg_blocks, 4096 + (i % seg_blocks) * nb, nb, nb, 0,
                    1_700_000_000_000_000 + i, 1_700_000_000_000_000 + i, ns.id, parent))))
            txn.cursor(db=blocks).putmulti(recs, append=False)
            txn.cursor(db=children).putmulti(kids)
            txn.cursor(db=lru).putmulti(leaves)
            nseg0 = first // seg_blocks
            nseg1 = (first + m - 1) // seg_blocks
            for s in range(nseg0, nseg1 + 1):
                cnt = min(seg_blocks, first + m - s * seg_blocks)
                txn.put(di.BE64.pack(1 + s), di.encode_seginfo(di.SegInfo(
                    cnt, 4096 + seg_blocks * nb, seg_blocks * nb, cnt * nb, 0)), db=segs)
            tot = list(di.TOTALS.unpack(txn.get(di.META_TOTALS, db=meta)))
            tot[0] += m
            tot[1] += m * nb
            tot[2] += m * nb
            nsegs = (first + m + seg_blocks - 1) // seg_blocks
            tot[3] = nsegs
            tot[4] = nsegs * (4096 + seg_blocks * nb)
            tot[5] = nsegs * seg_blocks * nb
            txn.put(di.META_TOTALS, di.TOTALS.pack(*tot), db=meta)
            txn.put(di.META_NEXT_SEGMENT, di.U64.pack(nsegs + 1), db=meta)

        t._write_raw(fn)
        done += m
    t.close()
