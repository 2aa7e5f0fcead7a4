"""Tombstones: a bounded, durable trace of the blocks that left the disk index, so that
``kvstore explain`` can say why a block misses (evicted when and by which tier, removed,
damaged and dropped) instead of "never stored".

One optional named database of the index, ``tombstones`` (``docs/format.md``), written in
the same write transaction that removes the record, so a trace exists exactly when the
removal committed. Bounded to ``2 * GENERATION`` entries with no time index: entries carry
a generation byte in their key; every insert into the current generation deletes the
oldest entry of the other one, and when the current generation holds ``GENERATION``
entries the (by then empty) other one becomes current. The newest ``GENERATION``
removals are always answerable, at one extra ``put`` and one cursor step per removal.

Readers tolerate its absence: an index written before tombstones existed (or by a tier
that does not write them) has no such database, and :func:`lookup` answers
:data:`NOT_KEPT`.

Writers call :func:`record` inside their write transaction, e.g. in
:func:`kvstore.tiers.disk.eviction.evict_to_budget`'s ``fn`` after ``ops.remove(ck, rec)``::

    tombstones.record(ops.txn, db, [(ck, rec.created_us)], Reason.EVICTED, TierCode.DISK, now_us)
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lmdb

if TYPE_CHECKING:
    from kvstore.tiers.disk.context import DiskContext
    from kvstore.tiers.disk.tier import DiskTier

DB_TOMBSTONES = b"tombstones"
#: the bookkeeping entry (a 4-byte key: never a tombstone's 65-byte key)
META_KEY = b"meta"
#: entries per generation; at most twice this many are kept
GENERATION = 65536
TOMBSTONE_VERSION = 1
#: version u8, reason u8, tier u8, detail u8, reserved u32, removed_us u64, stored_us u64
VALUE = struct.Struct("<BBBBIQQ")
#: version u8, current generation u8, reserved u16, entries in the current generation u32
META = struct.Struct("<BBHI")
_KEY_BYTES = 65  # generation u8 ‖ namespace id (32) ‖ block key (32)


class Reason(enum.IntEnum):
    """Why a record left the index."""

    EVICTED = 1  # capacity: the tier made room (leaf-first LRU)
    REMOVED = 2  # asked for: ``kvstore rm``, ``Store.evict``, a daemon's remove
    DAMAGED = 3  # a read found its bytes damaged or gone and dropped the record
    PRUNED = 4  # ``kvstore prune`` / ``verify --fix``: no usable payload, or unreachable


class TierCode(enum.IntEnum):
    """The tier that let the block go."""

    HOT = 1
    WARM = 2
    DISK = 3
    REMOTE = 4


class Detail(enum.IntEnum):
    """What was wrong with a damaged or pruned block (0 when nothing to add)."""

    NONE = 0
    CHECKSUM_MISMATCH = 1
    SHORT_SEGMENT = 2
    MISSING_SEGMENT = 3
    BAD_RECORD = 4
    UNREACHABLE = 5  # its parent was gone, so no lookup could reach it


#: a damage kind as the disk tier names it (``Finding.kind``, read statuses) -> its code
DETAIL_OF_KIND = {"checksum_mismatch": Detail.CHECKSUM_MISMATCH,
                  "short_segment": Detail.SHORT_SEGMENT,
                  "missing_segment": Detail.MISSING_SEGMENT, "bad_record": Detail.BAD_RECORD,
                  "unreachable": Detail.UNREACHABLE}


@dataclass(frozen=True, slots=True)
class Tombstone:
    """The trace of one block that left the index."""

    reason: Reason
    tier: TierCode
    detail: Detail
    removed: float  # when, seconds since the epoch
    stored: float | None  # when the block had been written (None: not known)


class _NotKept:
    """The answer of a store that keeps no tombstones (no ``tombstones`` database)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_KEPT"


NOT_KEPT = _NotKept()


def encode(reason: Reason, tier: TierCode, removed_us: int, stored_us: int = 0,
           detail: Detail = Detail.NONE) -> bytes:
    return VALUE.pack(TOMBSTONE_VERSION, int(reason), int(tier), int(detail), 0,
                      max(0, removed_us), max(0, stored_us))


def decode(b: bytes) -> Tombstone | None:
    """A tombstone value, or None when it does not decode (a damaged trace is no answer)."""
    if len(b) != VALUE.size:
        return None
    ver, reason, tier, detail, _res, removed, stored = VALUE.unpack(b)
    try:
        return Tombstone(Reason(reason), TierCode(tier), Detail(detail), removed / 1e6,
                         stored / 1e6 if stored else None) if ver == TOMBSTONE_VERSION else None
    except ValueError:
        return None


def _meta(txn: lmdb.Transaction, db: object) -> tuple[int, int]:
    raw = txn.get(META_KEY, db=db)
    if raw is None or len(raw) != META.size:
        return 0, 0
    _v, gen, _r, count = META.unpack(raw)
    return gen & 1, count


def record(txn: lmdb.Transaction, db: object, items: Iterable[tuple[bytes, int]],
           reason: Reason, tier: TierCode, removed_us: int,
           detail: Detail = Detail.NONE) -> None:
    """Add the tombstones of ``items`` — (dbkey, created_us of the removed record) — in the
    write transaction ``txn`` (the one removing the records). A block removed again
    replaces its older trace."""
    gen, count = _meta(txn, db)
    cur = txn.cursor(db=db)
    for ck, stored_us in items:
        if count >= GENERATION:
            gen, count = gen ^ 1, 0
        txn.put(bytes([gen]) + ck, encode(reason, tier, removed_us, stored_us, detail), db=db)
        txn.delete(bytes([gen ^ 1]) + ck, db=db)  # newest trace wins
        count += 1
        # one step of the rotation: the oldest generation shrinks as the current one grows
        if cur.set_range(bytes([gen ^ 1])) and len(cur.key()) == _KEY_BYTES \
                and cur.key()[0] == gen ^ 1:
            cur.delete()
    txn.put(META_KEY, META.pack(TOMBSTONE_VERSION, gen, 0, count), db=db)


def lookup(txn: lmdb.Transaction, db: object | None,
           cks: Sequence[bytes]) -> list[Tombstone | None] | _NotKept:
    """The tombstone of each dbkey (newest generation first), or :data:`NOT_KEPT` when
    ``db`` is None (the store keeps none)."""
    if db is None:
        return NOT_KEPT
    gen, _count = _meta(txn, db)
    out: list[Tombstone | None] = []
    for ck in cks:
        raw = txn.get(bytes([gen]) + ck, db=db)
        if raw is None:
            raw = txn.get(bytes([gen ^ 1]) + ck, db=db)
        out.append(None if raw is None else decode(raw))
    return out


def open_db(env: lmdb.Environment, txn: lmdb.Transaction, *, create: bool) -> object | None:
    """The ``tombstones`` database handle (in ``txn``; a write txn when ``create``), or
    None when the index has none and ``create`` is false."""
    try:
        return env.open_db(DB_TOMBSTONES, txn=txn, create=create)
    except lmdb.NotFoundError:
        return None


# -- on a disk tier's context (the tier's own methods: ``DiskTier.tombstones`` and the like) ---
# A handle opened in a read transaction is valid only inside it (the transaction ends with an
# abort, which closes it), so readers open it per transaction unless the tier's environment
# has it open already (``sh.dbs``: opened in a write transaction, valid for the process).

def db_in(ctx: DiskContext, *, create: bool = False) -> object | None:
    """The tier's ``tombstones`` handle when it lasts beyond one transaction: from the
    tier's opened databases, or — with ``create`` — created (or opened) in a write
    transaction. None when the environment does not have it open (readers: :func:`lookup_in`)."""
    sh = ctx.sh
    db = sh.dbs.get(DB_TOMBSTONES)
    if db is None and create:
        db = ctx.require_writable().write(lambda txn: open_db(sh.env, txn, create=True))
        sh.dbs[DB_TOMBSTONES] = db  # one handle per environment, like the other databases
    return db


def kept_in(ctx: DiskContext) -> bool:
    """Whether the store keeps tombstones (its index has the database)."""
    sh = ctx.sh
    if sh.dbs.get(DB_TOMBSTONES) is not None:
        return True
    with sh.read() as txn:
        return open_db(sh.env, txn, create=False) is not None


def lookup_in(ctx: DiskContext, namespace_id: bytes,
              keys: Sequence[bytes]) -> list[Tombstone | None] | _NotKept:
    """The tombstones of ``keys`` of ``namespace_id`` in one read transaction."""
    sh = ctx.sh
    with sh.read() as txn:
        db = sh.dbs.get(DB_TOMBSTONES) or open_db(sh.env, txn, create=False)
        return lookup(txn, db, [namespace_id + k for k in keys])


def record_in(ctx: DiskContext, items: Iterable[tuple[bytes, int]], reason: Reason,
              tier_code: TierCode, *, detail: Detail = Detail.NONE,
              removed_us: int | None = None) -> None:
    """Add tombstones in a write transaction of their own: for a removal that was not made
    in an index transaction (a memory tier letting a block go that never reached disk)."""
    db = db_in(ctx, create=True)
    now = ctx.now_us() if removed_us is None else removed_us
    items = list(items)
    ctx.require_writable().write(
        lambda txn: record(txn, db, items, reason, tier_code, now, detail))


# -- on a DiskTier, through its public methods (readers such as ``explain``, the benchmarks) --

def kept(tier: DiskTier) -> bool:
    """Whether the store keeps tombstones (:meth:`DiskTier.tombstones_kept`)."""
    return tier.tombstones_kept()


def lookup_on(tier: DiskTier, namespace_id: bytes,
              keys: Sequence[bytes]) -> list[Tombstone | None] | _NotKept:
    """The tombstones of ``keys`` of ``namespace_id`` (:meth:`DiskTier.tombstones`)."""
    return tier.tombstones(namespace_id, keys)  # type: ignore[return-value]


def record_on(tier: DiskTier, items: Iterable[tuple[bytes, int]], reason: Reason,
              tier_code: TierCode, *, detail: Detail = Detail.NONE,
              removed_us: int | None = None) -> None:
    """Add tombstones in a write transaction of their own
    (:meth:`DiskTier.record_tombstones`)."""
    tier.record_tombstones(items, reason, tier_code, detail=detail, removed_us=removed_us)
