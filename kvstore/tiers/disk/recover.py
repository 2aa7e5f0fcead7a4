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
import shutil
import time
from dataclasses import dataclass, field

import lmdb

from kvstore import filemodes as _modes
from kvstore.errors import FormatVersionError, KVStoreError, StoreLockedError
from kvstore.tiers import codec as _codec
from kvstore.tiers.disk import env as _env
from kvstore.tiers.disk import guard as _guard
from kvstore.tiers.disk import index as di
from kvstore.tiers.disk import segments as _seg
from kvstore.tiers.disk.check import expected_tensor, rebuild_side_indexes
from kvstore.tiers.disk.records import NamespaceInfo
from kvstore.tiers.disk.recover_scan import (
    Entry,
    Progress,
    RecoverFinding,
    Segment,
    salvage_namespaces,
    scan_and_verify,
    segment_path,
)

log = logging.getLogger("kvstore.disk")

__all__ = ["RecoverError", "RecoverFinding", "RecoverResult", "recover"]

#: ids reserved past the largest one found (engines reserve segment ids in chunks of 64)
ID_MARGIN = 64
_RECORDS_PER_TXN = 200_000


class RecoverError(KVStoreError, RuntimeError):
    """Recovery cannot run (no store, no segments directory, a daemon or engine holds the
    store); nothing was changed."""


@dataclass(frozen=True, slots=True)
class RecoverResult:
    store: str
    dry_run: bool
    index_state: str  # missing | empty | damaged | intact | rebuilt (with --force)
    index_problem: str | None  # why the old index was not usable
    done: bool  # a new index was swapped in
    segments: int  # segment files found
    segments_skipped: int  # unreadable headers, other formats
    blocks_found: int  # block entries in the segment headers (malformed ones too)
    blocks_recovered: int  # records in the new index (one per key)
    blocks_bad: int  # entries that are malformed or whose bytes do not verify (none kept)
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
        """Every block of every segment recovered (or nothing needed recovery): no segment
        skipped, no header entry dropped (a malformed block entry or namespace record), no
        block that does not verify."""
        return (self.blocks_bad == 0 and self.segments_skipped == 0
                and not any(f.kind == "bad_entry" for f in self.findings))

    @property
    def read_bytes_per_s(self) -> float:
        return self.bytes_read / self.read_seconds if self.read_seconds > 0 else 0.0


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
        if _env.open_in_process(index_dir):
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

def _rec(en: Entry, sid: int, t_us: int) -> di.Rec:
    return di.Rec(en.codec, 0, sid, en.offset, en.stored, en.raw, en.checksum, t_us, t_us, en.ns,
                  en.parent)


def _write_index(new_dir: str, segdir: str, chosen: list[tuple[Segment, Entry]],
                 ns_records: dict[bytes, bytes], next_segment: int) -> None:
    if not _modes.make_dirs(new_dir):  # the store's modes (0700, or 2750 shared), umask or not
        raise FileExistsError(errno.EEXIST, "already exists", new_dir)
    # not live until swapped in: commits without fsync, one sync at the end
    env = lmdb.open(new_dir, subdir=True, max_dbs=len(di.DB_NAMES) + 2, max_readers=126,
                    map_size=_env.DEFAULT_MAP_SIZE, max_spare_txns=0, sync=False, metasync=False,
                    mode=_modes.file_mode_in(new_dir))
    _modes.settle_files(new_dir, ("data.mdb", _modes.LMDB_LOCK))
    try:
        dbs = _env.init_dbs(env, new_dir, create=True)
        sh = _env.SharedEnv(os.path.realpath(new_dir), env, dbs, True)
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

            def put_blocks(txn: lmdb.Transaction, part=part) -> None:
                txn.cursor(db=dbs[di.DB_BLOCKS]).putmulti(part, append=True)
            sh.write(put_blocks)

        def put_rest(txn: lmdb.Transaction) -> None:
            for nid, rec in ns_records.items():
                txn.put(nid, rec, db=dbs[di.DB_NS])
            for sid, (n, b) in live.items():
                s = segs[sid]
                txn.put(di.BE64.pack(sid), di.encode_seginfo(di.SegInfo(
                    n, s.size, s.size - s.data_start, b, s.mtime_us)), db=dbs[di.DB_SEGS])
            txn.put(di.META_NEXT_SEGMENT, di.U64.pack(next_segment), db=dbs[di.DB_META])
        sh.write(put_rest)
        # children, lru, segment accounting and totals: derived from the records
        dead = rebuild_side_indexes(sh, segdir, sh.write)
        if dead:  # recovery never deletes files
            log.warning("recover: %d segment(s) without live blocks left in place", len(dead))
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
                        max_dbs=len(di.DB_NAMES) + 2)
    except lmdb.Error as e:
        return "damaged", f"LMDB cannot open it: {e}"
    try:
        db = env.open_db(di.DB_META, create=False)
        with env.begin() as txn:
            raw = txn.get(di.META_FORMAT, db=db)
            legacy = (raw == di.U32.pack(di.DISK_FORMAT_VERSION) and di.legacy_key_space(
                txn, env.open_db(di.DB_BLOCKS, txn=txn, create=False),
                env.open_db(di.DB_NS, txn=txn, create=False)))
    except lmdb.Error as e:
        return "damaged", f"LMDB cannot read it: {e}"
    finally:
        env.close()
    try:
        found = di.decode_u32(raw, "the format version")
    except di.RecordError as e:
        return "damaged", str(e)
    if found != di.DISK_FORMAT_VERSION:
        # 0 or >= 1000: a damaged record; any other: a store of another kvstore release,
        # whose segments this one cannot read either (it must never swap that index out)
        return ("damaged" if found == 0 or found >= 1000 else "other_format"), (
            f"format version {found}, this kvstore uses {di.DISK_FORMAT_VERSION}")
    if legacy:  # its segments are this format: a rebuild keeps every block
        return "damaged", ("format 2 from before per-namespace key spaces (32-byte index "
                           "keys): rebuilt with this kvstore's keys")
    return "intact", None


def _refuse_other_format(store: str, problem: str | None) -> FormatVersionError:
    return FormatVersionError(
        f"the index of {store} has another on-disk {problem}: it was written by another "
        "kvstore release, and recovering would replace it with an index of this format "
        "holding none of its blocks (that release could not read the store any more). Open "
        "the store with a kvstore release of its format, or point this one at a new "
        "directory; --force rebuilds it anyway (for a format record that is damaged)")




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
    if state == "other_format":
        if not force:
            raise _refuse_other_format(store, problem)
        state = "damaged"
    if state == "intact" and not force:
        return RecoverResult(store, dry_run, state, None, False, len(ids), 0, 0, 0, 0, 0, 0,
                             (), 0, 0, 0, 0, None, time.perf_counter() - t0, 0.0)
    with _StoreLock(store):
        if state == "intact":
            state = "rebuilt"
        quarantined = set()
        for name in sorted(os.listdir(segdir)):
            if _seg.TEMP_RE.match(name):
                findings.append(RecoverFinding(
                    "temp_file", os.path.join(segdir, name), None,
                    "temporary file of an interrupted write: never committed, left alone"))
            m = _seg.QUARANTINE_RE.match(name)
            if m and int(m.group(1), 16) not in ids:
                quarantined.add(int(m.group(1), 16))
        q = frozenset(quarantined)
        segs, bytes_read, read_s = scan_and_verify(segdir, sorted([*ids, *q]), threads,
                                                   findings, progress, q)
        skipped = len(ids) + len(q) - len(segs)
        olds = [os.path.join(index_dir, "data.mdb")] + sorted(
            os.path.join(store, d, "data.mdb") for d in os.listdir(store)
            if d.startswith("index.damaged-"))
        known = _known_namespaces(segs, olds)
        _check_layouts(segs, known, findings)  # before choosing: an older true copy may win
        chosen, found, bad, dups = _choose(segs)
        ns_records, missing = _namespace_records(chosen, known, index_dir, findings)
        next_segment = max(top + 1, _old_next_segment(olds[0])) + ID_MARGIN
        damaged = None
        done = False
        if not dry_run and (ids or q or state != "missing"):
            restored = _restore_quarantined(segdir, chosen, q)
            damaged = _rebuild(store, segdir, chosen, ns_records, next_segment)
            done = True
            for path in restored:  # its segment name is in the new index: the old name goes
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    return RecoverResult(
        store=store, dry_run=dry_run, index_state=state, index_problem=problem, done=done,
        segments=len(ids), segments_skipped=skipped, blocks_found=found,
        blocks_recovered=len(chosen), blocks_bad=bad, duplicates=dups,
        namespaces=len(ns_records), namespaces_missing=missing,
        stored_bytes=sum(en.stored for _s, en in chosen),
        raw_bytes=sum(en.raw for _s, en in chosen), bytes_read=bytes_read,
        next_segment=next_segment, damaged_index=damaged,
        seconds=time.perf_counter() - t0, read_seconds=read_s, findings=tuple(findings))


def _restore_quarantined(segdir: str, chosen: list[tuple[Segment, Entry]],
                         quarantined: frozenset[int]) -> list[str]:
    """Give each quarantined segment that blocks are recovered from its segment name again
    (a second link: the quarantine name goes once the new index is in); returns the
    quarantine names to unlink then."""
    out = []
    for sid in sorted({s.sid for s, _en in chosen if s.sid in quarantined}):
        q = segment_path(segdir, sid, quarantined)
        os.link(q, os.path.join(segdir, _seg.segment_name(sid)))
        out.append(q)
    if out:
        _fsync_dir(segdir)
    return out


def _choose(segs: list[Segment]) -> tuple[list[tuple[Segment, Entry]], int, int, int]:
    """One record per (namespace, key): the copy in the newest segment that verifies.
    Returns (the chosen copies, entries found, entries that are malformed or do not verify,
    duplicates)."""
    best: dict[bytes, tuple[Segment, Entry]] = {}
    found = bad = dups = 0
    for s in segs:  # ascending ids: a later segment replaces an earlier copy
        found += s.bad_entries  # malformed entries: found, and bad
        bad += s.bad_entries
        for en in s.entries:
            found += 1
            if not en.ok:
                bad += 1
                continue
            ck = di.dbkey(en.ns, en.key)
            if ck in best:
                dups += 1
            best[ck] = (s, en)
    return list(best.values()), found, bad, dups


def _known_namespaces(segs: list[Segment], olds: list[str]) -> dict[bytes, bytes]:
    """The namespace records of every verified block: those the segments carry, then
    whatever the old index files ``olds`` still hold (each hashing to its id)."""
    wanted = {en.ns for s in segs for en in s.entries if en.ok}
    known = {nid: r for s in segs for nid, r in s.namespaces.items() if nid in wanted}
    known.update(salvage_namespaces(olds, wanted - known.keys()))
    return known


def _check_layouts(segs: list[Segment], known: dict[bytes, bytes],
                   findings: list[RecoverFinding]) -> None:
    """A verified block is trusted only as far as its namespace's layout agrees with what
    its header says: raw bytes = the layout's block bytes, and the header's dtype and shape
    those the tier writes (``check.expected_tensor``). Anything else is a header that lies
    (or a namespace record of another layout): the entry is skipped (``layout_mismatch``),
    never indexed. Blocks of a namespace with no record are kept (``missing_namespace``)."""
    infos: dict[bytes, NamespaceInfo | None] = {}
    for nid, rec in known.items():
        try:
            infos[nid] = NamespaceInfo(nid, *di.decode_namespace(rec))
        except di.RecordError:
            infos[nid] = None
    for s in segs:
        for en in s.entries:
            if not en.ok or en.ns not in infos:
                continue
            info = infos[en.ns]
            problem = _layout_problem(en, info)
            if problem is not None:
                en.ok = False
                findings.append(RecoverFinding("layout_mismatch", s.path, en.key.hex(), problem))


def _layout_problem(en: Entry, info: NamespaceInfo | None) -> str | None:
    if info is None:
        return f"namespace {en.ns.hex()[:16]}: its record does not decode"
    if en.raw != info.block_nbytes:
        return (f"{en.raw} raw bytes; namespace {en.ns.hex()[:16]} ({info.dtype}, "
                f"{list(info.block_shape)}) has blocks of {info.block_nbytes}")
    name = _codec.CODEC_NAMES.get(en.codec, "?")
    want = expected_tensor(name, en.stored, info)
    if (en.dtype, en.shape) != want:
        assert want is not None
        return (f"the header says dtype {en.dtype!r} shape {en.shape!r}; namespace "
                f"{en.ns.hex()[:16]}'s layout and the block's codec say {want[0]!r} {want[1]!r}")
    return None


def _namespace_records(chosen: list[tuple[Segment, Entry]], known: dict[bytes, bytes],
                       index_dir: str, findings: list[RecoverFinding]
                       ) -> tuple[dict[bytes, bytes], tuple[str, ...]]:
    """The namespace records of the chosen blocks (of ``known``), and the ids (hex) found
    nowhere."""
    wanted = {en.ns for _s, en in chosen}
    ns_records = {nid: r for nid, r in known.items() if nid in wanted}
    missing = tuple(sorted(n.hex() for n in wanted - ns_records.keys()))
    for n in missing:
        cnt = sum(1 for _s, en in chosen if en.ns.hex() == n)
        findings.append(RecoverFinding(
            "missing_namespace", index_dir, None,
            f"namespace {n[:16]}: {cnt} block(s) recovered but its record (model, layout) "
            "is not in any old index; an engine that opens the store with that model "
            "registers it again"))
    return ns_records, missing


def _rebuild(store: str, segdir: str, chosen: list[tuple[Segment, Entry]],
             ns_records: dict[bytes, bytes], next_segment: int) -> str | None:
    """Write the new index next to the old one, validate it and swap it in; returns where
    the old index is now (None when there was none)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    new_dir = _free_name(os.path.join(store, f"index.recover-{stamp}-{os.getpid()}"))
    try:
        _write_index(new_dir, segdir, chosen, ns_records, next_segment)
        chk = _guard.check_index(new_dir, full=True)
        if not chk.ok:  # pragma: no cover - would be a bug in the writer
            raise RecoverError(f"the rebuilt index does not validate: {chk.problem}")
    except BaseException:
        shutil.rmtree(new_dir, ignore_errors=True)  # ours, never swapped in
        raise
    return _swap_in(store, new_dir, stamp)  # from here on nothing is removed


def _old_next_segment(data_mdb: str) -> int:
    """``meta.next_segment`` of the old index when its file validates (0 otherwise)."""
    index_dir = os.path.dirname(data_mdb)
    chk = _guard.check_index(index_dir, full=True)
    if not chk.ok or not chk.report or not chk.report.databases:
        return 0
    try:
        env = lmdb.open(index_dir, subdir=True, readonly=True, lock=False,
                        max_dbs=len(di.DB_NAMES) + 2)
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
