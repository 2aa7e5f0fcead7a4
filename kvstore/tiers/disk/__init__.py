"""The disk tier: an LMDB index plus append-only safetensors segment files
(``docs/architecture.md`` "Tiers").

Synchronous and thread-safe; several processes may open the same path at once. The store
(memory tiers, background writer) drives it; see ``docs/format.md`` for the on-disk format.

Guarantees:

* ``write_blocks`` is durable on return: segment written under a temp name, fsynced, linked
  into place (never over an existing file), directory fsynced, then the LMDB transaction
  (synchronous) commits the records. On error it raises :class:`~kvstore.errors.DiskError` and nothing new
  is visible. ``stage_blocks`` + ``commit_staged`` is the same write in two steps, so that
  several batches share one commit; staged blocks are neither durable nor visible.
* Reads go straight into the caller's tensor (``preadv``) and are verified against the xxh3_64
  checksum of the raw block. A missing segment, short read, bad checksum or undecodable payload
  returns ``MISSING``/``DAMAGED``, drops the index entry, is counted and logged — never raised,
  never reported ``OK`` with wrong bytes.
* A payload file is unlinked only after the transaction that removed its last record
  committed. Compaction writes the new segment durably and commits the moved records before
  unlinking the old one; a reader in another process that finds the old file gone re-reads the
  record and retries once.
* Eviction is leaf-first LRU: only blocks without children on disk are candidates, so a
  prefix-closed set of blocks stays prefix-closed.

| module | holds |
| --- | --- |
| ``tier`` | :class:`DiskTier`: lifecycle, namespaces, lookups, touches, listing, stats (delegating) |
| ``context`` | :class:`DiskContext`: the state the modules share (the tier hands it to them) |
| ``records`` | the public records: ``DiskWrite``, ``DiskRecord``, ``DiskStats``, ``NamespaceInfo``, ``Finding``, ``CompactResult`` |
| ``reads`` | read planning (runs per segment, ``preadv``), verification, damage reports |
| ``writes`` | encoding, grouping into segments, segment writes and the commit |
| ``txn`` | index write transactions, unlinking emptied segments after commit, segment ids |
| ``eviction`` | leaf-first LRU down to the capacity |
| ``compaction`` | rewriting segments whose live fraction is low |
| ``check`` | ``DiskTier.check``: consistency check and repair |
| ``index`` | the LMDB index's databases, record encodings and ``WriteOps`` |
| ``env`` | the LMDB environment: one per process per path, map growth, fork |
| ``segments`` | segment files: header, checksums, durable writes, reads, the fd cache |
| ``guard`` | index validation before LMDB maps the file (``StoreCorruptError``) |
| ``lmdb_meta``, ``lmdb_trees`` | LMDB 0.9's file layout and meta pages; the B-tree walk |
| ``recover``, ``recover_scan`` | ``kvstore recover``: rebuilding the index from segment files |
| ``synthetic`` | records without payload inserted straight into the index (``populate_fake_index``) |
"""

# The public names: what the store, the front ends (``kvstore.admin``, ``kvstore.packs``:
# an import-linter contract keeps them to these) and the benchmarks use of the disk tier.
from kvstore.tiers.base import ReadStatus
from kvstore.tiers.disk.check import (
    FixScope,
    RewriteResult,
    expected_tensor,
    listing_problem,
    segment_listing,
)
from kvstore.tiers.disk.check import Listing as SegmentListing
from kvstore.tiers.disk.guard import missing_index_error, require_intact
from kvstore.tiers.disk.index import (
    DISK_FORMAT_VERSION,
    Rec,
    RecordError,
    decode_namespace,
    decode_record,
    encode_namespace,
    namespace_record_id,
)
from kvstore.tiers.disk.records import (
    CompactResult,
    DiskRecord,
    DiskStats,
    DiskWrite,
    Finding,
    NamespaceInfo,
)
from kvstore.tiers.disk.segments import (
    DTYPE_SIZES,
    SEGMENT_RE,
    SEGMENT_READ_FLAGS,
    ST_DTYPES,
    TEMP_RE,
    advance,
    block_checksum,
    fsync_dir,
    publish,
    segment_name,
)
from kvstore.tiers.disk.tier import DiskTier, populate_fake_index

# tombstones (why a block left the index; ``kvstore explain``)
from kvstore.tiers.disk.tombstones import NOT_KEPT, Detail, Reason, Tombstone

__all__ = [
    "DISK_FORMAT_VERSION",
    "DTYPE_SIZES",
    "NOT_KEPT",
    "SEGMENT_READ_FLAGS",
    "SEGMENT_RE",
    "ST_DTYPES",
    "TEMP_RE",
    "CompactResult",
    "Detail",
    "DiskRecord",
    "DiskStats",
    "DiskTier",
    "DiskWrite",
    "Finding",
    "FixScope",
    "NamespaceInfo",
    "ReadStatus",
    "Reason",
    "Rec",
    "RecordError",
    "RewriteResult",
    "SegmentListing",
    "Tombstone",
    "advance",
    "block_checksum",
    "decode_namespace",
    "decode_record",
    "encode_namespace",
    "expected_tensor",
    "fsync_dir",
    "listing_problem",
    "missing_index_error",
    "namespace_record_id",
    "populate_fake_index",
    "publish",
    "require_intact",
    "segment_listing",
    "segment_name",
]
