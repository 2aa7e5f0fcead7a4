"""What the disk tier's modules share: one :class:`DiskContext` per :class:`DiskTier` and
process (re-created after fork), owned by the tier and handed to ``reads``, ``writes``,
``txn``, ``eviction``, ``compaction`` and ``check``. It holds the LMDB environment, the
segment directory and its fd cache, the counters, the clock, the namespace cache, the
buffered access times, the reserved segment ids and the reading threads; the modules read
and change the tier's state only through it, never through the tier.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvstore.errors import DiskError
from kvstore.tiers.base import check_key
from kvstore.tiers.disk.env import SharedEnv
from kvstore.tiers.disk.index import (
    DB_BLOCKS,
    DB_META,
    DB_NS,
    META_TOTALS,
    TOTALS,
    Rec,
    RecordError,
    decode_namespace,
    encode_namespace,
    lookup_record,
)
from kvstore.tiers.disk.records import Counters, NamespaceInfo, NsCache, ns_cache_entry
from kvstore.tiers.disk.segments import FdCache

log = logging.getLogger("kvstore.disk")


class NamespaceCache:
    """The namespaces registered in the index, cached per process (another process may
    register one: a miss reloads them)."""

    def __init__(self, sh: SharedEnv, path: str) -> None:
        self._sh = sh
        self._path = path
        self._ns: dict[bytes, NsCache] = {}
        self._lock = threading.Lock()

    def load(self) -> None:
        with self._sh.read() as txn:
            self.load_in(txn)

    def load_in(self, txn) -> None:
        found = {}
        for k, v in txn.cursor(db=self._sh.dbs[DB_NS]):
            try:
                found[k] = NamespaceInfo(k, *decode_namespace(v))
            except RecordError as e:
                log.warning("disk tier %s: namespace record %s is unreadable: %s",
                            self._path, k.hex()[:16], e)
        with self._lock:
            for k, info in found.items():
                self._ns[k] = ns_cache_entry(info)

    def get(self, ns_id: bytes) -> NsCache | None:
        """The cached namespace ``ns_id`` (reloaded once when unknown), or None."""
        e = self._ns.get(ns_id)
        if e is None:
            self.load()  # another process may have registered it
            e = self._ns.get(ns_id)
        return e

    def cached(self, ns_id: bytes) -> bool:
        """Whether ``ns_id`` is in the cache (no reload)."""
        return ns_id in self._ns

    def add(self, info: NamespaceInfo) -> None:
        with self._lock:
            self._ns[info.namespace_id] = ns_cache_entry(info)

    def infos(self) -> list[NamespaceInfo]:
        return [e.info for e in self._ns.values()]

    def records(self, ids: Iterable[bytes]) -> dict[bytes, bytes]:
        """The index records of the namespaces ``ids`` (for a segment's header)."""
        out = {}
        for nid in set(ids):
            e = self.get(nid)
            if e is not None:
                i = e.info
                out[nid] = encode_namespace((i.model_id, i.model_revision, i.dtype, i.num_layers,
                                             i.kv_planes, i.block_tokens, i.num_kv_heads,
                                             i.head_dim, i.tp_rank, i.tp_size, i.format_version,
                                             tuple(i.extras)))
        return out

    def dbkeys(self, txn, keys: Sequence[bytes], namespace_id: bytes | None) -> list[bytes]:
        """The LMDB keys (namespace id ‖ key) of ``keys``: in ``namespace_id``'s key space,
        or (None) in whichever known namespace holds each key (``txn``: a read transaction)."""
        if namespace_id is not None:
            ns = check_key(namespace_id, "namespace_id")
            return [ns + k for k in keys]
        db = self._sh.dbs[DB_BLOCKS]
        out = []
        reloaded = False
        for k in keys:
            found = next((n + k for n in self._ns if txn.get(n + k, db=db) is not None), None)
            if found is None and not reloaded:
                reloaded = True
                self.load_in(txn)  # another process may have added one
                found = next((n + k for n in self._ns if txn.get(n + k, db=db) is not None), None)
            out.append(found if found is not None else bytes(32) + k)
        return out


class TouchBuffer:
    """Accesses (dbkey -> (last access us, hits)) buffered until they are persisted."""

    def __init__(self, flush_entries: int, flush_interval_us: int) -> None:
        self._lock = threading.Lock()
        self._buf: dict[bytes, tuple[int, int]] = {}
        self._since = 0
        self._entries = flush_entries
        self._interval_us = flush_interval_us

    def add(self, keys: Iterable[bytes], now: int) -> bool:
        """Record an access of each key at ``now``; True when the buffer is due a flush."""
        with self._lock:
            buf = self._buf
            if not buf:
                self._since = now
            for k in keys:
                e = buf.get(k)
                buf[k] = (now, e[1] + 1 if e else 1)
            return len(buf) >= self._entries or now - self._since >= self._interval_us

    def take(self) -> dict[bytes, tuple[int, int]]:
        with self._lock:
            t, self._buf = self._buf, {}
            return t

    def restore(self, t: dict[bytes, tuple[int, int]]) -> None:
        """Put back what :meth:`take` returned and could not be persisted."""
        if not t:
            return
        with self._lock:
            for k, (ts, h) in t.items():
                e = self._buf.get(k)
                self._buf[k] = (max(ts, e[0]), h + e[1]) if e else (ts, h)


class SegmentIds:
    """Segment ids reserved for this process (``txn.alloc_segment_ids`` takes them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: list[int] = []

    def take(self, n: int, reserve: Callable[[int], list[int]]) -> list[int]:
        """``n`` ids; ``reserve(want)`` reserves ``want`` more (at least ``n``) when short."""
        with self._lock:
            if len(self._pool) < n:
                self._pool.extend(reserve(n - len(self._pool)))
            out, self._pool = self._pool[:n], self._pool[n:]
            return out


class DiskContext:
    """The per-process state of one :class:`~kvstore.tiers.disk.DiskTier` that its modules
    share (see the module's docstring). The tier checks that it is open (and re-creates its
    context after a fork) before it hands the context on."""

    def __init__(self, *, path: str, index_dir: str, segdir: str, sh: SharedEnv,
                 readonly: bool, max_open_files: int, clock: Callable[[], float],
                 read_threads: int, touch_flush_entries: int,
                 touch_flush_interval_us: int) -> None:
        self.path = path
        self.index_dir = index_dir
        self.segdir = segdir
        self.sh = sh
        self.readonly = readonly
        self.fds = FdCache(segdir, max_open_files)
        self.counters = Counters()
        self.clock = clock
        self.read_threads = read_threads
        self.namespaces = NamespaceCache(sh, path)
        self.touches = TouchBuffer(touch_flush_entries, touch_flush_interval_us)
        self.segment_ids = SegmentIds()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def now_us(self) -> int:
        return int(round(self.clock() * 1e6))

    def thread_pool(self) -> ThreadPoolExecutor:
        """The reading (and encoding) threads, started on first use."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads,
                                                thread_name_prefix="kvstore-disk")
            return self._pool

    def require_writable(self) -> SharedEnv:
        if self.readonly:
            raise DiskError(errno.EROFS, f"the disk tier at {self.path} is open read-only")
        return self.sh

    def get_rec(self, ck: bytes) -> Rec | None:
        """The decoded index record of dbkey ``ck`` now (a short read transaction)."""
        sh = self.sh
        with sh.read() as txn:
            return lookup_record(txn, sh.dbs[DB_BLOCKS], ck)

    def totals(self) -> list[int]:
        """(blocks, stored bytes, raw bytes, segments, segment file bytes, segment data)."""
        sh = self.sh
        with sh.read() as txn:
            return list(TOTALS.unpack(txn.get(META_TOTALS, db=sh.dbs[DB_META])))

    def shutdown(self) -> None:
        """Stop the reading threads and close the cached files (the tier releases ``sh``)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.fds.close()
