"""The disk tier's LMDB index: database names, the record encodings, the keys, and
:class:`WriteOps`, the write-transaction helper that keeps the side indexes consistent
(``docs/format.md``). Opening the environment is :mod:`kvstore.tiers.disk.env`.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from typing import NamedTuple

import lmdb
import msgpack

from kvstore.tiers.disk.segments import ST_DTYPES

log = logging.getLogger("kvstore.disk")

#: Version of the disk tier's on-disk format (LMDB dbs, record encoding, segment files).
DISK_FORMAT_VERSION = 2

DB_META = b"meta"
DB_BLOCKS = b"blocks"
DB_NS = b"ns"
DB_CHILDREN = b"children"
DB_LRU = b"lru"
DB_SEGS = b"segs"
DB_NAMES = (DB_META, DB_BLOCKS, DB_NS, DB_CHILDREN, DB_LRU, DB_SEGS)

META_FORMAT = b"format_version"
META_NEXT_SEGMENT = b"next_segment"
META_TOTALS = b"totals"

RECORD_VERSION = 1
FLAG_HAS_PARENT = 1
#: version u8, codec u8, flags u8, reserved u8, hits u32, segment u64, offset u64,
#: stored_nbytes u64, raw_nbytes u64, checksum u64, created_us u64, last_access_us u64,
#: namespace_id 32s, parent 32s — little-endian, 128 bytes.
RECORD = struct.Struct("<BBBBIQQQQQQQ32s32s")
#: version u8, 3 pad, live_count u32, file_bytes u64, data_bytes u64, live_bytes u64, created_us u64
SEGINFO = struct.Struct("<B3xIQQQQ")
#: blocks, stored_bytes, raw_bytes, segments, segment_file_bytes, segment_data_bytes
TOTALS = struct.Struct("<6Q")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
BE64 = struct.Struct(">Q")
_ZERO32 = bytes(32)
_MAX_HITS = 0xFFFFFFFF
_U64_MAX = (1 << 64) - 1
NS_RECORD_VERSION = 1
#: a record claiming a larger block (or offset) is damaged: RecordError, not an allocation
MAX_BLOCK_BYTES = 1 << 30
MAX_SEGMENT_OFFSET = 1 << 48


class Rec(NamedTuple):
    """A decoded index record."""

    codec: int
    hits: int
    segment: int
    offset: int
    stored_nbytes: int
    raw_nbytes: int
    checksum: int
    created_us: int
    last_access_us: int
    namespace_id: bytes
    parent: bytes | None


class RecordError(ValueError):
    """An index value does not decode."""


def encode_record(r: Rec) -> bytes:
    return RECORD.pack(
        RECORD_VERSION, r.codec, FLAG_HAS_PARENT if r.parent is not None else 0, 0,
        min(r.hits, _MAX_HITS), r.segment, r.offset, r.stored_nbytes, r.raw_nbytes, r.checksum,
        r.created_us, r.last_access_us, r.namespace_id, r.parent if r.parent is not None else _ZERO32,
    )


def check_record_bounds(codec: int, segment: int, offset: int, stored: int, raw: int) -> None:
    """Sane bounds of a record's sizes and place, so that a flipped bit is a RecordError and
    never an absurd allocation or read."""
    if not 0 < raw <= MAX_BLOCK_BYTES:
        raise RecordError(f"index record has {raw} raw bytes (at most {MAX_BLOCK_BYTES})")
    if not 0 < stored <= raw + (raw >> 6) + 4096 or (codec == 0 and stored != raw):
        raise RecordError(f"index record has {stored} stored bytes for {raw} raw (codec {codec})")
    if not 1 <= segment < 1 << 63 or not 8 <= offset <= MAX_SEGMENT_OFFSET:
        raise RecordError(f"index record points at segment {segment:#x} offset {offset}")


def decode_record(b: bytes) -> Rec:
    if len(b) != RECORD.size:
        raise RecordError(f"index record has {len(b)} bytes, expected {RECORD.size}")
    (ver, codec, flags, _res, hits, seg, off, stored, raw, csum, created, last,
     ns, parent) = RECORD.unpack(b)
    if ver != RECORD_VERSION:
        raise RecordError(f"index record version {ver}, expected {RECORD_VERSION}")
    if flags & ~FLAG_HAS_PARENT or _res:
        raise RecordError(f"index record has unknown flags {flags:#x}/{_res:#x}")
    if not flags & FLAG_HAS_PARENT and parent != _ZERO32:
        raise RecordError("index record has a parent key but no parent flag")
    check_record_bounds(codec, seg, off, stored, raw)
    return Rec(codec, hits, seg, off, stored, raw, csum, created, last, ns,
               parent if flags & FLAG_HAS_PARENT else None)



def lookup_record(txn: lmdb.Transaction, db: object, ck: bytes) -> Rec | None:
    """The record stored under dbkey ``ck``, or None when absent or undecodable (damage is
    a miss here; ``check`` reports it)."""
    raw = txn.get(ck, db=db)
    if raw is None:
        return None
    try:
        return decode_record(raw)
    except RecordError:
        return None

class SegInfo(NamedTuple):
    live_count: int
    file_bytes: int
    data_bytes: int
    live_bytes: int
    created_us: int


def encode_seginfo(s: SegInfo) -> bytes:
    return SEGINFO.pack(1, s.live_count, s.file_bytes, s.data_bytes, s.live_bytes, s.created_us)


def decode_seginfo(b: bytes) -> SegInfo:
    if len(b) != SEGINFO.size or b[0] != 1 or b[1:4] != b"\0\0\0":
        raise RecordError("segment record does not decode")
    _v, *rest = SEGINFO.unpack(b)
    s = SegInfo(*rest)
    if s.data_bytes > s.file_bytes or s.file_bytes > MAX_SEGMENT_OFFSET:
        raise RecordError(f"segment record has {s.file_bytes} file and {s.data_bytes} data bytes")
    return s


def decode_totals(b: bytes | None) -> list[int]:
    """``meta.totals`` as 6 ints; RecordError when missing or malformed."""
    if b is None or len(b) != TOTALS.size:
        raise RecordError("the totals record is missing or malformed")
    return list(TOTALS.unpack(b))


def decode_u32(b: bytes | None, what: str = "value") -> int:
    if b is None or len(b) != 4:
        raise RecordError(f"{what} has {None if b is None else len(b)} bytes, expected 4")
    return U32.unpack(b)[0]


def dbkey(namespace_id: bytes, key: bytes) -> bytes:
    """The LMDB key of a block: namespace id ‖ block key (64 bytes). Every namespace has a
    key space of its own, so no tenant can shadow, skip or delete another tenant's blocks."""
    return namespace_id + key


def legacy_key_space(txn: lmdb.Transaction, blocks: object, ns: object) -> bool:
    """True for an index of format 2 as written before every namespace had a key space of
    its own (kvstore before commit 067ffff): ``blocks`` holds records, all under the bare
    32-byte key, none under :func:`dbkey`. This kvstore would find none of them (every
    lookup a miss); ``kvstore recover`` rebuilds such an index, keeping every block. An index
    with records of both kinds (a rollback to such a release wrote some) is this format: its
    32-byte records are ``bad_record`` findings. Cost: one seek per namespace."""
    cur = txn.cursor(db=blocks)
    if not cur.first() or len(cur.key()) != 32:
        return False
    for nid in txn.cursor(db=ns).iternext(values=False):
        if cur.set_range(nid):
            for k in cur.iternext(values=False):  # a bare key equal to nid sorts first
                if k[:32] != nid:
                    break
                if len(k) == 64:
                    return False
    return True


def lru_key(last_access_us: int, ck: bytes) -> bytes:
    """``lru`` key: last access (u64 BE) ‖ the block's :func:`dbkey`."""
    return BE64.pack(last_access_us) + ck


def parent_dbkey(rec: Rec) -> bytes | None:
    """The :func:`dbkey` of a record's parent (a chain never leaves its namespace)."""
    return None if rec.parent is None else rec.namespace_id + rec.parent


# -- namespaces ------------------------------------------------------------------------------

def encode_namespace(info_fields: tuple) -> bytes:
    """msgpack array ``[1, model_id, model_revision, dtype, num_layers, kv_planes,
    block_tokens, num_kv_heads, head_dim, tp_rank, tp_size, format_version, [[k, v], ...]]``."""
    (model_id, rev, dtype, L, P, T, H, D, rank, size, fv, extras) = info_fields
    return msgpack.packb(
        [NS_RECORD_VERSION, model_id, rev, dtype, L, P, T, H, D, rank, size, fv,
         [[k, v] for k, v in extras]],
        use_bin_type=True,
    )


def decode_namespace(b: bytes) -> tuple:
    """Strict inverse of :func:`encode_namespace` (bounded sizes, exact types)."""
    try:
        obj = msgpack.unpackb(
            b, raw=False, strict_map_key=True, use_list=True, max_str_len=1 << 16,
            max_bin_len=0, max_array_len=1024, max_map_len=0, max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several types for malformed input
        raise RecordError(f"namespace record does not decode: {e}") from None
    if not isinstance(obj, list) or len(obj) != 13 or obj[0] != NS_RECORD_VERSION:
        raise RecordError("namespace record has the wrong shape or version")
    _v, model_id, rev, dtype, *ints, extras = obj
    if not (isinstance(model_id, str) and isinstance(rev, str) and isinstance(dtype, str)):
        raise RecordError("namespace record has non-string names")
    if len(ints) != 8 or not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
        raise RecordError("namespace record has non-integer fields")
    if not isinstance(extras, list) or not all(
        isinstance(kv, list) and len(kv) == 2 and all(isinstance(x, str) for x in kv) for kv in extras
    ):
        raise RecordError("namespace record has malformed extras")
    if dtype not in ST_DTYPES:  # a flipped name must not fail later, in the layout
        raise RecordError(f"namespace record has an unknown dtype {dtype[:40]!r}")
    L, P, T, H, D, rank, size, _fv = ints
    if min(L, T, H, D, size) < 1 or P not in (1, 2) or not 0 <= rank < size or max(ints) >= 1 << 32:
        raise RecordError("namespace record has out-of-range layout fields")
    return (model_id, rev, dtype, *ints, tuple((k, v) for k, v in extras))


#: ``kvstore.namespace``'s hashing tag and order, without importing it (it imports torch,
#: which an admin command opening an index does not need); ``tests/tiers/disk/test_index_damage.py``
#: pins that both give the same ids
_NAMESPACE_TAG = "kvstore-namespace/1"


def namespace_record_id(fields: tuple) -> bytes | None:
    """The namespace id that the fields of a decoded namespace record hash to — the key the
    record must be stored under (``Namespace.id``: sha256 of its canonical msgpack) — or None
    when they make no valid namespace."""
    (model_id, rev, dtype, L, P, T, H, D, rank, size, fv, extras) = fields
    if not model_id or size < 1 or not 0 <= rank < size:
        return None
    canonical = msgpack.packb(
        [_NAMESPACE_TAG, fv, model_id, rev, dtype, [L, P, T, H, D], [rank, size],
         [list(kv) for kv in extras]],
        use_bin_type=True,
    )
    return hashlib.sha256(canonical).digest()


# -- the write-transaction helper --------------------------------------------------------

class WriteOps:
    """Mutations of one write transaction that keep every side index consistent:

    * ``children[p]`` = number of records whose parent is ``p`` (absent when 0);
    * ``lru`` holds ``(last_access, key)`` for exactly the records that are leaves;
    * ``segs[s]`` live count/bytes; a segment whose live count reaches 0 is removed from
      ``segs`` and reported in :attr:`emptied` (its file is unlinked after commit);
    * ``meta.totals``.
    """

    def __init__(self, txn: lmdb.Transaction, dbs: dict[bytes, object]) -> None:
        self.txn = txn
        self.blocks = dbs[DB_BLOCKS]
        self.children_db = dbs[DB_CHILDREN]
        self.lru = dbs[DB_LRU]
        self.segs_db = dbs[DB_SEGS]
        self.meta = dbs[DB_META]
        try:
            self.totals = decode_totals(txn.get(META_TOTALS, db=self.meta))
        except RecordError as e:  # derived: check(fix=True) recomputes it
            log.warning("disk index: %s; counting from zero", e)
            self.totals = [0, 0, 0, 0, 0, 0]
        self._segs: dict[int, list[int]] = {}
        self.emptied: list[int] = []

    def get(self, key: bytes) -> Rec | None:
        raw = self.txn.get(key, db=self.blocks)
        return None if raw is None else decode_record(raw)

    def children(self, key: bytes) -> int:
        raw = self.txn.get(key, db=self.children_db)
        if raw is None:
            return 0
        try:
            return decode_u32(raw, "a children count")
        except RecordError as e:  # derived: check(fix=True) recomputes it
            log.warning("disk index: %s; taken as 1", e)
            return 1

    def _seg(self, sid: int) -> list[int]:
        s = self._segs.get(sid)
        if s is None:
            raw = self.txn.get(BE64.pack(sid), db=self.segs_db)
            try:
                s = [0, 0, 0, 0, 0] if raw is None else list(decode_seginfo(raw))
            except RecordError as e:  # derived: check(fix=True) recomputes it
                log.warning("disk index: segment %016x: %s; counting from zero", sid, e)
                s = [0, 0, 0, 0, 0]
            self._segs[sid] = s
        return s

    def add_segment(self, sid: int, file_bytes: int, data_bytes: int, created_us: int) -> None:
        self._segs[sid] = [0, file_bytes, data_bytes, 0, created_us]
        t = self.totals
        t[3] += 1
        t[4] += file_bytes
        t[5] += data_bytes

    def insert(self, key: bytes, rec: Rec) -> None:
        """``key`` here and below is the block's :func:`dbkey`."""
        txn = self.txn
        txn.put(key, encode_record(rec), db=self.blocks)
        p = parent_dbkey(rec)
        if p is not None:
            c = self.children(p)
            txn.put(p, U32.pack(min(c + 1, _MAX_HITS)), db=self.children_db)
            if c == 0:
                prec = self.get(p)
                if prec is not None:
                    txn.delete(lru_key(prec.last_access_us, p), db=self.lru)
        if self.children(key) == 0:
            txn.put(lru_key(rec.last_access_us, key), b"", db=self.lru)
        s = self._seg(rec.segment)
        s[0] += 1
        s[3] += rec.stored_nbytes
        t = self.totals
        t[0] += 1
        t[1] += rec.stored_nbytes
        t[2] += rec.raw_nbytes

    def remove(self, key: bytes, rec: Rec) -> None:
        txn = self.txn
        txn.delete(key, db=self.blocks)
        if self.children(key) == 0:
            txn.delete(lru_key(rec.last_access_us, key), db=self.lru)
        p = parent_dbkey(rec)
        if p is not None:
            c = self.children(p)
            if c <= 1:
                txn.delete(p, db=self.children_db)
                prec = self.get(p)
                if prec is not None:
                    txn.put(lru_key(prec.last_access_us, p), b"", db=self.lru)
            else:
                txn.put(p, U32.pack(c - 1), db=self.children_db)
        s = self._seg(rec.segment)
        s[0] -= 1
        s[3] -= rec.stored_nbytes
        t = self.totals
        t[0] -= 1
        t[1] -= rec.stored_nbytes
        t[2] -= rec.raw_nbytes

    def update_access(self, key: bytes, rec: Rec, last_us: int, hits: int) -> None:
        new_last = max(rec.last_access_us, last_us)
        new = rec._replace(last_access_us=new_last, hits=min(rec.hits + hits, _MAX_HITS))
        if new_last != rec.last_access_us and self.children(key) == 0:
            self.txn.delete(lru_key(rec.last_access_us, key), db=self.lru)
            self.txn.put(lru_key(new_last, key), b"", db=self.lru)
        self.txn.put(key, encode_record(new), db=self.blocks)

    def move(self, key: bytes, rec: Rec, segment: int, offset: int) -> None:
        self.txn.put(key, encode_record(rec._replace(segment=segment, offset=offset)), db=self.blocks)
        old = self._seg(rec.segment)
        old[0] -= 1
        old[3] -= rec.stored_nbytes
        new = self._seg(segment)
        new[0] += 1
        new[3] += rec.stored_nbytes

    def finish(self) -> None:
        txn = self.txn
        t = self.totals
        for sid, s in self._segs.items():
            k = BE64.pack(sid)
            if s[0] <= 0:
                if txn.delete(k, db=self.segs_db) or s[1]:
                    t[3] -= 1
                    t[4] -= s[1]
                    t[5] -= s[2]
                self.emptied.append(sid)
            else:
                # a corrupt record's sizes can drive derived counters out of range: clamp, so
                # that dropping such a record always commits (check(fix=True) rebuilds them)
                txn.put(k, encode_seginfo(SegInfo(min(s[0], _MAX_HITS),
                                                  *(min(max(0, v), _U64_MAX) for v in s[1:]))),
                        db=self.segs_db)
        txn.put(META_TOTALS, TOTALS.pack(*(min(max(0, v), _U64_MAX) for v in t)), db=self.meta)
