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
| ``records`` | the public records: ``DiskWrite``, ``DiskRecord``, ``DiskStats``, ``NamespaceInfo``, ``Finding``, ``CompactResult`` |
| ``reads`` | read planning (runs per segment, ``preadv``), verification, damage handling |
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
"""

from kvstore.tiers.base import ReadStatus
from kvstore.tiers.disk.check import FixScope, RewriteResult
from kvstore.tiers.disk.index import DISK_FORMAT_VERSION
from kvstore.tiers.disk.records import (
    CompactResult,
    DiskRecord,
    DiskStats,
    DiskWrite,
    Finding,
    NamespaceInfo,
)
from kvstore.tiers.disk.tier import DiskTier

__all__ = [
    "DISK_FORMAT_VERSION",
    "CompactResult",
    "DiskRecord",
    "DiskStats",
    "DiskTier",
    "DiskWrite",
    "Finding",
    "FixScope",
    "NamespaceInfo",
    "ReadStatus",
    "RewriteResult",
]
