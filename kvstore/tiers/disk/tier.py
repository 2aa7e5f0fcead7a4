"""The :class:`DiskTier`: lifecycle (its per-process state is re-created after fork),
namespaces, lookups (``locate``, ``get_record``), buffered access times (``touch``), listing
and stats. Reads, writes, eviction, compaction and the check are functions of the tier in
the modules named after them (:mod:`kvstore.tiers.disk`), each handed the tier's
:class:`~kvstore.tiers.disk.context.DiskContext` (never the tier). Reads report the blocks
they found damaged; the tier drops their index entries (:meth:`DiskTier.read_many`).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import lmdb

from kvstore import filemodes as _modes
from kvstore.errors import ConfigError, DiskError, KVStoreError, StoreClosedError
from kvstore.keys import KEY_BYTES, all_keys
from kvstore.sizes import parse_size
from kvstore.tiers import codec as _codec
from kvstore.tiers.base import ReadStatus, check_key
from kvstore.tiers.disk import check as _check
from kvstore.tiers.disk import compaction as _compaction
from kvstore.tiers.disk import eviction as _eviction
from kvstore.tiers.disk import reads as _reads
from kvstore.tiers.disk import synthetic as _synthetic
from kvstore.tiers.disk import tombstones as _tomb
from kvstore.tiers.disk import txn as _txn
from kvstore.tiers.disk import writes as _writes
from kvstore.tiers.disk.context import DiskContext
from kvstore.tiers.disk.env import DEFAULT_MAP_SIZE, SharedEnv, acquire_env, release_env
from kvstore.tiers.disk.index import DB_BLOCKS, DB_NS, RecordError, decode_record, encode_namespace
from kvstore.tiers.disk.records import (
    CompactResult,
    DiskRecord,
    DiskStats,
    DiskWrite,
    Finding,
    NamespaceInfo,
    as_buffer,
    disk_record,
)

if TYPE_CHECKING:  # torch is imported by whoever hands us tensors: listing needs none
    import torch

    from kvstore.namespace import Namespace

log = logging.getLogger("kvstore.disk")

_RECORDS_CHUNK = 1024


class DiskTier:
    """The persistent tier. See :mod:`kvstore.tiers.disk` and ``docs/format.md``.

    Keyword arguments beyond the issue's interface: ``max_segment_bytes`` (roll a batch into
    several segments above this), ``zstd_level``, ``map_size`` (initial LMDB map; grows on
    demand), ``max_open_files`` (fd cache), ``read_threads`` (``read_many`` pool; default: the CPU
    count, 4 to 8),
    ``orphan_grace_s`` (``check`` leaves younger unreferenced files alone: they may belong to
    an in-flight writer of another process), ``touch_flush_entries``/``touch_flush_interval_s``
    (when buffered touches are persisted) and ``clock`` (seconds since the epoch; tests).

    ``group`` (a group name or gid) shares the store with that group (directories 2750,
    files 0640); without it the store stays as it records its sharing, private when new
    (0700/0600), whatever the umask. Opening refuses a store others can write
    (:class:`~kvstore.errors.StorePermissionError`); a writable open sets the modes of one
    others can read, with a WARNING (:mod:`kvstore.filemodes`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        capacity_bytes: int | str,
        codec: str = "none",
        compact_threshold: float = 0.5,
        readonly: bool = False,
        max_segment_bytes: int | str = 512 << 20,
        zstd_level: int = 3,
        map_size: int = DEFAULT_MAP_SIZE,
        max_open_files: int = 256,
        read_threads: int | None = None,
        orphan_grace_s: float = 60.0,
        touch_flush_entries: int = 4096,
        touch_flush_interval_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        group: str | int | None = None,
    ) -> None:
        self._closed = True
        if codec not in _codec.TIER_CODECS:
            raise ConfigError(f"disk codec must be one of {_codec.TIER_CODECS}, got {codec!r}")
        if not 0.0 <= float(compact_threshold) <= 1.0:
            raise ConfigError(f"compact_threshold must be in [0, 1], got {compact_threshold}")
        self.path = os.path.abspath(os.fspath(path))
        self.capacity_bytes = parse_size(capacity_bytes, what="disk capacity")
        self.codec = codec
        self.compact_threshold = float(compact_threshold)
        self.readonly = bool(readonly)
        self.max_segment_bytes = max(1, parse_size(max_segment_bytes, what="max_segment_bytes"))
        self.zstd_level = int(zstd_level)
        self.orphan_grace_s = float(orphan_grace_s)
        self._map_size = int(map_size)
        self._max_open_files = int(max_open_files)
        if read_threads is None:
            # at least 4 even on 2 cores: a cold read waits on the device, and four streams
            # kept a virtual disk busier than two (1 GiB cold, 2 MiB blocks: 0.75x -> 1.0x a
            # raw sequential read; 32 MiB: 0.70x -> 0.88x); page-cache reads use one thread
            # per core of them (reads.reading_shape)
            read_threads = min(8, max(4, os.cpu_count() or 4))
        self._read_threads = max(1, int(read_threads))
        self._touch_flush_entries = max(1, int(touch_flush_entries))
        self._touch_flush_interval_us = int(float(touch_flush_interval_s) * 1e6)
        self._clock = clock
        self._index_dir = os.path.join(self.path, "index")
        self._segdir = os.path.join(self.path, "segments")
        # before anything is created or read: refused if others can write it (read-only
        # opens too: an export would ship what they wrote), tightened if they can read it
        modes = _modes.resolve_modes(self.path, group)
        _modes.check_store(self.path, modes, writable=not self.readonly)
        if not self.readonly:
            try:
                _modes.make_dirs(self.path, modes)
                _modes.make_dirs(self._segdir)  # as the store records it (private, or shared)
            except OSError as e:
                raise DiskError(e.errno, f"cannot create the disk tier directory {self._segdir}: "
                                f"{e.strerror}") from e
        self._ctx: DiskContext | None = None
        self._init_process_state()
        self._closed = False

    # -- per-process state (re-created after fork) ------------------------------------------
    def _init_process_state(self) -> None:
        self._pid = os.getpid()
        sh = acquire_env(self._index_dir, create=not self.readonly, readonly=self.readonly,
                         map_size=self._map_size)
        if not sh.writable:
            self.readonly = True
        self._ctx = DiskContext(
            path=self.path, index_dir=self._index_dir, segdir=self._segdir, sh=sh,
            readonly=self.readonly, max_open_files=self._max_open_files, clock=self._clock,
            read_threads=self._read_threads, touch_flush_entries=self._touch_flush_entries,
            touch_flush_interval_us=self._touch_flush_interval_us)
        self._close_lock = threading.Lock()
        self._ctx.namespaces.load()

    def _ensure(self) -> DiskContext:
        """The context, once the tier is known to be open (re-created after a fork: the LMDB
        env, fds, locks and threads are not this process's; the counters are per process)."""
        if self._closed:
            raise StoreClosedError(f"the disk tier at {self.path} is closed")
        if self._pid != os.getpid():
            self._ctx.fds.abandon()  # type: ignore[union-attr]
            self._init_process_state()
        return self._ctx  # type: ignore[return-value]

    def _ensure_writable(self) -> DiskContext:
        ctx = self._ensure()
        ctx.require_writable()
        return ctx

    @property
    def _sh(self) -> SharedEnv:  # the tests' way to the environment
        return self._ensure().sh

    # -- namespaces -----------------------------------------------------------------------
    def register_namespace(self, ns: Namespace) -> None:
        """Persist the namespace's layout record (idempotent)."""
        from kvstore.namespace import Namespace

        ctx = self._ensure()
        sh = ctx.sh
        if not isinstance(ns, Namespace):
            raise ConfigError(f"register_namespace takes a kvstore Namespace, got {type(ns).__name__}")
        nid = ns.id
        info = NamespaceInfo.of(ns)
        if not ctx.namespaces.cached(nid):
            value = encode_namespace(info.fields)
            with sh.read() as txn:
                present = txn.get(nid, db=sh.dbs[DB_NS]) is not None
            if not present:
                if self.readonly:
                    raise DiskError(errno.EROFS, f"cannot register a namespace: the disk tier at "
                                    f"{self.path} is open read-only")

                def fn(txn):
                    if txn.get(nid, db=sh.dbs[DB_NS]) is None:
                        txn.put(nid, value, db=sh.dbs[DB_NS])
                _txn.write_raw(ctx, fn)
        ctx.namespaces.add(info)

    def namespaces(self) -> list[NamespaceInfo]:
        ns = self._ensure().namespaces
        ns.load()
        return ns.infos()

    # -- lookups ------------------------------------------------------------------------------
    # Every namespace has its own key space (the LMDB key is namespace id ‖ key, see
    # docs/format.md). The store always names its namespace; a call without one (admin
    # tools, tests) finds the key under whichever known namespace holds it.
    def contains(self, key: bytes, namespace_id: bytes | None = None) -> bool:
        return self.leading_run([key], namespace_id) == 1

    def leading_run(self, keys: Sequence[bytes], namespace_id: bytes | None = None) -> int:
        """Number of leading ``keys`` held on disk (one short read transaction), in
        ``namespace_id``'s key space (default: whichever namespace holds each key)."""
        return len(self.locate(keys, namespace_id))

    def locate(self, keys: Sequence[bytes], namespace_id: bytes | None = None) -> list[bytes]:
        """The index records of the leading ``keys`` held on disk, read in one short
        transaction. Hand them to ``read_many(records=...)`` to read those blocks without
        another transaction (a record gone stale meanwhile is handled there: a segment
        compacted away is looked up again, and a checksum is bound to its key)."""
        ctx = self._ensure()
        sh = ctx.sh
        db = sh.dbs[DB_BLOCKS]
        if not all_keys(keys):
            keys = [check_key(k, "key") for k in keys]
        out: list[bytes] = []
        with sh.read() as txn:
            get = txn.get
            if namespace_id is None:
                cks = ctx.namespaces.dbkeys(txn, keys, None)
            else:
                ns = check_key(namespace_id, "namespace_id")
                cks = [ns + k for k in keys]
            for ck in cks:
                raw = get(ck, db=db)
                if raw is None:
                    break
                out.append(raw)
        return out

    def get_record(self, key: bytes, namespace_id: bytes | None = None) -> DiskRecord | None:
        """The index record of ``key``, or None."""
        ctx = self._ensure()
        key = check_key(key, "key")
        with ctx.sh.read() as txn:
            (ck,) = ctx.namespaces.dbkeys(txn, [key], namespace_id)
        r = ctx.get_rec(ck)
        return None if r is None else disk_record(key, r)

    # -- reads --------------------------------------------------------------------------------
    def read_into(self, key: bytes, dst: torch.Tensor,
                  namespace_id: bytes | None = None) -> ReadStatus:
        """Read one block straight into ``dst`` (CPU uint8 contiguous 1-D, block_nbytes) and
        verify it. Never raises for damage; ``dst`` holds the block only when OK."""
        ctx = self._ensure()
        key = check_key(key, "key")
        buf = as_buffer(dst, "dst")
        with ctx.sh.read() as txn:
            (ck,) = ctx.namespaces.dbkeys(txn, [key], namespace_id)
            raw = txn.get(ck, db=ctx.sh.dbs[DB_BLOCKS])
        return self._read_one(ck, raw, buf)

    def read_many(
        self, keys: Sequence[bytes], dsts: Sequence[torch.Tensor],
        *, mirrors: Sequence[torch.Tensor | None] | None = None,
        namespace_id: bytes | None = None, records: Sequence[bytes | None] | None = None,
    ) -> list[ReadStatus]:
        """Read several blocks (a small thread pool); one independent status per key.

        ``mirrors[i]`` (optional; same shape and dtype as ``dsts[i]``, or None) also receives
        block ``i`` once it has been read and verified, copied by the reading thread while
        other reads are still in flight (a store keeps a warm copy of what it read straight
        into a caller's buffer this way, off the end of the fetch). ``records`` (one per key,
        from :meth:`locate` with the same ``namespace_id``) saves the index transaction.
        """
        ctx = self._ensure()
        found = _reads.read_many(ctx, keys, dsts, mirrors, namespace_id, records)
        self._drop_damaged(ctx, found.damaged)
        return found.statuses

    def _read_one(self, key: bytes, raw: bytes | None, buf: memoryview) -> ReadStatus:
        """Read and verify one block (``key``: its dbkey) given its index record ``raw``."""
        ctx = self._ensure()
        found = _reads.read_one(ctx, key, raw, buf)
        self._drop_damaged(ctx, found.damaged)
        return found.statuses[0]

    @staticmethod
    def _drop_damaged(ctx: DiskContext, damaged: Sequence[_reads.Damage]) -> None:
        """What a read found damaged leaves the index (each with a tombstone saying why);
        a read-only tier only reports it."""
        if damaged and not ctx.readonly:
            _txn.drop_damaged(ctx, damaged)

    # -- writes -------------------------------------------------------------------------------
    def write_blocks(self, items: Sequence[DiskWrite]) -> list[bytes]:
        """Write blocks durably; returns the keys newly written (present keys are skipped).
        Raises DiskError (disk full, read-only directory, I/O error) with nothing visible."""
        return _writes.write_blocks(self._ensure_writable(), self._write_options(), items)

    def stage_blocks(self, items: Sequence[DiskWrite]) -> _writes.StagedWrite:
        """Write blocks into new segments without making them durable or visible yet; hand
        the result to :meth:`commit_staged` (several at once: one fsync per file, one index
        commit) or :meth:`abort_staged`. Raises DiskError with nothing left behind."""
        return _writes.stage_blocks(self._ensure_writable(), self._write_options(), items)

    def commit_staged(self, staged: Sequence[_writes.StagedWrite]) -> list[bytes]:
        """Make staged batches durable and visible together; returns the keys newly written.
        Raises DiskError with nothing visible (the staged segments are then removed)."""
        return _writes.commit_staged(self._ensure_writable(), staged)

    def abort_staged(self, staged: Sequence[_writes.StagedWrite]) -> None:
        """Remove staged batches that will not be committed."""
        _writes.abort_staged(staged)

    def _write_options(self) -> _writes.WriteOptions:
        return _writes.WriteOptions(self.codec, self.zstd_level, self.max_segment_bytes)

    def delete(self, keys: Sequence[bytes], namespace_id: bytes | None = None, *,
               reason: _tomb.Reason = _tomb.Reason.REMOVED,
               detail: _tomb.Detail = _tomb.Detail.NONE) -> int:
        """Remove blocks from the index (their bytes become dead space). Returns how many.

        With ``namespace_id`` only blocks of that namespace go: keys of another namespace are
        left alone (a tenant can never delete another tenant's blocks). Each leaves a
        tombstone saying ``reason`` (``kvstore explain``)."""
        ctx = self._ensure_writable()
        keys = [check_key(k, "key") for k in keys]
        if not keys:
            return 0
        with ctx.sh.read() as txn:
            cks = ctx.namespaces.dbkeys(txn, keys, namespace_id)
        return len(_txn.drop_entries(ctx, [(k, None) for k in cks], namespace_id,
                                     reason=reason, detail=detail))

    def delete_owned(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bytes]:
        """Remove the blocks of ``keys`` that belong to ``namespace_id``; returns those keys."""
        ctx = self._ensure_writable()
        keys = [check_key(k, "key") for k in keys]
        namespace_id = check_key(namespace_id, "namespace_id")
        if not keys:
            return []
        gone = _txn.drop_entries(ctx, [(namespace_id + k, None) for k in keys], namespace_id)
        return [ck[KEY_BYTES:] for ck in gone]

    # -- access tracking ------------------------------------------------------------------
    def touch(self, keys: Sequence[bytes], namespace_id: bytes | None = None) -> None:
        """Record an access (last_access = now, hits + 1), buffered and persisted lazily."""
        ctx = self._ensure()
        if self.readonly:
            return
        keys = [check_key(k, "key") for k in keys]
        if namespace_id is not None:
            keys = ctx.namespaces.dbkeys(None, keys, namespace_id)  # no transaction needed
        else:
            with ctx.sh.read() as txn:
                keys = ctx.namespaces.dbkeys(txn, keys, None)
        if ctx.touches.add(keys, ctx.now_us()):
            try:
                self.flush_touches()
            except KVStoreError as e:  # disk full, or a damaged index: not the caller's problem
                log.warning("disk tier %s: could not persist access times: %s", self.path, e)

    def flush_touches(self) -> None:
        """Persist buffered touches now."""
        ctx = self._ensure()
        if self.readonly:
            return
        t = ctx.touches.take()
        if not t:
            return
        try:
            _txn.write_ops(ctx, lambda ops: _txn.apply_touches(ops, t))
        except BaseException:
            ctx.touches.restore(t)
            raise

    # -- eviction and compaction ----------------------------------------------------------
    def evict_to_budget(self, protect: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Evict leaf-first LRU until stored bytes <= capacity. Never evicts a key for which
        ``protect(key)`` is true, nor a block with children on disk. ``protect`` is called
        inside a read transaction and must not call back into this tier."""
        ctx = self._ensure_writable()
        self.flush_touches()
        return _eviction.evict_to_budget(ctx, self.capacity_bytes, protect)

    def compact(self, threshold: float | None = None,
                progress: Callable[[int, int], None] | None = None) -> CompactResult:
        """Rewrite segments whose live fraction fell below ``threshold`` (default: the tier's
        ``compact_threshold``). Crash-safe: the new segment is durable and the moved records
        committed before an old file is unlinked."""
        ctx = self._ensure_writable()
        thr = self.compact_threshold if threshold is None else float(threshold)
        self.flush_touches()
        return _compaction.compact(ctx, thr, self.max_segment_bytes, progress)

    # -- listing and stats ------------------------------------------------------------------
    def records(self, namespace_id: bytes | None = None) -> Iterator[DiskRecord]:
        """Every record (key order), read in chunks of short transactions."""
        for ck, raw in self._iter_raw(namespace_id):
            try:
                r = decode_record(raw)
            except RecordError:
                continue
            if r.namespace_id == ck[:KEY_BYTES]:
                yield disk_record(ck[KEY_BYTES:], r)

    def _iter_raw(self, namespace_id: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(dbkey, record) pairs in key order (of one namespace: a range of its prefix)."""
        sh = self._ensure().sh
        db = sh.dbs[DB_BLOCKS]
        last: bytes | None = None
        start = namespace_id
        while True:
            batch = []
            with sh.read() as txn:
                cur = txn.cursor(db=db)
                if last is not None:
                    ok = cur.set_range(last)
                    if ok and cur.key() == last:
                        ok = cur.next()
                else:
                    ok = cur.set_range(start) if start is not None else cur.first()
                while ok and len(batch) < _RECORDS_CHUNK:
                    k = cur.key()
                    if start is not None and not k.startswith(start):
                        ok = False
                        break
                    batch.append((k, cur.value()))
                    ok = cur.next()
            yield from batch
            if len(batch) < _RECORDS_CHUNK or not ok:
                return
            last = batch[-1][0]

    def stats(self) -> DiskStats:
        ctx = self._ensure()
        blocks, stored, raw, segs, seg_file, seg_data = ctx.totals()
        c = ctx.counters
        return DiskStats(
            blocks=blocks, stored_bytes=stored, raw_bytes=raw, capacity_bytes=self.capacity_bytes,
            segments=segs, segment_bytes=seg_file, dead_bytes=max(0, seg_data - stored),
            reads_ok=c.reads_ok, read_missing=c.read_missing, read_damaged=c.read_damaged,
            blocks_written=c.blocks_written, write_errors=c.write_errors, evictions=c.evictions,
            compactions=c.compactions,
        )

    # -- check / repair -----------------------------------------------------------------------
    def check(self, fix: bool = False, *, grace_s: float | None = None,
              verify_data: bool = True, scope: _check.FixScope | None = None) -> list[Finding]:
        """Find (and with ``fix`` remove) orphan segments and temp files older than the grace
        period, records pointing at missing or short segments, checksum failures, undecodable
        records and inconsistent side indexes. Records are removed before files. Intact
        blocks of a segment whose header is damaged are rewritten into a fresh segment, not
        dropped. With ``scope`` (a plan that was shown and confirmed), ``fix`` repairs only
        what it names."""
        ctx = self._ensure()
        if fix and self.readonly:
            raise DiskError(errno.EROFS, f"cannot fix: the disk tier at {self.path} is open read-only")
        if not self.readonly:
            self.flush_touches()
        grace = self.orphan_grace_s if grace_s is None else float(grace_s)
        return _check.run_check(ctx, fix=fix, grace_s=grace, verify_data=verify_data,
                                scope=scope, max_segment_bytes=self.max_segment_bytes)

    def rewrite_unlisted(self, keys: Sequence[bytes]) -> _check.RewriteResult:
        """Copy blocks their segment header does not describe (``keys``: index keys) into
        fresh segments, as ``check(fix=True)`` does (:func:`check.rewrite_unlisted`)."""
        return _check.rewrite_unlisted(self._ensure_writable(), keys, self.max_segment_bytes)

    # -- tombstones (``kvstore explain``) ----------------------------------------------------
    def tombstones_kept(self) -> bool:
        """Whether the store keeps tombstones (its index has the database)."""
        return _tomb.kept_in(self._ensure())

    def tombstones(self, namespace_id: bytes, keys: Sequence[bytes]) -> list | object:
        """The tombstones of ``keys`` of ``namespace_id`` (``tombstones.NOT_KEPT`` when the
        store keeps none), in one read transaction."""
        return _tomb.lookup_in(self._ensure(), namespace_id, keys)

    def record_tombstones(self, items: Iterable[tuple[bytes, int]], reason: _tomb.Reason,
                          tier_code: _tomb.TierCode, *, detail: _tomb.Detail = _tomb.Detail.NONE,
                          removed_us: int | None = None) -> None:
        """Add tombstones ((dbkey, created us) each) in a write transaction of their own."""
        _tomb.record_in(self._ensure_writable(), items, reason, tier_code, detail=detail,
                        removed_us=removed_us)

    # -- a synthetic index (the benchmarks' reopen of a large store) ---------------------
    def add_synthetic_records(self, ns: Namespace, n: int, *, txn_size: int = 250_000) -> None:
        """Register ``ns`` and insert ``n`` records of it without payload straight into the
        index, ``txn_size`` per write transaction (:mod:`kvstore.tiers.disk.synthetic`): chains
        of 16 blocks, leaves in the LRU index, consistent totals, the same records every time.
        The segment files they name do not exist, so only opening, lookups, listing and stats
        mean anything afterwards: for timing what depends on the index's size alone. Meant
        for a new, empty tier."""
        self.register_namespace(ns)
        _synthetic.add_records(self._ensure_writable(), ns, n, txn_size=txn_size)

    # -- lifecycle ----------------------------------------------------------------------------
    def close(self) -> None:
        """Flush buffered touches and release files and the index (idempotent)."""
        if self._closed:
            return
        with self._close_lock:
            if self._closed:
                return
            if self._pid == os.getpid():
                if not self.readonly:
                    try:
                        self.flush_touches()
                    except (KVStoreError, lmdb.Error, OSError) as e:
                        log.warning("disk tier %s: access times not persisted at close: %s",
                                    self.path, e)
                self._ctx.shutdown()  # type: ignore[union-attr]
                release_env(self._ctx.sh)  # type: ignore[union-attr]
            self._closed = True

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DiskTier({self.path!r}, codec={self.codec!r}, readonly={self.readonly})"


def populate_fake_index(path: str, n: int, ns: Namespace, *, txn_size: int = 250_000) -> None:
    """Create a disk tier at ``path`` whose index holds ``n`` records of ``ns`` pointing at
    segment files that do not exist (:meth:`DiskTier.add_synthetic_records`), and close it.
    For reopen-time measurements only: the ``disk`` benchmark and the disk tier's tests."""
    with DiskTier(path, capacity_bytes=1 << 50) as t:
        t.add_synthetic_records(ns, n, txn_size=txn_size)
