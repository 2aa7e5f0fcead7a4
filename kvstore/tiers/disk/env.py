"""The disk index's LMDB environment: one per process per path (a registry keyed by realpath,
refcounted, dropped and re-opened in a forked child), opened only after
:mod:`kvstore.tiers.disk.guard` validated the file, with the readers/writer gate that map
resizes and fork take.

LMDB rules followed here: one ``Environment`` per process per path, every transaction in
``with``, short read transactions, values copied out (``bytes``) before a transaction ends.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import lmdb

from kvstore import filemodes as _modes
from kvstore.errors import DiskError, FormatVersionError
from kvstore.tiers.disk import guard as _guard
from kvstore.tiers.disk import tombstones as _tomb
from kvstore.tiers.disk.index import (
    DB_BLOCKS,
    DB_META,
    DB_NAMES,
    DB_NS,
    DISK_FORMAT_VERSION,
    META_FORMAT,
    META_NEXT_SEGMENT,
    META_TOTALS,
    TOTALS,
    U32,
    U64,
    RecordError,
    decode_u32,
    legacy_key_space,
)

log = logging.getLogger("kvstore.disk")

DEFAULT_MAP_SIZE = 64 << 30
_LMDB_FILES = ("data.mdb", _modes.LMDB_LOCK)

# -- a readers/writer gate: every transaction holds it shared; map resizes and fork hold it
#    exclusively (LMDB: set_mapsize only while no transaction is active in the process) ----

class Gate:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    def acquire_exclusive(self, timeout: float | None = None) -> bool:
        with self._cond:
            self._waiting += 1
            try:
                ok = self._cond.wait_for(lambda: not self._writer and not self._readers, timeout)
                if ok:
                    self._writer = True
                return ok
            finally:
                self._waiting -= 1
                if not ok:
                    self._cond.notify_all()

    def release_exclusive(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()


# -- per-process environment registry -----------------------------------------------------

class SharedEnv:
    """One LMDB environment of this process, shared by every DiskTier on the same path."""

    def __init__(self, realpath: str, env: lmdb.Environment, dbs: dict[bytes, object],
                 writable: bool) -> None:
        self.realpath = realpath
        self.env = env
        self.dbs = dbs
        self.writable = writable
        self.pid = os.getpid()
        self.refs = 0
        self.gate = Gate()
        self.wlock = threading.Lock()  # one write txn at a time in this process

    # transactions ------------------------------------------------------------------------
    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        for _ in range(3):
            try:
                with self.gate.shared(), self.env.begin(buffers=False) as txn:
                    yield txn
                    return
            except lmdb.MapResizedError:
                self._adopt_map_size()
            except lmdb.ReadersFullError as e:
                self._clear_stale_readers(e)
            except _guard.LMDB_CORRUPT as e:
                raise _guard.corrupt_error(self.realpath, e) from e
        raise DiskError(errno.EIO, f"LMDB index at {self.realpath} keeps resizing")

    def write(self, fn):
        """Run ``fn(txn)`` in a write transaction, growing the map on MapFullError (``fn`` must
        be safe to re-run). Returns ``fn``'s result."""
        for _ in range(16):
            try:
                with self.gate.shared(), self.wlock:
                    self._reap_dead_readers()
                    with self.env.begin(write=True) as txn:
                        return fn(txn)
            except lmdb.MapFullError:
                self._grow()
            except lmdb.MapResizedError:
                self._adopt_map_size()
            except lmdb.ReadersFullError as e:
                self._clear_stale_readers(e)
            except _guard.LMDB_CORRUPT as e:
                raise _guard.corrupt_error(self.realpath, e) from e
        raise DiskError(errno.ENOSPC, f"LMDB index at {self.realpath} cannot grow its map")

    def _reap_dead_readers(self) -> int:
        """Free the reader slots of processes that died inside a read transaction, before
        each write transaction. LMDB reuses a freed page only once no reader older than the
        transaction that freed it remains, and it counts a dead process's slot as such a
        reader until every process has closed the index or someone asks it to clear them:
        one engine killed -9 inside a read pinned every page freed after it, and the index
        file grew by every page each later commit copied (~50 pages a put+flush) for as long
        as the others ran. The check scans the reader table, a lock probe per process: well
        under a microsecond beside a commit's fsync. Returns how many slots it cleared."""
        try:
            cleared = self.env.reader_check()
        except lmdb.Error:  # pragma: no cover - best effort; the caller reports what follows
            return 0
        if cleared:
            log.warning("LMDB index %s: cleared %d reader slot(s) left by processes that died "
                        "inside a read (they held slots and kept freed pages from reuse)",
                        self.realpath, cleared)
        return cleared

    def _clear_stale_readers(self, e: lmdb.ReadersFullError) -> None:
        """Every reader slot is taken. A process killed inside a read transaction keeps its
        slot until every process has closed the index (LMDB clears slots of dead processes
        only when asked): after enough such kills, every read of every process failed with
        MDB_READERS_FULL. Clear those slots; raise when none was stale (the table is full of
        live readers)."""
        if not self._reap_dead_readers():
            raise DiskError(errno.EAGAIN, f"the LMDB index at {self.realpath} has no free reader "
                            f"slot ({e}); too many processes and threads read it at once") from e

    def _grow(self) -> None:
        with self.gate.exclusive():
            cur = self.env.info()["map_size"]
            new = cur * 2
            log.info("growing LMDB map of %s from %d to %d bytes", self.realpath, cur, new)
            self.env.set_mapsize(new)

    def _adopt_map_size(self) -> None:
        with self.gate.exclusive():
            self.env.set_mapsize(0)


_registry: dict[str, SharedEnv] = {}
_registry_lock = threading.Lock()


def _open_env(index_dir: str, *, create: bool, readonly: bool, map_size: int) -> SharedEnv:
    kw = dict(subdir=True, max_dbs=len(DB_NAMES) + 2, max_readers=1024, max_spare_txns=0,
              map_size=map_size)
    # before LMDB maps data.mdb: never an empty index over old segment files, never a file
    # shorter than its own metadata says (SIGBUS) — StoreCorruptError naming `kvstore recover`
    _guard.before_open(index_dir)
    if create and not readonly:
        try:
            _modes.make_dirs(index_dir)  # as the store records it: 0700, or 2750 shared
        except OSError as e:
            raise DiskError(e.errno, f"cannot create the disk index directory {index_dir}: {e.strerror}") from e
    elif not os.path.isdir(index_dir):
        raise DiskError(errno.ENOENT, f"no disk tier index at {index_dir} (store was never written)")
    for attempt in range(3):
        before = _guard.dir_id(index_dir)
        env = _lmdb_open(index_dir, create=create, readonly=readonly, kw=kw)
        if _guard.dir_id(index_dir) == before or attempt == 2:
            break
        env.close()  # ``kvstore recover`` swapped the index in while LMDB opened its files
        _guard.before_open(index_dir)
    try:
        _guard.check_snapshot(env, index_dir)  # every page LMDB will read, with plain file I/O
        writable = not env.flags()["readonly"]
        dbs = init_dbs(env, index_dir, create=not readonly)
        if writable:
            _raise_next_segment(env, dbs, index_dir)
    except _guard.LMDB_CORRUPT as e:
        env.close()
        raise _guard.corrupt_error(index_dir, e) from e
    except BaseException:
        env.close()
        raise
    return SharedEnv(os.path.realpath(index_dir), env, dbs, writable)


def _lmdb_open(index_dir: str, *, create: bool, readonly: bool, kw: dict) -> lmdb.Environment:
    try:
        env = lmdb.open(index_dir, readonly=False, create=create and not readonly,
                        mode=_modes.file_mode_in(index_dir), **kw)
        if not readonly:  # data.mdb and lock.mdb as the store records, whatever the umask
            with contextlib.suppress(OSError):  # ours (checked): only a read-only mount fails
                _modes.settle_files(index_dir, _LMDB_FILES)
        return env
    except _guard.LMDB_CORRUPT as e:
        raise _guard.corrupt_error(index_dir, e) from e
    except lmdb.Error as e:
        if not readonly:
            raise DiskError(errno.EIO, f"cannot open the LMDB index at {index_dir}: {e}") from e
        try:  # read-only filesystem or files: open the environment read-only
            return lmdb.open(index_dir, readonly=True, create=False, **kw)
        except _guard.LMDB_CORRUPT as e2:
            raise _guard.corrupt_error(index_dir, e2) from e2
        except lmdb.Error as e2:
            raise DiskError(errno.EIO, f"cannot open the LMDB index at {index_dir}: {e2}") from e2


def init_dbs(env: lmdb.Environment, index_dir: str, *, create: bool) -> dict[bytes, object]:
    dbs: dict[bytes, object] = {}
    try:
        if env.flags()["readonly"]:  # read-only files: py-lmdb opens the dbs in a read txn
            for name in DB_NAMES:
                dbs[name] = env.open_db(name, create=False)
        else:
            for _ in range(8):
                try:
                    with env.begin(write=True) as txn:
                        for name in DB_NAMES:
                            dbs[name] = env.open_db(name, txn=txn, create=create)
                        # optional (not in DB_NAMES: indexes from before it stay intact)
                        dbs[_tomb.DB_TOMBSTONES] = _tomb.open_db(env, txn, create=True)
                        meta = dbs[DB_META]
                        if create and txn.get(META_FORMAT, db=meta) is None:
                            if (txn.stat(meta)["entries"]
                                    or txn.stat(dbs[DB_BLOCKS])["entries"]):
                                # not a new index: never re-initialize it (next_segment!)
                                raise _guard.corrupt_error(
                                    index_dir, "its meta database has no format version")
                            txn.put(META_FORMAT, U32.pack(DISK_FORMAT_VERSION), db=meta)
                            txn.put(META_NEXT_SEGMENT, U64.pack(1), db=meta)
                            txn.put(META_TOTALS, TOTALS.pack(0, 0, 0, 0, 0, 0), db=meta)
                    break
                except lmdb.MapResizedError:
                    env.set_mapsize(0)
    except lmdb.NotFoundError:
        with contextlib.suppress(lmdb.Error):
            if env.stat()["entries"]:  # it has databases, but not ours where they should be
                raise _guard.corrupt_error(index_dir, "a named database cannot be found") from None
        raise DiskError(errno.ENOENT, f"{index_dir} is not a kvstore disk index") from None
    with env.begin() as txn:
        raw = txn.get(META_FORMAT, db=dbs[DB_META])
    if raw is None or len(raw) != 4:
        raise _guard.corrupt_error(index_dir, "it has no readable disk format version")
    (found,) = U32.unpack(raw)
    if found != DISK_FORMAT_VERSION:
        _check_plausible(found, index_dir)
        raise FormatVersionError(
            f"the disk tier at {os.path.dirname(index_dir)} has on-disk format version {found}, "
            f"but this kvstore reads and writes format version {DISK_FORMAT_VERSION}; open it "
            f"with a kvstore release for format {found}, or point the store at a new directory"
        )
    with env.begin() as txn:
        legacy = legacy_key_space(txn, dbs[DB_BLOCKS], dbs[DB_NS])
    if legacy:
        store = os.path.dirname(index_dir)
        raise FormatVersionError(
            f"the disk tier at {store} has on-disk format version 2 as written before "
            "namespaces had key spaces of their own (kvstore before commit 067ffff: its index "
            "keys are 32 bytes), but this kvstore reads format 2 with 64-byte keys (namespace "
            "id + key): every lookup would miss. Run 'kvstore recover --store "
            f"{store}' to rebuild the index in this format (every block is kept, the old "
            "index stays as index.damaged-*), or point the store at a new directory"
        )
    return dbs


def _raise_next_segment(env: lmdb.Environment, dbs: dict[bytes, object], index_dir: str) -> None:
    """Segment ids are never reused: when ``segments/`` holds an id at or past
    ``meta.next_segment`` (an index restored from a backup, or rebuilt), move it past them."""
    _ids, top = _guard.segment_ids(os.path.join(_guard.store_of(index_dir), "segments"))
    if not top:
        return
    meta = dbs[DB_META]
    with env.begin() as txn:
        raw = txn.get(META_NEXT_SEGMENT, db=meta)
    if raw is not None and len(raw) == 8 and U64.unpack(raw)[0] > top:
        return
    for _ in range(8):
        try:
            with env.begin(write=True) as txn:
                raw = txn.get(META_NEXT_SEGMENT, db=meta)
                cur = U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0
                if cur <= top:
                    log.warning("disk index %s: next segment id %d is not past segment %016x "
                                "on disk; raising it to %d", index_dir, cur, top, top + 1)
                    txn.put(META_NEXT_SEGMENT, U64.pack(top + 1), db=meta)
            return
        except lmdb.MapResizedError:
            env.set_mapsize(0)


def _check_plausible(found: int, index_dir: str) -> None:
    """A format version no kvstore will ever write (0, or 1000 and up: a flipped high bit)
    is a damaged record, not a store of another release."""
    if found == 0 or found >= 1000:
        raise _guard.corrupt_error(index_dir, f"its format version record says {found}")


def acquire_env(index_dir: str, *, create: bool, readonly: bool,
                map_size: int = DEFAULT_MAP_SIZE) -> SharedEnv:
    """The process's SharedEnv for ``index_dir`` (opened on first use, refcounted)."""
    real = os.path.realpath(index_dir)
    with _registry_lock:
        sh = _registry.get(real)
        if sh is not None and sh.pid != os.getpid():  # pragma: no cover - at-fork hook handles it
            _registry.pop(real, None)
            sh = None
        if sh is None:
            sh = _open_env(index_dir, create=create, readonly=readonly, map_size=map_size)
            _registry[real] = sh
        else:
            _check_version_again(sh, index_dir)
        sh.refs += 1
        return sh


def _check_version_again(sh: SharedEnv, index_dir: str) -> None:
    with sh.read() as txn:
        raw = txn.get(META_FORMAT, db=sh.dbs[DB_META])
    try:
        found = decode_u32(raw, "the format version")
    except RecordError as e:
        raise _guard.corrupt_error(index_dir, e) from None
    if found != DISK_FORMAT_VERSION:
        _check_plausible(found, index_dir)
        raise FormatVersionError(
            f"the disk tier at {os.path.dirname(index_dir)} has on-disk format version {found}, "
            f"but this kvstore reads and writes format version {DISK_FORMAT_VERSION}"
        )


def release_env(sh: SharedEnv) -> None:
    with _registry_lock:
        sh.refs -= 1
        if sh.refs > 0 or sh.pid != os.getpid():
            return
        if _registry.get(sh.realpath) is sh:
            del _registry[sh.realpath]
        with sh.gate.exclusive():
            sh.env.close()


def open_in_process(index_dir: str) -> bool:
    """Whether this process has the environment of ``index_dir`` open."""
    return os.path.realpath(index_dir) in _registry


# fork: hold every gate exclusively across fork() so that no transaction is active; in the
# child close the inherited environments (LMDB forbids using them after fork) and forget them;
# DiskTier objects notice the pid change and acquire a fresh environment.
_fork_held: list[SharedEnv] = []


def _before_fork() -> None:
    _registry_lock.acquire()
    for sh in list(_registry.values()):
        if sh.gate.acquire_exclusive(timeout=10.0):
            _fork_held.append(sh)


def _after_fork_parent() -> None:
    for sh in _fork_held:
        sh.gate.release_exclusive()
    _fork_held.clear()
    _registry_lock.release()


def _after_fork_child() -> None:
    global _registry_lock
    held = {id(sh) for sh in _fork_held}
    for sh in list(_registry.values()):
        sh.pid = -1  # never used again in this process
        if id(sh) in held:
            with contextlib.suppress(Exception):  # best effort
                sh.env.close()
    _registry.clear()
    _fork_held.clear()
    _registry_lock = threading.Lock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                    after_in_child=_after_fork_child)

