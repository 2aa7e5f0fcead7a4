"""Validation of the disk index *before* LMDB maps it (``docs/format.md``, "Index validation").

LMDB trusts its file: a ``data.mdb`` shorter than its own metadata says is mapped anyway and
the first access past the end is a SIGBUS; a zeroed or bit-flipped page makes it fail an
internal assertion (SIGABRT) or read garbage node sizes. Nothing above LMDB can catch those,
so the disk tier checks the file with plain file I/O first and refuses a damaged index with
:class:`~kvstore.errors.StoreCorruptError` (which names ``kvstore recover``).

Two levels:

* :func:`read_meta` — the two meta pages (magic, version, page size, last page, txnid, the
  roots of the free and main databases) against the file size. O(1), always.
* :func:`check_trees` — every B-tree page reachable from the current meta: page header
  (number, type, bounds), node pointers and sizes inside the page, child page numbers,
  strictly increasing keys within the parent's separator range, overflow runs, equal leaf
  depth, the per-database page and entry counts LMDB keeps, the free list (in range, not
  reachable, no duplicates) and the kvstore schema of every named database (key and value
  sizes, namespace records hashing to their ids). Above ``full_pages`` pages only the main
  and free databases and the root page of each named database are walked (bounded time at
  open: ~25 ms for 1,000,000 records, cold); :func:`check_index` / :func:`require_intact`
  walk everything.

The structures (LMDB 0.9, 64-bit little-endian) are described in ``docs/format.md``.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# -- LMDB 0.9 on-disk constants (mdb.c) ------------------------------------------------------
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_INTEGERKEY = 0x08
PAGEHDRSZ = 16
NODESIZE = 8
P_INVALID = (1 << 64) - 1
MAX_KEY = 511  # MDB_MAXKEYSIZE of LMDB 0.9
MAX_DEPTH = 32  # CURSOR_STACK: a deeper tree overflows LMDB's cursor stack
MIN_PSIZE, MAX_PSIZE = 512, 65536
#: the largest map LMDB is asked to use; a meta page claiming more is damaged
MAX_MAP = 1 << 48

_PAGEHDR = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper (overflow: pages u32 at 12)
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize (after the page header)
_DB = struct.Struct("<IHHQQQQQ")  # pad (psize in FREE_DBI), flags, depth, branch, leaf, overflow, entries, root
_TAIL = struct.Struct("<QQ")  # last_pg, txnid
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_META_DBS = PAGEHDRSZ + _META.size
_META_TAIL = _META_DBS + 2 * _DB.size

_BATCH_PAGES = 4096
#: data.mdb sizes up to this many pages are walked completely at open
DEFAULT_FULL_PAGES = int(os.environ.get("KVSTORE_INDEX_CHECK_PAGES", "16384"))


class IndexDamage(ValueError):
    """The LMDB file fails validation; the message says where and why."""


@dataclass(frozen=True, slots=True)
class DbStat:
    pad: int
    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int


@dataclass(frozen=True, slots=True)
class Meta:
    slot: int  # 0 or 1
    psize: int
    mapsize: int
    free: DbStat
    main: DbStat
    last_pg: int
    txnid: int


@dataclass(frozen=True, slots=True)
class TreeReport:
    """What :func:`check_trees` found (a valid index)."""

    txnid: int
    pages: int  # last_pg + 1
    full: bool  # every leaf page walked
    databases: dict[str, int]  # named database -> entries
    free_pages: int


# -- meta pages -------------------------------------------------------------------------------

def _db(b: bytes, off: int) -> DbStat:
    return DbStat(*_DB.unpack_from(b, off))


def _parse_meta(page: bytes, slot: int) -> Meta:
    if len(page) < _META_TAIL + _TAIL.size:
        raise IndexDamage(f"meta page {slot} is cut off")
    pgno, _pad, flags, _lo, _up = _PAGEHDR.unpack_from(page, 0)
    if pgno != slot or not flags & P_META:
        raise IndexDamage(f"page {slot} is not an LMDB meta page (page number {pgno}, "
                          f"flags {flags:#x})")
    magic, version, address, mapsize = _META.unpack_from(page, PAGEHDRSZ)
    if magic != MDB_MAGIC:
        raise IndexDamage(f"meta page {slot} has magic {magic:#x}, not {MDB_MAGIC:#x}")
    if version != MDB_DATA_VERSION:
        raise IndexDamage(f"meta page {slot} has LMDB data version {version}, expected "
                          f"{MDB_DATA_VERSION}")
    if address != 0:
        raise IndexDamage(f"meta page {slot} has a fixed map address {address:#x}")
    free = _db(page, _META_DBS)
    main = _db(page, _META_DBS + _DB.size)
    last_pg, txnid = _TAIL.unpack_from(page, _META_TAIL)
    return Meta(slot, free.pad, mapsize, free, main, last_pg, txnid)


def read_meta(fd: int, size: int | None = None) -> Meta:
    """The meta page LMDB will use (the higher txnid), checked against the file size.

    LMDB refuses the file unless both meta pages have the right magic and version, so both
    are checked; then the current one must describe a file that fits: page size a power of
    two in [512, 65536], ``(last_pg + 1) * psize <= file size``, database roots and depths
    in range."""
    if size is None:
        size = os.fstat(fd).st_size
    first = os.pread(fd, _META_TAIL + _TAIL.size, 0)
    m0 = _parse_meta(first, 0)
    psize = m0.psize
    if psize < MIN_PSIZE or psize > MAX_PSIZE or psize & (psize - 1):
        raise IndexDamage(f"meta page 0 has page size {psize}")
    if size < 2 * psize:
        raise IndexDamage(f"data.mdb has {size} bytes, less than its two meta pages "
                          f"({2 * psize} bytes)")
    m1 = _parse_meta(os.pread(fd, _META_TAIL + _TAIL.size, psize), 1)
    cur = m1 if m1.txnid > m0.txnid else m0  # mdb_env_pick_meta
    check_meta(cur, size, psize)
    return cur


def check_meta(m: Meta, size: int, psize: int) -> None:
    if m.psize != psize:
        raise IndexDamage(f"meta page {m.slot} has page size {m.psize}, meta page 0 {psize}")
    need = (m.last_pg + 1) * psize
    if m.last_pg < 1 or m.last_pg >= (1 << 48) // psize:
        raise IndexDamage(f"meta page {m.slot} has last page {m.last_pg}")
    if need > size:
        raise IndexDamage(
            f"data.mdb has {size} bytes but its meta page {m.slot} (txn {m.txnid}) says it has "
            f"{m.last_pg + 1} pages of {psize} bytes ({need} bytes): the file is cut off")
    if not need <= m.mapsize <= MAX_MAP:
        raise IndexDamage(f"meta page {m.slot} has map size {m.mapsize} (file needs {need})")
    for name, db in (("free", m.free), ("main", m.main)):
        if db.root == P_INVALID:
            if db.depth or db.entries or db.branch_pages or db.leaf_pages or db.overflow_pages:
                raise IndexDamage(f"meta page {m.slot}: the empty {name} database has "
                                  f"depth {db.depth} and {db.entries} entries")
            continue
        if not 2 <= db.root <= m.last_pg:
            raise IndexDamage(f"meta page {m.slot}: the {name} database root is page "
                              f"{db.root}, outside pages 2..{m.last_pg}")
        if not 1 <= db.depth <= MAX_DEPTH:
            raise IndexDamage(f"meta page {m.slot}: the {name} database has depth {db.depth}")
    if m.free.flags != MDB_INTEGERKEY or m.main.flags != 0:
        raise IndexDamage(f"meta page {m.slot} has database flags {m.free.flags:#x}/"
                          f"{m.main.flags:#x}")


# -- the B-tree walk ------------------------------------------------------------------------

#: ``schema(key, value) -> None`` raises IndexDamage (a message) when an entry is malformed
Schema = Callable[[bytes, bytes], None]


class _Pages:
    """Pages by number with plain file I/O (the whole file read once when it is small)."""

    def __init__(self, fd: int, psize: int, npages: int, preload: bool) -> None:
        self.fd = fd
        self.psize = psize
        self.npages = npages
        self.arr: np.ndarray | None = None
        if preload:
            want = psize * npages
            arr = np.empty(want, dtype=np.uint8)
            view = memoryview(arr)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:]], got)
                if n <= 0:
                    break
                got += n
            if got != want:
                raise IndexDamage(f"data.mdb reads {got} of {want} bytes")
            self.arr = arr.reshape(npages, psize)

    def get(self, pgno: int, count: int = 1) -> bytes:
        ps = self.psize
        if self.arr is not None:
            return self.arr[pgno:pgno + count].tobytes()
        b = os.pread(self.fd, ps * count, pgno * ps)
        if len(b) != ps * count:
            raise IndexDamage(f"page {pgno} is cut off")
        return b

    def many(self, pgnos: np.ndarray) -> np.ndarray:
        """Pages ``pgnos`` as a ``[len, psize]`` uint8 array."""
        if self.arr is not None:
            return self.arr[pgnos]
        out = np.empty((len(pgnos), self.psize), dtype=np.uint8)
        for i, pg in enumerate(pgnos.tolist()):
            if os.preadv(self.fd, [out[i]], pg * self.psize) != self.psize:
                raise IndexDamage(f"page {pg} is cut off")
        return out


class _Walk:
    def __init__(self, pages: _Pages, meta: Meta, *, full: bool) -> None:
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

    def tree(self, name: str, db: DbStat, leaf_fn: Callable[[bytes, bytes | None, int], None],
             *, intkey: bool = False, leaves: bool = True,
             fixed: tuple[tuple[int, ...], int] | None = None) -> None:
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
        ps = self.ps
        counts = [0, 0, 0, 0]  # branch, leaf, overflow pages, entries
        self._mark(db.root, f"database {name} root")
        # (pgno, level, low key or None, high key or None)
        stack: list[tuple[int, int, object, object]] = [(db.root, 1, None, None)]
        batch: list[tuple[int, object, object]] = []
        unpack_node = _NODE.unpack_from
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
            page = self.p.get(pgno)
            where = f"database {name}, page {pgno}"
            hp, _pad, flags, lower, upper = _PAGEHDR.unpack_from(page, 0)
            if hp != pgno:
                raise IndexDamage(f"{where}: header says page {hp}")
            want = P_LEAF if is_leaf else P_BRANCH
            if flags != want:
                raise IndexDamage(f"{where}: flags {flags:#x}, expected a "
                                  f"{'leaf' if is_leaf else 'branch'} page at level {level} of "
                                  f"{db.depth}")
            if not (PAGEHDRSZ <= lower <= upper <= ps) or lower & 1:
                raise IndexDamage(f"{where}: bounds lower={lower} upper={upper}")
            n = (lower - PAGEHDRSZ) >> 1
            if n == 0:
                raise IndexDamage(f"{where}: no nodes")
            ptrs = struct.unpack_from(f"<{n}H", page, PAGEHDRSZ)
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
                    dsize = nlo | (nhi << 16)
                    if nflags & ~(F_BIGDATA | F_SUBDATA) or nflags == F_BIGDATA | F_SUBDATA:
                        raise IndexDamage(f"{where}: node {i} has flags {nflags:#x}")
                    if nflags & F_BIGDATA:
                        if kend + 8 > ps:
                            raise IndexDamage(f"{where}: node {i} overflow pointer cut off")
                        (opg,) = _U64.unpack_from(page, kend)
                        npg = self._overflow(opg, dsize, where, counts)
                        leaf_fn(raw_key, self.p.get(opg, npg)[PAGEHDRSZ:PAGEHDRSZ + dsize],
                                nflags)
                    else:
                        if kend + dsize > ps:
                            raise IndexDamage(f"{where}: node {i} value of {dsize} bytes runs "
                                              "past the page")
                        leaf_fn(raw_key, page[kend:kend + dsize], nflags)
                    counts[3] += 1
                else:
                    child = nlo | (nhi << 16) | (nflags << 32)
                    self._mark(child, f"{where} node {i}")
                    children.append((child, level + 1, key, None))
            if prev is not None and hi is not None and not prev < hi:  # type: ignore[operator]
                raise IndexDamage(f"{where}: key at or above its parent's next separator")
            if is_leaf:
                counts[1] += 1
            else:
                counts[0] += 1
                # child j covers [sep_j, sep_{j+1}); the last child inherits ``hi``
                for j in range(len(children)):
                    c, lv, k, _ = children[j]
                    nxt = children[j + 1][2] if j + 1 < len(children) else hi
                    children[j] = (c, lv, k if k is not None else lo, nxt)
                stack.extend(reversed(children))
        if batch:
            self._leaf_batch(name, batch, fixed, counts)  # type: ignore[arg-type]
        if leaves:
            got = (counts[0], counts[1], counts[2], counts[3])
            exp = (db.branch_pages, db.leaf_pages, db.overflow_pages, db.entries)
            if got != exp:
                raise IndexDamage(f"database {name}: walked {got[0]} branch, {got[1]} leaf, "
                                  f"{got[2]} overflow pages and {got[3]} entries; its record "
                                  f"says {exp[0]}, {exp[1]}, {exp[2]} and {exp[3]}")

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


def _fixed_schemas() -> dict[bytes, tuple[tuple[int, ...], int]]:
    from kvstore.tiers import disk_index as di

    # block keys are the 32-byte key or namespace id ‖ key (64): both are accepted here; the
    # values are what code unpacks with fixed-size structs, so their sizes are exact
    return {di.DB_BLOCKS: ((32, 64), di.RECORD.size), di.DB_CHILDREN: ((32, 64), 4),
            di.DB_LRU: ((40, 72), 0), di.DB_SEGS: ((8,), di.SEGINFO.size)}


_FIXED: dict[bytes, tuple[tuple[int, ...], int]] = {}


def _named_schema(name: bytes) -> Schema | None:
    from kvstore.tiers import disk_index as di

    if not _FIXED:
        _FIXED.update(_fixed_schemas())
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

    ``required``: named databases that must exist (when the main database is not empty)."""
    npages = meta.last_pg + 1
    limit = DEFAULT_FULL_PAGES if full_pages is None else full_pages
    full = npages <= limit
    pages = _Pages(fd, meta.psize, npages, preload=full and npages * meta.psize <= (256 << 20))
    w = _Walk(pages, meta, full=full)
    subdbs: list[tuple[bytes, DbStat]] = []

    def main_leaf(k: bytes, v: bytes | None, nflags: int) -> None:
        if nflags != F_SUBDATA or v is None or len(v) != _DB.size:
            raise IndexDamage(f"main database: entry {k[:40]!r} is not a named database")
        subdbs.append((k, _db(v, 0)))

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
    return TreeReport(txnid, npages, full, found, len(free_pgnos))


@dataclass(frozen=True, slots=True)
class IndexCheck:
    """Result of :func:`check_index`."""

    path: str
    ok: bool
    problem: str | None
    report: TreeReport | None


def validate_file(path: str, *, full_pages: int | None = None,
                  required: tuple[bytes, ...] = ()) -> TreeReport:
    """:func:`read_meta` + :func:`check_trees` of ``path`` (a data.mdb); IndexDamage."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise IndexDamage(f"cannot open {path}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise IndexDamage(f"{path} is empty")
        meta = read_meta(fd, size)
        return check_trees(fd, meta, full_pages=full_pages, required=required)
    except OSError as e:
        raise IndexDamage(f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def check_index(index_dir: str, *, full: bool = True) -> IndexCheck:
    """Validate ``index_dir/data.mdb`` completely (``full``: every leaf page, whatever the
    size). Never opens LMDB; never raises for damage."""
    from kvstore.tiers.disk_index import _DB_NAMES

    path = os.path.join(index_dir, "data.mdb")
    try:
        rep = validate_file(path, full_pages=(1 << 62) if full else None, required=_DB_NAMES)
    except IndexDamage as e:
        return IndexCheck(path, False, str(e), None)
    return IndexCheck(path, True, None, rep)


# -- what the disk index calls around opening LMDB ---------------------------------------------

def _corrupt_types() -> tuple[type[BaseException], ...]:
    import lmdb

    names = ("CorruptedError", "PageNotFoundError", "PanicError", "InvalidError",
             "VersionMismatchError", "BadTxnError", "IncompatibleError", "CursorFullError",
             "PageFullError")
    return tuple(getattr(lmdb, n) for n in names if hasattr(lmdb, n))


#: LMDB errors that mean a damaged file (never MapFull/MapResized, which are handled)
LMDB_CORRUPT: tuple[type[BaseException], ...] = _corrupt_types()


def store_of(index_dir: str) -> str:
    return os.path.dirname(os.path.abspath(index_dir))


def recover_hint(store: str) -> str:
    return (f"stop the engines using the store and run `kvstore recover --store {store}`: it "
            "rebuilds the index from the segment files (the damaged index is kept as "
            "index.damaged-<time>)")


def corrupt_error(index_dir: str, why: object):  # noqa: ANN201 - StoreCorruptError
    """StoreCorruptError for a damaged index at ``index_dir``, naming ``kvstore recover``."""
    from kvstore.errors import StoreCorruptError

    store = store_of(index_dir)
    return StoreCorruptError(f"the disk index of the store at {store} is damaged ({why}); "
                             f"nothing was changed. To use the store again, {recover_hint(store)}")


def segment_ids(segdir: str) -> tuple[list[int], int]:
    """Ids of the committed segment files in ``segdir`` and the largest id of any segment or
    temp file there (0 when none)."""
    from kvstore.tiers import segments as _seg

    ids: list[int] = []
    top = 0
    try:
        names = os.listdir(segdir)
    except (FileNotFoundError, NotADirectoryError):
        return ids, 0
    for name in names:
        m = _seg.SEGMENT_RE.match(name)
        if m:
            sid = int(m.group(1), 16)
            ids.append(sid)
            top = max(top, sid)
        else:
            m = _seg.TEMP_RE.match(name)
            if m:
                top = max(top, int(m.group(1), 16))
    return ids, top


def _missing_index(index_dir: str, state: str, nseg: int):  # noqa: ANN202
    from kvstore.errors import StoreCorruptError

    store = store_of(index_dir)
    return StoreCorruptError(
        f"the store at {store} has {nseg} segment file(s) but {state}: refusing to start an "
        f"empty index over them (their blocks would be lost). To use the store again, "
        f"{recover_hint(store)}")


def dir_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of a directory: LMDB opens lock.mdb and data.mdb by name one after
    the other, so a change across the open means the index was swapped in between."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def before_open(index_dir: str) -> None:
    """Checks before LMDB maps ``index_dir/data.mdb``: a missing or empty index beside
    segment files, and the meta pages of an existing one. Raises StoreCorruptError."""
    path = os.path.join(index_dir, "data.mdb")
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = -1
    except NotADirectoryError:
        size = -1
    if size <= 0:
        ids, _top = segment_ids(os.path.join(store_of(index_dir), "segments"))
        if ids:
            state = ("no index (index/data.mdb is missing)" if size < 0
                     else "an empty index (index/data.mdb has 0 bytes)")
            raise _missing_index(index_dir, state, len(ids))
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # unreadable (permissions): LMDB reports it
    try:
        read_meta(fd, os.fstat(fd).st_size)
    except IndexDamage as e:
        raise corrupt_error(index_dir, e) from None
    except OSError as e:
        raise corrupt_error(index_dir, f"cannot read data.mdb: {e.strerror}") from None
    finally:
        os.close(fd)


def check_snapshot(env, index_dir: str, *, full_pages: int | None = None) -> TreeReport:  # noqa: ANN001
    """Walk the trees of the committed state while a read transaction of ``env`` pins it (no
    writer in any process can reuse its pages meanwhile). Raises StoreCorruptError; also
    when the index holds no database at all but segment files exist."""
    from kvstore.tiers.disk_index import _DB_NAMES

    path = os.path.join(index_dir, "data.mdb")
    with env.begin():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise corrupt_error(index_dir, f"cannot open data.mdb: {e.strerror}") from None
        try:
            meta = read_meta(fd)
            rep = check_trees(fd, meta, full_pages=full_pages, required=_DB_NAMES)
        except IndexDamage as e:
            raise corrupt_error(index_dir, e) from None
        except OSError as e:
            raise corrupt_error(index_dir, f"cannot read data.mdb: {e.strerror}") from None
        finally:
            os.close(fd)
    if not rep.databases:
        ids, _top = segment_ids(os.path.join(store_of(index_dir), "segments"))
        if ids:
            raise _missing_index(index_dir, "an uninitialized index", len(ids))
    return rep


# -- for callers outside the disk tier (admin commands) ----------------------------------------

def missing_index_error(store: str):  # noqa: ANN201 - StoreCorruptError | None
    """The StoreCorruptError for a store directory whose ``segments/`` holds segment files
    but whose ``index/data.mdb`` is missing or empty (None otherwise)."""
    index_dir = os.path.join(store, "index")
    try:
        before_open(index_dir)
    except Exception as e:  # noqa: BLE001 - StoreCorruptError, returned
        from kvstore.errors import StoreCorruptError

        if isinstance(e, StoreCorruptError):
            return e
        raise
    return None


def require_intact(index_dir: str) -> TreeReport:
    """Walk ``index_dir/data.mdb`` completely, whatever its size (``kvstore verify``);
    StoreCorruptError naming ``kvstore recover`` when anything is off."""
    from kvstore.tiers.disk_index import _DB_NAMES

    before_open(index_dir)
    try:
        rep = validate_file(os.path.join(index_dir, "data.mdb"), full_pages=1 << 62,
                            required=_DB_NAMES)
    except IndexDamage as e:
        raise corrupt_error(index_dir, e) from None
    return rep
