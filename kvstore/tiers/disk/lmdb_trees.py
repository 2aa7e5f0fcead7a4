"""The B-tree walk of the index validation (``docs/format.md``, "Index validation"):
:func:`check_trees` checks every B-tree page reachable from the current meta page — page
header (number, type, bounds), node pointers and sizes inside the page, child page numbers,
strictly increasing keys within the parent's separator range, overflow runs, equal leaf
depth, the per-database page and entry counts LMDB keeps, the free list (in range, not
reachable, no duplicates) and the kvstore schema of every named database (key and value
sizes, namespace records hashing to their ids). Above ``full_pages`` pages only the main and
free databases and the root page of each named database are walked (bounded time at open).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.tiers.disk import index as di
from kvstore.tiers.disk.lmdb_meta import (
    DB,
    F_BIGDATA,
    F_SUBDATA,
    MAX_DEPTH,
    MAX_KEY,
    NODE,
    NODESIZE,
    P_BRANCH,
    P_INVALID,
    P_LEAF,
    P_OVERFLOW,
    PAGEHDR,
    PAGEHDRSZ,
    DbStat,
    IndexDamage,
    Meta,
    Pages,
    cut_off,
    db_stat,
)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_BATCH_PAGES = 4096
#: data.mdb sizes up to this many pages are walked completely at open
DEFAULT_FULL_PAGES = int(os.environ.get("KVSTORE_INDEX_CHECK_PAGES", "16384"))

#: ``schema(key, value) -> None`` raises IndexDamage (a message) when an entry is malformed
Schema = Callable[[bytes, bytes], None]
#: ``leaf_fn(key, value, node flags)``, called per entry of a walked leaf page
LeafFn = Callable[[bytes, bytes | None, int], None]


@dataclass(frozen=True, slots=True)
class TreeReport:
    """What :func:`check_trees` found (a valid index)."""

    txnid: int
    pages: int  # last_pg + 1
    full: bool  # every leaf page walked
    databases: dict[str, int]  # named database -> entries
    free_pages: int


class _Walk:
    def __init__(self, pages: Pages, meta: Meta, *, full: bool) -> None:
        self.p = pages
        self.m = meta
        self.last = meta.last_pg
        self.ps = meta.psize
        self.full = full
        self.seen = bytearray(meta.last_pg + 1)
        self.seen[0] = self.seen[1] = 1

    def _mark(self, pgno: int, what: str) -> None:
        if not 2 <= pgno <= self.last:
            raise IndexDamage(f"{what} points at page {pgno}, outside pages 2..{self.last}")
        if self.seen[pgno]:
            raise IndexDamage(f"{what}: page {pgno} is reached twice (a cycle or a shared page)")
        self.seen[pgno] = 1

    def tree(self, name: str, db: DbStat, leaf_fn: LeafFn, *, intkey: bool = False,
             leaves: bool = True, fixed: tuple[tuple[int, ...], int] | None = None) -> None:
        """Walk one B-tree. ``leaf_fn(key, value, node flags)`` per entry (an F_BIGDATA
        value is read from its overflow run).

        ``fixed=(key sizes, value size)``: every entry has one of these key sizes (all the
        same) and exactly this value size, inline; the leaf pages are then checked together,
        vectorized (``leaf_fn`` is not called)."""
        if db.root == P_INVALID:
            if db.depth or db.entries:
                raise IndexDamage(f"database {name}: empty but depth {db.depth}, "
                                  f"{db.entries} entries")
            return
        if not 1 <= db.depth <= MAX_DEPTH:
            raise IndexDamage(f"database {name} has depth {db.depth}")
        counts = [0, 0, 0, 0]  # branch, leaf, overflow pages, entries
        self._mark(db.root, f"database {name} root")
        # (pgno, level, low key or None, high key or None)
        stack: list[tuple[int, int, object, object]] = [(db.root, 1, None, None)]
        batch: list[tuple[int, object, object]] = []
        while stack:
            pgno, level, lo, hi = stack.pop()
            is_leaf = level == db.depth
            if not leaves and level > 1:
                continue  # bounded mode: the root page only (its children are range-checked)
            if is_leaf and fixed is not None:
                batch.append((pgno, lo, hi))
                if len(batch) >= _BATCH_PAGES:
                    self._leaf_batch(name, batch, fixed, counts)
                    batch = []
                continue
            stack.extend(reversed(self._page(name, db, (pgno, level, lo, hi), leaf_fn,
                                             intkey, counts)))
        if batch:
            self._leaf_batch(name, batch, fixed, counts)  # type: ignore[arg-type]
        if leaves:
            got = (counts[0], counts[1], counts[2], counts[3])
            exp = (db.branch_pages, db.leaf_pages, db.overflow_pages, db.entries)
            if got != exp:
                raise IndexDamage(f"database {name}: walked {got[0]} branch, {got[1]} leaf, "
                                  f"{got[2]} overflow pages and {got[3]} entries; its record "
                                  f"says {exp[0]}, {exp[1]}, {exp[2]} and {exp[3]}")

    def _page(self, name: str, db: DbStat, at: tuple[int, int, object, object],
              leaf_fn: LeafFn, intkey: bool,
              counts: list[int]) -> list[tuple[int, int, object, object]]:
        """Check one page at ``at`` = (pgno, level, low key, high key): its nodes, in order,
        inside the separator range. A leaf's entries go to ``leaf_fn``; a branch returns its
        children as ``at`` tuples (child j covers [sep_j, sep_{j+1}), the last one ``hi``)."""
        pgno, level, lo, hi = at
        is_leaf = level == db.depth
        ps = self.ps
        page = self.p.get(pgno)
        where = f"database {name}, page {pgno}"
        ptrs, upper = self._header(page, pgno, where, level, db.depth)
        unpack_node = NODE.unpack_from
        prev = None
        children: list[tuple[int, int, object, object]] = []
        for i, ptr in enumerate(ptrs):
            if ptr < upper or ptr + NODESIZE > ps or ptr & 1:
                raise IndexDamage(f"{where}: node {i} at offset {ptr} (upper {upper})")
            nlo, nhi, nflags, ksize = unpack_node(page, ptr)
            kend = ptr + NODESIZE + ksize
            if ksize > MAX_KEY or kend > ps:
                raise IndexDamage(f"{where}: node {i} has a key of {ksize} bytes")
            raw_key = page[ptr + NODESIZE:kend]
            if intkey:
                if ksize != 8 and not (not is_leaf and i == 0 and ksize == 0):
                    raise IndexDamage(f"{where}: integer key of {ksize} bytes")
                key: object = _U64.unpack(raw_key)[0] if ksize == 8 else None
            else:
                key = raw_key
            if not is_leaf and i == 0:
                key = None  # the leftmost branch key is implicit (lower bound)
            else:
                if prev is not None and not prev < key:  # type: ignore[operator]
                    raise IndexDamage(f"{where}: keys out of order at node {i}")
                if i == (0 if is_leaf else 1) and lo is not None and key < lo:  # type: ignore[operator]
                    raise IndexDamage(f"{where}: key below its parent's separator")
                prev = key
            if is_leaf:
                self._leaf_node(page, i, (nlo | (nhi << 16), nflags, raw_key, kend), where,
                                leaf_fn, counts)
            else:
                child = nlo | (nhi << 16) | (nflags << 32)
                self._mark(child, f"{where} node {i}")
                children.append((child, level + 1, key, None))
        if prev is not None and hi is not None and not prev < hi:  # type: ignore[operator]
            raise IndexDamage(f"{where}: key at or above its parent's next separator")
        if is_leaf:
            counts[1] += 1
            return []
        counts[0] += 1
        for j in range(len(children)):
            c, lv, k, _ = children[j]
            nxt = children[j + 1][2] if j + 1 < len(children) else hi
            children[j] = (c, lv, k if k is not None else lo, nxt)
        return children

    def _header(self, page: bytes, pgno: int, where: str, level: int,
                depth: int) -> tuple[tuple[int, ...], int]:
        """The node pointers of a page whose header checks out, and its ``upper`` bound."""
        is_leaf = level == depth
        hp, _pad, flags, lower, upper = PAGEHDR.unpack_from(page, 0)
        if hp != pgno:
            raise IndexDamage(f"{where}: header says page {hp}")
        want = P_LEAF if is_leaf else P_BRANCH
        if flags != want:
            raise IndexDamage(f"{where}: flags {flags:#x}, expected a "
                              f"{'leaf' if is_leaf else 'branch'} page at level {level} of "
                              f"{depth}")
        if not (PAGEHDRSZ <= lower <= upper <= self.ps) or lower & 1:
            raise IndexDamage(f"{where}: bounds lower={lower} upper={upper}")
        n = (lower - PAGEHDRSZ) >> 1
        if n == 0:
            raise IndexDamage(f"{where}: no nodes")
        return struct.unpack_from(f"<{n}H", page, PAGEHDRSZ), upper

    def _leaf_node(self, page: bytes, i: int, node: tuple[int, int, bytes, int], where: str,
                   leaf_fn: LeafFn, counts: list[int]) -> None:
        """One leaf entry, ``node`` = (data size, flags, key, end of the key in the page),
        handed to ``leaf_fn`` with its value (inline or from its overflow run)."""
        dsize, nflags, raw_key, kend = node
        ps = self.ps
        if nflags & ~(F_BIGDATA | F_SUBDATA) or nflags == F_BIGDATA | F_SUBDATA:
            raise IndexDamage(f"{where}: node {i} has flags {nflags:#x}")
        if nflags & F_BIGDATA:
            if kend + 8 > ps:
                raise IndexDamage(f"{where}: node {i} overflow pointer cut off")
            (opg,) = _U64.unpack_from(page, kend)
            npg = self._overflow(opg, dsize, where, counts)
            leaf_fn(raw_key, self.p.get(opg, npg)[PAGEHDRSZ:PAGEHDRSZ + dsize], nflags)
        else:
            if kend + dsize > ps:
                raise IndexDamage(f"{where}: node {i} value of {dsize} bytes runs "
                                  "past the page")
            leaf_fn(raw_key, page[kend:kend + dsize], nflags)
        counts[3] += 1

    def _leaf_batch(self, name: str, batch: list[tuple[int, object, object]],
                    fixed: tuple[tuple[int, ...], int], counts: list[int]) -> None:
        """Leaf pages of a fixed-size database, in key order, checked with array operations:
        headers, node pointers, node headers and sizes, and that the keys of all of them
        together increase strictly and stay inside each page's separator range."""
        klens, vlen = fixed
        ps = self.ps
        pg = np.fromiter((b[0] for b in batch), dtype=np.int64, count=len(batch))
        P = self.p.many(pg)
        P16 = P.view("<u2")
        hdr_pg = P[:, :8].copy().view("<u8")[:, 0]
        flags, lower, upper = (P16[:, 5].astype(np.int64), P16[:, 6].astype(np.int64),
                               P16[:, 7].astype(np.int64))

        def bad(mask: np.ndarray, what: str) -> None:
            if mask.any():
                j = int(np.flatnonzero(mask)[0])
                raise IndexDamage(f"database {name}, page {int(pg[j])}: {what}")

        bad(hdr_pg != pg.astype(np.uint64), "page header names another page")
        bad(flags != P_LEAF, "not a leaf page at the leaf level")
        bad((lower < PAGEHDRSZ) | (lower > upper) | (upper > ps) | (lower & 1 == 1),
            "page bounds out of range")
        n = (lower - PAGEHDRSZ) >> 1
        bad(n == 0, "no nodes")
        N = int(n.sum())
        starts = np.cumsum(n) - n
        page_of = np.repeat(np.arange(len(pg)), n)
        slot = np.arange(N) - np.repeat(starts, n)
        ptr = P16[page_of, 8 + slot].astype(np.int64)
        badn = (ptr < upper[page_of]) | (ptr & 1 == 1) | (ptr + NODESIZE > ps)
        bad(np.bincount(page_of, weights=badn, minlength=len(pg)) > 0, "node pointer out of range")
        base = ptr >> 1
        dsz = P16[page_of, base].astype(np.int64) | (P16[page_of, base + 1].astype(np.int64) << 16)
        nfl = P16[page_of, base + 2]
        ks = P16[page_of, base + 3].astype(np.int64)
        K = int(ks[0])
        if K not in klens:
            raise IndexDamage(f"database {name}, page {int(pg[0])}: a {K}-byte key, expected "
                              f"{' or '.join(map(str, klens))}")
        badn = (ks != K) | (dsz != vlen) | (nfl != 0) | (ptr + NODESIZE + K + vlen > ps)
        if badn.any():
            j = int(np.flatnonzero(badn)[0])
            raise IndexDamage(f"database {name}, page {int(pg[page_of[j]])}: an entry has a "
                              f"{int(ks[j])}-byte key and a {int(dsz[j])}-byte value (flags "
                              f"{int(nfl[j]):#x}), expected {K} and {vlen}")
        keys = np.lib.stride_tricks.sliding_window_view(P.reshape(-1), K)[
            page_of * ps + ptr + NODESIZE]  # [N, K]: one row copy per key
        if N > 1:
            # lexicographic order = order of the big-endian words (keys are multiples of 8)
            words = keys.view(">u8") if K % 8 == 0 else keys
            a, b = words[:-1], words[1:]
            ne = a != b
            first = ne.argmax(axis=1)
            r = np.arange(N - 1)
            up = ne.any(axis=1) & (b[r, first] > a[r, first])
            if not up.all():
                j = int(np.flatnonzero(~up)[0]) + 1
                raise IndexDamage(f"database {name}, page {int(pg[page_of[j]])}: keys out of "
                                  "order")
        ends = starts + n - 1
        for j, (_pg, lo, hi) in enumerate(batch):
            if lo is not None and keys[starts[j]].tobytes() < lo:  # type: ignore[operator]
                raise IndexDamage(f"database {name}, page {int(pg[j])}: key below its "
                                  "parent's separator")
            if hi is not None and not keys[ends[j]].tobytes() < hi:  # type: ignore[operator]
                raise IndexDamage(f"database {name}, page {int(pg[j])}: key at or above its "
                                  "parent's next separator")
        counts[1] += len(pg)
        counts[3] += N

    def _overflow(self, opg: int, dsize: int, where: str, counts: list[int]) -> int:
        ps = self.ps
        npages = (PAGEHDRSZ - 1 + dsize) // ps + 1  # OVPAGES
        if opg < 2 or opg + npages - 1 > self.last:
            raise IndexDamage(f"{where}: overflow run {opg}+{npages} outside the file")
        head = self.p.get(opg)
        hp, _pad, flags = struct.unpack_from("<QHH", head, 0)
        (pages,) = _U32.unpack_from(head, 12)
        if hp != opg or flags != P_OVERFLOW or pages != npages:
            raise IndexDamage(f"{where}: overflow page {opg} has header {hp}/{flags:#x}/{pages}, "
                              f"expected {opg}/{P_OVERFLOW:#x}/{npages}")
        for q in range(opg, opg + npages):
            self._mark(q, f"{where} overflow")
        counts[2] += npages
        return npages


# -- the kvstore schema of the named databases ---------------------------------------------------

def _fixed_schemas() -> dict[bytes, tuple[tuple[int, ...], int]]:
    # block keys are the 32-byte key or namespace id ‖ key (64): both are accepted here; the
    # values are what code unpacks with fixed-size structs, so their sizes are exact
    return {di.DB_BLOCKS: ((32, 64), di.RECORD.size), di.DB_CHILDREN: ((32, 64), 4),
            di.DB_LRU: ((40, 72), 0), di.DB_SEGS: ((8,), di.SEGINFO.size)}


_FIXED: dict[bytes, tuple[tuple[int, ...], int]] = _fixed_schemas()


def _named_schema(name: bytes) -> Schema | None:
    if name in _FIXED:
        klens, vlen = _FIXED[name]

        def check(k: bytes, v: bytes | None, _kl=klens, _vl=vlen) -> None:
            if len(k) not in _kl or v is None or len(v) != _vl:
                raise IndexDamage(f"database {name.decode()}: an entry has a {len(k)}-byte key "
                                  f"and a {'large' if v is None else len(v)}-byte value, "
                                  f"expected {' or '.join(map(str, _kl))} and {_vl}")
        return check
    if name == di.DB_NS:
        def check_ns(k: bytes, v: bytes | None) -> None:
            # a namespace record is stored under the id its fields hash to: a flipped byte in
            # it (a model id, a dtype, a layout field) is damage, never another namespace
            if len(k) != 32 or v is None:
                raise IndexDamage(f"database ns: a {len(k)}-byte key")
            try:
                fields = di.decode_namespace(v)
            except di.RecordError as e:
                raise IndexDamage(f"database ns: record {k.hex()[:16]}: {e}") from None
            if di.namespace_record_id(fields) != k:
                raise IndexDamage(f"database ns: record {k.hex()[:16]} does not hash to its id")
        return check_ns
    if name == di.DB_META:
        sizes = {di.META_FORMAT: 4, di.META_NEXT_SEGMENT: 8, di.META_TOTALS: di.TOTALS.size}

        def check_meta_db(k: bytes, v: bytes | None) -> None:
            want = sizes.get(k)
            if want is not None and (v is None or len(v) != want):
                raise IndexDamage(f"database meta: {k!r} has a "
                                  f"{'large' if v is None else len(v)}-byte value, expected {want}")
        return check_meta_db
    return None


def check_trees(fd: int, meta: Meta, *, full_pages: int | None = None,
                required: tuple[bytes, ...] = ()) -> TreeReport:
    """Walk the trees of ``meta`` (from :func:`read_meta`); IndexDamage when anything is off.

    ``required``: named databases that must exist (when the main database is not empty).

    The file may end before ``meta``'s last page (:class:`ShortFile`) only when every page
    past its end is on the free list: LMDB does not write a page that one transaction
    allocated and freed again, and never reads a free page; any other page past the end is
    cut off (LMDB would take a SIGBUS on it)."""
    npages = meta.last_pg + 1
    # after ``meta`` was read: the file only grows, and a page is written before the meta
    # page that names it
    present = os.fstat(fd).st_size // meta.psize
    limit = DEFAULT_FULL_PAGES if full_pages is None else full_pages
    full = npages <= limit
    pages = Pages(fd, meta.psize, npages, preload=full and npages * meta.psize <= (256 << 20),
                  present=present)
    w = _Walk(pages, meta, full=full)
    subdbs: list[tuple[bytes, DbStat]] = []

    def main_leaf(k: bytes, v: bytes | None, nflags: int) -> None:
        if nflags != F_SUBDATA or v is None or len(v) != DB.size:
            raise IndexDamage(f"main database: entry {k[:40]!r} is not a named database")
        subdbs.append((k, db_stat(v, 0)))

    w.tree("(main)", meta.main, main_leaf)
    found: dict[str, int] = {}
    for name, db in subdbs:
        label = name.decode("ascii", "replace")
        if db.flags != 0:
            raise IndexDamage(f"database {label} has flags {db.flags:#x} (kvstore uses none)")
        schema = _named_schema(name)
        # array checks pay off from a few dozen leaf pages on; below, node by node
        fixed = _FIXED.get(name) if db.leaf_pages >= 32 else None

        def leaf(k: bytes, v: bytes | None, nflags: int, _s=schema, _l=label) -> None:
            if nflags & F_SUBDATA:
                raise IndexDamage(f"database {_l}: a nested database")
            if _s is not None:
                _s(k, v)

        w.tree(label, db, leaf, leaves=full, fixed=fixed)
        found[label] = db.entries
    if subdbs:
        missing = [n.decode() for n in required if n.decode() not in found]
        if missing:
            raise IndexDamage(f"named database(s) {', '.join(missing)} missing")
    free_pgnos: list[int] = []
    txnid = meta.txnid

    def free_leaf(k: bytes, v: bytes | None, nflags: int) -> None:
        (tid,) = _U64.unpack(k)
        if tid > txnid:
            raise IndexDamage(f"free list entry of txn {tid}, after the current txn {txnid}")
        if v is None or len(v) < 8 or len(v) % 8:
            raise IndexDamage(f"free list entry of txn {tid} has {len(v)} bytes")
        (n,) = _U64.unpack_from(v, 0)
        if 8 * (n + 1) != len(v):
            raise IndexDamage(f"free list entry of txn {tid} counts {n} pages in {len(v)} bytes")
        free_pgnos.extend(struct.unpack_from(f"<{n}Q", v, 8))

    w.tree("(free)", meta.free, free_leaf, intkey=True)
    # every page reached is known only after a full walk; otherwise: range and duplicates
    seen = w.seen if full else bytearray(meta.last_pg + 1)
    last = meta.last_pg
    for pg in free_pgnos:
        if not 2 <= pg <= last:
            raise IndexDamage(f"the free list names page {pg}, outside pages 2..{last}")
        if seen[pg]:
            raise IndexDamage(f"the free list names page {pg}, which is in use (or listed twice)")
        seen[pg] = 1
    if present < npages:
        free = set(free_pgnos)
        if not all(pg in free for pg in range(present, npages)):
            raise IndexDamage(cut_off(meta, os.fstat(fd).st_size))
    return TreeReport(txnid, npages, full, found, len(free_pgnos))

