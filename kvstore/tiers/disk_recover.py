"""``kvstore recover``: rebuild a store's disk index from its segment files (``docs/format.md``,
"Recovery").

Every segment describes itself: its header lists each block's key, namespace, parent, codec,
raw size and checksum. Recovery reads the headers, then every payload in large sequential
reads (a thread per segment file, xxh3 releases the GIL) and keeps a block only when its
bytes verify against the checksum bound to its key and namespace. A key found in several
segments (a compaction's copy, an interrupted write) keeps the copy in the newest segment
that verifies. The new index is written next to the old one (``index.recover-*``), validated,
and swapped in with one ``rename`` (``RENAME_EXCHANGE`` where the kernel has it); the old
index is moved to ``index.damaged-<time>/`` and never deleted. Segment files are only read.

Namespace records (model id, revision, layout) come from the segment headers, which carry
the records of their blocks' namespaces; failing that they are salvaged from the old
``data.mdb`` by a byte scan (no LMDB: the file may be damaged). Either way they are kept only
when their content hashes to their namespace id.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import lmdb
import msgpack
import numpy as np

from kvstore.errors import KVStoreError, StoreLockedError
from kvstore.tiers import codec as _codec
from kvstore.tiers import disk_guard as _guard
from kvstore.tiers import disk_index as di
from kvstore.tiers import segments as _seg

log = logging.getLogger("kvstore.disk")

__all__ = ["RecoverError", "RecoverFinding", "RecoverResult", "recover"]

#: payload bytes read per ``preadv`` (whole blocks; a larger block is one read of its own):
#: small enough that what was just read is still in the CPU cache when it is checksummed
#: (16 MiB reads ran at half the speed of 2 MiB ones from the page cache)
READ_CHUNK = 2 << 20
#: ids reserved past the largest one found (engines reserve segment ids in chunks of 64)
ID_MARGIN = 64
_RECORDS_PER_TXN = 200_000
_KEY = 32

#: ``progress(bytes_done, bytes_total, blocks_done, blocks_total)``
Progress = Callable[[int, int, int, int], None]


class RecoverError(KVStoreError, RuntimeError):
    """Recovery cannot run (no store, no segments directory, a daemon or engine holds the
    store); nothing was changed."""


@dataclass(frozen=True, slots=True)
class RecoverFinding:
    kind: str  # bad_segment | checksum_mismatch | short_segment | bad_entry | temp_file |
    #            segment_id_mismatch | missing_namespace
    path: str
    key: str | None  # block key (hex)
    detail: str


@dataclass(frozen=True, slots=True)
class RecoverResult:
    store: str
    dry_run: bool
    index_state: str  # missing | empty | damaged | intact | rebuilt (with --force)
    index_problem: str | None  # why the old index was not usable
    done: bool  # a new index was swapped in
    segments: int  # segment files found
    segments_skipped: int  # unreadable headers, other formats
    blocks_found: int  # entries in the segment headers
    blocks_recovered: int  # records in the new index (one per key)
    blocks_bad: int  # entries whose bytes do not verify (each counted, none kept)
    duplicates: int  # verified copies not used (the key is in a newer segment too)
    namespaces: int  # namespace records written
    namespaces_missing: tuple[str, ...]  # namespace ids with blocks but no record found
    stored_bytes: int  # of the recovered blocks
    raw_bytes: int
    bytes_read: int  # segment bytes read and verified
    next_segment: int
    damaged_index: str | None  # where the old index is now
    seconds: float
    read_seconds: float  # reading + verifying payloads
    findings: tuple[RecoverFinding, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Every block of every segment recovered (or nothing needed recovery)."""
        return self.blocks_bad == 0 and self.segments_skipped == 0

    @property
    def read_bytes_per_s(self) -> float:
        return self.bytes_read / self.read_seconds if self.read_seconds > 0 else 0.0


@dataclass(slots=True)
class _Entry:
    key: bytes
    ns: bytes
    parent: bytes | None
    codec: int
    raw: int
    checksum: int
    offset: int  # absolute
    stored: int
    ok: bool = False


@dataclass(slots=True)
class _Segment:
    sid: int
    path: str
    size: int
    data_start: int
    mtime_us: int
    entries: list[_Entry]
    namespaces: dict[bytes, bytes] = field(default_factory=dict)  # id -> record, from the header


# -- locking: nobody else may have the store open ---------------------------------------------

class _StoreLock:
    """Refuse when a daemon serves the store or any process (this one included) has its LMDB
    environment open; while held, an engine that starts waits in LMDB's open."""

    def __init__(self, store: str) -> None:
        self.store = store
        self.fd = -1

    def __enter__(self) -> _StoreLock:
        store = self.store
        sock = _daemon_socket(store)
        if sock is not None:
            raise StoreLockedError(f"the store at {store} is served by the kvstore daemon at "
                                   f"{sock}: stop it before `kvstore recover`")
        index_dir = os.path.join(store, "index")
        if os.path.realpath(index_dir) in di._registry:
            raise StoreLockedError(f"this process has the store at {store} open: close it "
                                   "before recovering")
        lock = os.path.join(index_dir, "lock.mdb")
        try:
            self.fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return self
        except OSError as e:
            raise RecoverError(f"cannot open {lock}: {e.strerror}") from None
        try:
            # every LMDB process holds a shared fcntl lock on byte 0 of lock.mdb
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
        except OSError as e:
            os.close(self.fd)
            self.fd = -1
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise StoreLockedError(
                    f"the store at {store} is open in another process (an engine or an admin "
                    "command holds its LMDB lock): stop every engine using it, then run "
                    "`kvstore recover` again") from None
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the lock
            self.fd = -1


def _daemon_socket(store: str) -> str | None:
    try:
        from kvstore.lockfile import read_daemon_lock
    except ImportError:
        return None
    try:
        rec = read_daemon_lock(store, wait=0.5)
    except Exception:  # an unreadable record still means a daemon holds the lock
        return "(unknown socket)"
    return None if rec is None else rec.socket


# -- scanning segment headers ------------------------------------------------------------------

_NS_CACHE: dict[str, bytes] = {}


def _parse_entry(name: str, info: object, meta: object, start: int) -> _Entry:
    """One header entry; ValueError (a message) when it does not describe a valid block."""
    try:
        cname, raw_s, csum_s, ns_s, parent_s = meta.split(";")  # type: ignore[union-attr]
        b, e = info["data_offsets"]  # type: ignore[index]
        key = bytes.fromhex(name)
        ns = _NS_CACHE.get(ns_s)
        if ns is None:
            ns = _NS_CACHE.setdefault(ns_s, bytes.fromhex(ns_s))
        parent = bytes.fromhex(parent_s) if parent_s else None
        raw, checksum, b, e = int(raw_s), int(csum_s, 16), int(b), int(e)
    except (AttributeError, ValueError, TypeError, KeyError) as ex:
        raise ValueError(f"malformed entry or block metadata {str(meta)[:80]!r}: {ex}") from None
    cid = _codec.CODEC_IDS.get(cname)
    if cid is None:
        raise ValueError(f"unknown codec {cname!r}")
    if (len(key) != _KEY or len(ns) != _KEY or parent is not None and len(parent) != _KEY
            or len(csum_s) != 16):
        raise ValueError("malformed key, checksum, namespace or parent")
    stored = e - b
    if b < 0:
        raise ValueError(f"data_offsets [{b}, {e}] out of range")
    try:  # the record it becomes must decode: the index's own bounds
        di.check_record_bounds(cid, 1, start + b, stored, raw)
    except di.RecordError as ex:
        raise ValueError(str(ex)) from None
    return _Entry(key, ns, parent, cid, raw, checksum, start + b, stored)


def _rec(en: _Entry, sid: int, t_us: int) -> di.Rec:
    return di.Rec(en.codec, 0, sid, en.offset, en.stored, en.raw, en.checksum, t_us, t_us, en.ns,
                  en.parent)


def _scan_segment(sid: int, path: str, findings: list[RecoverFinding]) -> _Segment | None:
    try:
        obj, start, size = _seg.read_header(path)
        mtime_us = int(os.stat(path).st_mtime * 1e6)
    except (OSError, _seg.SegmentFormatError) as e:
        findings.append(RecoverFinding("bad_segment", path, None, f"header unreadable: {e}"))
        return None
    meta = obj.get("__metadata__")
    if not isinstance(meta, dict):
        findings.append(RecoverFinding("bad_segment", path, None, "no __metadata__"))
        return None
    fmt = meta.get("kvstore.format")
    if fmt != _seg.SEGMENT_FORMAT:
        findings.append(RecoverFinding(
            "bad_segment", path, None, f"segment format {fmt!r}; this kvstore recovers format "
            f"{_seg.SEGMENT_FORMAT} (its checksums would not verify)"))
        return None
    if meta.get("kvstore.segment") != f"{sid:016x}":
        findings.append(RecoverFinding(
            "segment_id_mismatch", path, None, f"the header names segment "
            f"{meta.get('kvstore.segment')!r}; its blocks are recovered under the file's id "
            f"{sid:016x} (they verify by content)"))
    entries: list[_Entry] = []
    namespaces: dict[bytes, bytes] = {}
    for mk, mv in meta.items():
        if isinstance(mk, str) and mk.startswith(_seg.NAMESPACE_META_PREFIX):
            rec = _header_namespace(mk[len(_seg.NAMESPACE_META_PREFIX):], mv)
            if rec is None:
                findings.append(RecoverFinding("bad_entry", path, mk[:64],
                                               "namespace record does not verify against its id"))
            else:
                namespaces[rec[0]] = rec[1]
    for name, info in obj.items():
        if name == "__metadata__" or name.startswith(_seg.NAMESPACE_META_PREFIX):
            continue
        try:
            entries.append(_parse_entry(name, info, meta.get(name), start))
        except ValueError as e:
            findings.append(RecoverFinding("bad_entry", path, name[:64], str(e)))
    entries.sort(key=lambda en: en.offset)
    return _Segment(sid, path, size, start, mtime_us, entries, namespaces)


def _header_namespace(nid_hex: str, value: object) -> tuple[bytes, bytes] | None:
    """(id, record) of a namespace record carried in a segment header, if it hashes to its id."""
    try:
        nid, raw = bytes.fromhex(nid_hex), bytes.fromhex(str(value))
        fields = di.decode_namespace(raw)
    except (ValueError, di.RecordError):
        return None
    if len(nid) != 32 or di.namespace_record_id(fields) != nid:
        return None
    return nid, di.encode_namespace(fields)


# -- reading and verifying payloads ------------------------------------------------------------

def _runs(entries: list[_Entry]) -> list[list[_Entry]]:
    """Adjacent entries in runs of up to READ_CHUNK bytes (a larger entry alone)."""
    out: list[list[_Entry]] = []
    run: list[_Entry] = []
    end = size = 0
    for en in entries:
        if run and (en.offset != end or size + en.stored > READ_CHUNK):
            out.append(run)
            run, size = [], 0
        run.append(en)
        end = en.offset + en.stored
        size += en.stored
    if run:
        out.append(run)
    return out


class _Verifier:
    def __init__(self, findings: list[RecoverFinding], progress: Progress | None,
                 total_bytes: int, total_blocks: int) -> None:
        self.findings = findings
        self.lock = threading.Lock()
        self.progress = progress
        self.total = (total_bytes, total_blocks)
        self.done = [0, 0]
        self.bytes_read = 0
        self.local = threading.local()

    def _buf(self, n: int) -> memoryview:
        b = getattr(self.local, "buf", None)
        if b is None or len(b) < n:
            b = self.local.buf = memoryview(bytearray(max(n, READ_CHUNK)))
        return b[:n]

    def task(self, seg: _Segment, runs: list[list[_Entry]]) -> None:
        bad: list[RecoverFinding] = []
        nread = 0
        try:
            fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            for run in runs:
                for en in run:
                    bad.append(RecoverFinding("short_segment", seg.path, en.key.hex(),
                                              f"cannot open: {e.strerror}"))
            self._report(bad, 0, sum(len(r) for r in runs), 0)
            return
        try:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, runs[0][0].offset, 0, os.POSIX_FADV_SEQUENTIAL)
            for run in runs:
                first = run[0].offset
                total = run[-1].offset + run[-1].stored - first
                buf = self._buf(total)
                try:
                    n = _seg.pread_into(fd, buf, first)
                except OSError as e:
                    n = 0
                    why = f"read error: {e.strerror}"
                else:
                    why = ""
                nread += n
                for en in run:
                    rel = en.offset - first
                    if rel + en.stored > n:
                        bad.append(RecoverFinding(
                            "short_segment", seg.path, en.key.hex(),
                            why or f"the file ends before this block ({seg.size} bytes; block "
                            f"at {en.offset}+{en.stored})"))
                        continue
                    payload = buf[rel:rel + en.stored]
                    if en.codec == _codec.CODEC_NONE:
                        en.ok = _seg.block_checksum(en.key, en.ns, payload) == en.checksum
                    else:
                        out = np.empty(en.raw, dtype=np.uint8)
                        try:
                            _codec.decompress_into(en.codec, payload, out)
                            en.ok = _seg.block_checksum(en.key, en.ns, out) == en.checksum
                        except _codec.CodecError:
                            en.ok = False
                    if not en.ok:
                        bad.append(RecoverFinding(
                            "checksum_mismatch", seg.path, en.key.hex(),
                            f"the bytes at {en.offset}+{en.stored} do not match the block's "
                            "checksum: not recovered"))
                self._report([], len(run), 0, total if n >= total else n)
        finally:
            os.close(fd)
        self._report(bad, 0, 0, 0, nread)

    def _report(self, bad: list[RecoverFinding], blocks: int, skipped: int, nbytes: int,
                nread: int = 0) -> None:
        with self.lock:
            self.findings.extend(bad)
            self.done[0] += nbytes
            self.done[1] += blocks + skipped
            self.bytes_read += nread
            if self.progress is not None and (blocks or skipped or nbytes):
                self.progress(self.done[0], self.total[0], self.done[1], self.total[1])


def _tasks(s: _Segment, threads: int, nsegs: int) -> list[list[list[_Entry]]]:
    """A segment's runs as one task (a thread reads the file front to back, with readahead),
    or in ``threads`` contiguous pieces when there are fewer segments than threads."""
    runs = _runs(s.entries)
    if not runs:
        return []
    if nsegs >= threads:
        return [runs]
    step = max(1, -(-len(runs) // max(1, threads // max(1, nsegs))))
    return [runs[i:i + step] for i in range(0, len(runs), step)]


def _scan_and_verify(segdir: str, ids: list[int], threads: int,
                     findings: list[RecoverFinding],
                     progress: Progress | None) -> tuple[list[_Segment], int, float]:
    """Scan every segment header and verify every payload; the reading threads start on a
    segment as soon as its header is parsed. Returns (segments, bytes read, seconds)."""
    total_bytes = total_blocks = 0
    for sid in ids:
        with contextlib.suppress(OSError):
            total_bytes += os.path.getsize(os.path.join(segdir, _seg.segment_name(sid)))
    v = _Verifier(findings, progress, total_bytes, 0)
    if progress is not None:
        progress(0, total_bytes, 0, 0)
    segs: list[_Segment] = []
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-recover") if threads > 1 else None
    futures = []
    try:
        for sid in sorted(ids):
            s = _scan_segment(sid, os.path.join(segdir, _seg.segment_name(sid)), findings)
            if s is None:
                continue
            segs.append(s)
            with v.lock:
                total_blocks += len(s.entries)
                v.total = (total_bytes, total_blocks)
                v.done[0] += s.size - sum(en.stored for en in s.entries)  # header, gaps
            for runs in _tasks(s, threads, len(ids)):
                if pool is None:
                    v.task(s, runs)
                else:
                    futures.append(pool.submit(v.task, s, runs))
        for f in futures:
            f.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return segs, v.bytes_read, time.perf_counter() - t0


# -- namespace records -------------------------------------------------------------------------

def salvage_namespaces(files: list[str], wanted: set[bytes]) -> dict[bytes, bytes]:
    """Namespace records (encoded) for ``wanted`` ids found anywhere in ``files`` (old
    ``data.mdb`` files), by a byte scan: no LMDB, so a damaged file cannot crash it. A record
    counts only when its fields hash to the id it is kept under."""
    found: dict[bytes, bytes] = {}
    marker = bytes([0x9D, di.NS_RECORD_VERSION])  # msgpack fixarray(13), version 1
    chunk = 64 << 20
    overlap = 1 << 16
    for path in files:
        if not wanted - found.keys():
            break
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            pos = 0
            while pos < size and wanted - found.keys():
                data = os.pread(fd, chunk + overlap, pos)
                if not data:
                    break
                i = data.find(marker)
                while 0 <= i < min(len(data), chunk):
                    _try_record(data, i, wanted, found)
                    i = data.find(marker, i + 1)
                pos += chunk
        except OSError:
            pass
        finally:
            os.close(fd)
    return found


def _try_record(data: bytes, i: int, wanted: set[bytes], found: dict[bytes, bytes]) -> None:
    up = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=1 << 20,
                          max_str_len=1 << 16, max_bin_len=0, max_array_len=1024,
                          max_map_len=0, max_ext_len=0)
    up.feed(data[i:i + (1 << 18)])
    try:
        up.unpack()
    except Exception:  # noqa: BLE001 - not a record here
        return
    raw = data[i:i + up.tell()]
    try:
        fields = di.decode_namespace(raw)
    except di.RecordError:
        return
    nid = di.namespace_record_id(fields)
    if nid is not None and nid in wanted and nid not in found:
        found[nid] = di.encode_namespace(fields)


# -- the swap ----------------------------------------------------------------------------------

_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (``renameat2(RENAME_EXCHANGE)``); False when unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(-100, os.fsencode(a), -100, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        _seg.fsync_dir(path)


def _free_name(base: str) -> str:
    if not os.path.lexists(base):
        return base
    for i in range(1, 1000):
        p = f"{base}-{i}"
        if not os.path.lexists(p):
            return p
    raise RecoverError(f"too many {base}* directories")


def _swap_in(store: str, new_dir: str, stamp: str) -> str | None:
    """Put ``new_dir`` at ``store/index``; the old index (if any) goes to
    ``index.damaged-<stamp>``, whose path is returned."""
    index_dir = os.path.join(store, "index")
    if not os.path.lexists(index_dir):
        os.rename(new_dir, index_dir)
        _fsync_dir(store)
        return None
    damaged = _free_name(os.path.join(store, f"index.damaged-{stamp}"))
    if _exchange(new_dir, index_dir):  # one step: index/ is the new index from now on
        os.rename(new_dir, damaged)
    else:  # two steps: a crash in between leaves no index/ (open refuses; recover again)
        os.rename(index_dir, damaged)
        os.rename(new_dir, index_dir)
    _fsync_dir(store)
    return damaged


# -- writing the new index ---------------------------------------------------------------------

class _Shim:
    """What :func:`kvstore.tiers.disk_check.rebuild_side_indexes` needs of a DiskTier."""

    def __init__(self, sh: di.SharedEnv, segdir: str) -> None:
        self._sh = sh
        self._segdir = segdir

    def _write_raw(self, fn):  # noqa: ANN001, ANN202
        return self._sh.write(fn)

    def _unlink_segments(self, sids) -> None:  # noqa: ANN001 - recovery never deletes files
        if sids:
            log.warning("recover: %d segment(s) without live blocks left in place", len(sids))


def _write_index(new_dir: str, segdir: str, chosen: list[tuple[_Segment, _Entry]],
                 ns_records: dict[bytes, bytes], next_segment: int) -> None:
    from kvstore.tiers.disk_check import rebuild_side_indexes

    os.makedirs(new_dir)
    # not live until swapped in: commits without fsync, one sync at the end
    env = lmdb.open(new_dir, subdir=True, max_dbs=len(di._DB_NAMES) + 2, max_readers=126,
                    map_size=di.DEFAULT_MAP_SIZE, max_spare_txns=0, sync=False, metasync=False)
    try:
        dbs = di._init_dbs(env, new_dir, create=True)
        sh = di.SharedEnv(os.path.realpath(new_dir), env, dbs, True)
        items = sorted((di.dbkey(en.ns, en.key), di.encode_record(_rec(en, s.sid, s.mtime_us)))
                       for s, en in chosen)
        live: dict[int, list[int]] = {}
        for s, en in chosen:
            lv = live.setdefault(s.sid, [0, 0])
            lv[0] += 1
            lv[1] += en.stored
        segs = {s.sid: s for s, _en in chosen}
        for i in range(0, max(1, len(items)), _RECORDS_PER_TXN):
            part = items[i:i + _RECORDS_PER_TXN]

            def put_blocks(txn, part=part) -> None:  # noqa: ANN001
                txn.cursor(db=dbs[di.DB_BLOCKS]).putmulti(part, append=True)
            sh.write(put_blocks)

        def put_rest(txn) -> None:  # noqa: ANN001
            for nid, rec in ns_records.items():
                txn.put(nid, rec, db=dbs[di.DB_NS])
            for sid, (n, b) in live.items():
                s = segs[sid]
                txn.put(di.BE64.pack(sid), di.encode_seginfo(di.SegInfo(
                    n, s.size, s.size - s.data_start, b, s.mtime_us)), db=dbs[di.DB_SEGS])
            txn.put(di.META_NEXT_SEGMENT, di.U64.pack(next_segment), db=dbs[di.DB_META])
        sh.write(put_rest)
        # children, lru, segment accounting and totals: derived from the records
        rebuild_side_indexes(_Shim(sh, segdir))  # type: ignore[arg-type]
        env.sync(True)
    finally:
        env.close()
    _fsync_dir(new_dir)


# -- the whole recovery ------------------------------------------------------------------------

def _index_state(index_dir: str) -> tuple[str, str | None]:
    data = os.path.join(index_dir, "data.mdb")
    try:
        size = os.stat(data).st_size
    except FileNotFoundError:
        return "missing", "index/data.mdb does not exist"
    except OSError as e:
        return "damaged", f"index/data.mdb cannot be read: {e.strerror}"
    if size == 0:
        return "empty", "index/data.mdb has 0 bytes"
    chk = _guard.check_index(index_dir, full=True)
    if not chk.ok:
        return "damaged", chk.problem
    if not chk.report or not chk.report.databases:
        return "empty", "the index holds no databases"
    # structurally sound: LMDB can read it safely; is it a kvstore index of this format?
    try:
        env = lmdb.open(index_dir, subdir=True, readonly=True, lock=False,
                        max_dbs=len(di._DB_NAMES) + 2)
    except lmdb.Error as e:
        return "damaged", f"LMDB cannot open it: {e}"
    try:
        db = env.open_db(di.DB_META, create=False)
        with env.begin() as txn:
            raw = txn.get(di.META_FORMAT, db=db)
    except lmdb.Error as e:
        return "damaged", f"LMDB cannot read it: {e}"
    finally:
        env.close()
    try:
        found = di.decode_u32(raw, "the format version")
    except di.RecordError as e:
        return "damaged", str(e)
    if found != di.DISK_FORMAT_VERSION:
        return "damaged", (f"format version {found}, this kvstore uses "
                           f"{di.DISK_FORMAT_VERSION}")
    return "intact", None


def recover(path: str | os.PathLike[str], *, dry_run: bool = False, force: bool = False,
            threads: int | None = None, progress: Progress | None = None) -> RecoverResult:
    """Rebuild the disk index of the store at ``path`` from its segment files.

    Refuses (:class:`StoreLockedError`) while any process has the store open. Does nothing
    when the index is intact, unless ``force``. With ``dry_run`` every payload is still
    read and verified, and nothing is written."""
    t0 = time.perf_counter()
    store = os.path.abspath(os.path.expanduser(os.fspath(path)))
    segdir = os.path.join(store, "segments")
    index_dir = os.path.join(store, "index")
    if not os.path.isdir(store):
        raise RecoverError(f"no kvstore store at {store}: the directory does not exist")
    if not os.path.isdir(segdir):
        raise RecoverError(f"{store} has no segments/ directory: there is nothing to recover "
                           "from")
    threads = max(1, int(threads if threads is not None else min(4, os.cpu_count() or 2)))
    state, problem = _index_state(index_dir)
    findings: list[RecoverFinding] = []
    ids, top = _guard.segment_ids(segdir)
    if state == "intact" and not force:
        return RecoverResult(store, dry_run, state, None, False, len(ids), 0, 0, 0, 0, 0, 0,
                             (), 0, 0, 0, 0, None, time.perf_counter() - t0, 0.0)
    with _StoreLock(store):
        if state == "intact":
            state = "rebuilt"
        for name in sorted(os.listdir(segdir)):
            if _seg.TEMP_RE.match(name):
                findings.append(RecoverFinding(
                    "temp_file", os.path.join(segdir, name), None,
                    "temporary file of an interrupted write: never committed, left alone"))
        segs, bytes_read, read_s = _scan_and_verify(segdir, ids, threads, findings, progress)
        skipped = len(ids) - len(segs)
        # one record per (namespace, key): the copy in the newest segment that verifies
        best: dict[bytes, tuple[_Segment, _Entry]] = {}
        found = bad = dups = 0
        for s in segs:  # ascending ids: a later segment replaces an earlier copy
            for en in s.entries:
                found += 1
                if not en.ok:
                    bad += 1
                    continue
                ck = di.dbkey(en.ns, en.key)
                if ck in best:
                    dups += 1
                best[ck] = (s, en)
        chosen = list(best.values())
        wanted = {en.ns for _s, en in chosen}
        olds = [os.path.join(index_dir, "data.mdb")] + sorted(
            os.path.join(store, d, "data.mdb") for d in os.listdir(store)
            if d.startswith("index.damaged-"))
        # the records the segments carry, then whatever the old index files still hold
        ns_records = {nid: r for s in segs for nid, r in s.namespaces.items() if nid in wanted}
        ns_records.update((k, v) for k, v in salvage_namespaces(
            olds, wanted - ns_records.keys()).items())
        missing = tuple(sorted(n.hex() for n in wanted - ns_records.keys()))
        for n in missing:
            cnt = sum(1 for _s, en in chosen if en.ns.hex() == n)
            findings.append(RecoverFinding(
                "missing_namespace", index_dir, None,
                f"namespace {n[:16]}: {cnt} block(s) recovered but its record (model, layout) "
                "is not in any old index; an engine that opens the store with that model "
                "registers it again"))
        old_next = _old_next_segment(olds[0])
        next_segment = max(top + 1, old_next) + ID_MARGIN
        damaged = None
        done = False
        if not dry_run and (ids or state != "missing"):
            stamp = time.strftime("%Y%m%d-%H%M%S")
            new_dir = _free_name(os.path.join(store, f"index.recover-{stamp}-{os.getpid()}"))
            try:
                _write_index(new_dir, segdir, chosen, ns_records, next_segment)
                chk = _guard.check_index(new_dir, full=True)
                if not chk.ok:  # pragma: no cover - would be a bug in the writer
                    raise RecoverError(f"the rebuilt index does not validate: {chk.problem}")
            except BaseException:
                import shutil

                shutil.rmtree(new_dir, ignore_errors=True)  # ours, never swapped in
                raise
            damaged = _swap_in(store, new_dir, stamp)  # from here on nothing is removed
            done = True
    return RecoverResult(
        store=store, dry_run=dry_run, index_state=state, index_problem=problem, done=done,
        segments=len(ids), segments_skipped=skipped, blocks_found=found,
        blocks_recovered=len(chosen), blocks_bad=bad, duplicates=dups,
        namespaces=len(ns_records), namespaces_missing=missing,
        stored_bytes=sum(en.stored for _s, en in chosen),
        raw_bytes=sum(en.raw for _s, en in chosen), bytes_read=bytes_read,
        next_segment=next_segment, damaged_index=damaged,
        seconds=time.perf_counter() - t0, read_seconds=read_s, findings=tuple(findings))


def _old_next_segment(data_mdb: str) -> int:
    """``meta.next_segment`` of the old index when its file validates (0 otherwise)."""
    index_dir = os.path.dirname(data_mdb)
    chk = _guard.check_index(index_dir, full=True)
    if not chk.ok or not chk.report or not chk.report.databases:
        return 0
    try:
        env = lmdb.open(index_dir, subdir=True, readonly=True, lock=False,
                        max_dbs=len(di._DB_NAMES) + 2)
    except lmdb.Error:
        return 0
    try:
        db = env.open_db(di.DB_META, create=False)
        with env.begin() as txn:
            raw = txn.get(di.META_NEXT_SEGMENT, db=db)
    except lmdb.Error:
        return 0
    finally:
        env.close()
    return di.U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0
