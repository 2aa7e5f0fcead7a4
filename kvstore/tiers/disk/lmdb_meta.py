"""LMDB 0.9's on-disk layout (64-bit little-endian, ``mdb.c``) as the index validation reads
it with plain file I/O: the constants, the meta pages (:func:`read_meta`, :func:`check_meta`)
and a page reader. The structures are described in ``docs/format.md``; the B-tree walk is
:mod:`kvstore.tiers.disk.lmdb_trees`.
"""

from __future__ import annotations

import os
import struct
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

PAGEHDR = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper (overflow: pages u32 at 12)
META = struct.Struct("<IIQQ")  # magic, version, address, mapsize (after the page header)
DB = struct.Struct("<IHHQQQQQ")  # pad (psize in FREE_DBI), flags, depth, branch, leaf, overflow, entries, root
TAIL = struct.Struct("<QQ")  # last_pg, txnid
NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
META_DBS = PAGEHDRSZ + META.size
META_TAIL = META_DBS + 2 * DB.size


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


class ShortFile(IndexDamage):
    """data.mdb ends before the last page of its current meta page (every other check of the
    meta page passed). Not damage by itself: LMDB never writes a page that one transaction
    allocated and freed again, so a healthy file can end before pages that are all free;
    :func:`~kvstore.tiers.disk.lmdb_trees.check_trees` of :attr:`meta` decides."""

    def __init__(self, meta: Meta, size: int) -> None:
        super().__init__(cut_off(meta, size))
        self.meta = meta
        self.size = size


def cut_off(m: Meta, size: int) -> str:
    need = (m.last_pg + 1) * m.psize
    return (f"data.mdb has {size} bytes but its meta page {m.slot} (txn {m.txnid}) says it has "
            f"{m.last_pg + 1} pages of {m.psize} bytes ({need} bytes): the file is cut off")


# -- meta pages -------------------------------------------------------------------------------

def db_stat(b: bytes, off: int) -> DbStat:
    return DbStat(*DB.unpack_from(b, off))


def _parse_meta(page: bytes, slot: int) -> Meta:
    if len(page) < META_TAIL + TAIL.size:
        raise IndexDamage(f"meta page {slot} is cut off")
    pgno, _pad, flags, _lo, _up = PAGEHDR.unpack_from(page, 0)
    if pgno != slot or not flags & P_META:
        raise IndexDamage(f"page {slot} is not an LMDB meta page (page number {pgno}, "
                          f"flags {flags:#x})")
    magic, version, address, mapsize = META.unpack_from(page, PAGEHDRSZ)
    if magic != MDB_MAGIC:
        raise IndexDamage(f"meta page {slot} has magic {magic:#x}, not {MDB_MAGIC:#x}")
    if version != MDB_DATA_VERSION:
        raise IndexDamage(f"meta page {slot} has LMDB data version {version}, expected "
                          f"{MDB_DATA_VERSION}")
    if address != 0:
        raise IndexDamage(f"meta page {slot} has a fixed map address {address:#x}")
    free = db_stat(page, META_DBS)
    main = db_stat(page, META_DBS + DB.size)
    last_pg, txnid = TAIL.unpack_from(page, META_TAIL)
    return Meta(slot, free.pad, mapsize, free, main, last_pg, txnid)


def read_meta(fd: int, size: int | None = None) -> Meta:
    """The meta page LMDB will use (the higher txnid), checked against the file size.

    LMDB refuses the file unless both meta pages have the right magic and version, so both
    are checked; then the current one must describe a file that fits: page size a power of
    two in [512, 65536], database roots and depths in range, and ``(last_pg + 1) * psize <=
    file size`` (else :class:`ShortFile`, raised last).

    The size (when not given) is taken *after* the meta pages are read: a writer in another
    process extends the file before it writes the meta page naming the new pages, so a size
    taken before could be older than the meta page read after it."""
    first = os.pread(fd, META_TAIL + TAIL.size, 0)
    m0 = _parse_meta(first, 0)
    psize = m0.psize
    if psize < MIN_PSIZE or psize > MAX_PSIZE or psize & (psize - 1):
        raise IndexDamage(f"meta page 0 has page size {psize}")
    second = os.pread(fd, META_TAIL + TAIL.size, psize)
    if size is None:
        size = os.fstat(fd).st_size
    if size < 2 * psize:
        raise IndexDamage(f"data.mdb has {size} bytes, less than its two meta pages "
                          f"({2 * psize} bytes)")
    m1 = _parse_meta(second, 1)
    cur = m1 if m1.txnid > m0.txnid else m0  # mdb_env_pick_meta
    check_meta(cur, size, psize)
    return cur


def check_meta(m: Meta, size: int, psize: int) -> None:
    if m.psize != psize:
        raise IndexDamage(f"meta page {m.slot} has page size {m.psize}, meta page 0 {psize}")
    need = (m.last_pg + 1) * psize
    if m.last_pg < 1 or m.last_pg >= (1 << 48) // psize:
        raise IndexDamage(f"meta page {m.slot} has last page {m.last_pg}")
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
    if need > size:
        raise ShortFile(m, size)


# -- pages ---------------------------------------------------------------------------------------

class Pages:
    """Pages by number with plain file I/O (the whole file read once when it is small).
    ``present``: the pages the file holds, when fewer than ``npages`` (a page past them is
    cut off)."""

    def __init__(self, fd: int, psize: int, npages: int, preload: bool,
                 present: int | None = None) -> None:
        self.fd = fd
        self.psize = psize
        self.npages = npages
        self.present = npages if present is None else min(npages, present)
        self.arr: np.ndarray | None = None
        if preload:
            want = psize * self.present
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
            self.arr = arr.reshape(self.present, psize)

    def get(self, pgno: int, count: int = 1) -> bytes:
        ps = self.psize
        if self.arr is not None:
            if pgno + count > self.present:
                raise IndexDamage(f"page {pgno} is cut off")
            return self.arr[pgno:pgno + count].tobytes()
        b = os.pread(self.fd, ps * count, pgno * ps)
        if len(b) != ps * count:
            raise IndexDamage(f"page {pgno} is cut off")
        return b

    def many(self, pgnos: np.ndarray) -> np.ndarray:
        """Pages ``pgnos`` as a ``[len, psize]`` uint8 array."""
        if self.arr is not None:
            if len(pgnos) and int(pgnos.max()) >= self.present:
                raise IndexDamage(f"page {int(pgnos.max())} is cut off")
            return self.arr[pgnos]
        out = np.empty((len(pgnos), self.psize), dtype=np.uint8)
        for i, pg in enumerate(pgnos.tolist()):
            if os.preadv(self.fd, [out[i]], pg * self.psize) != self.psize:
                raise IndexDamage(f"page {pg} is cut off")
        return out
