"""Validation of the disk index *before* LMDB maps it (``docs/format.md``, "Index validation").

LMDB trusts its file: a ``data.mdb`` shorter than its own metadata says is mapped anyway and
the first access past the end is a SIGBUS; a zeroed or bit-flipped page makes it fail an
internal assertion (SIGABRT) or read garbage node sizes. Nothing above LMDB can catch those,
so the disk tier checks the file with plain file I/O first and refuses a damaged index with
:class:`~kvstore.errors.StoreCorruptError` (which names ``kvstore recover``).

Two levels:

* :func:`~kvstore.tiers.disk.lmdb_meta.read_meta` — the two meta pages (magic, version, page
  size, last page, txnid, the roots of the free and main databases) against the file size.
  O(1), always (:func:`before_open`), unless the file ends early (then the free list too).
* :func:`~kvstore.tiers.disk.lmdb_trees.check_trees` — every B-tree page reachable from the
  current meta, and the kvstore schema of every named database. Above ``full_pages`` pages
  only the main and free databases and the root page of each named database are walked
  (bounded time at open: ~25 ms for 1,000,000 records, cold; :func:`check_snapshot`);
  :func:`check_index` / :func:`require_intact` walk everything.

A store that other processes use is never taken for damaged because they write to it: the
file size is taken after the meta page (a writer grows the file before it writes the meta
page naming the new pages); a file that ends before the meta page's last page is damaged
only if a page past its end is not free (LMDB never writes a page that one transaction
allocated and freed again); and damage counts only when a second read, a moment later,
finds the same (:func:`settled`).

The structures (LMDB 0.9, 64-bit little-endian) are described in ``docs/format.md``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import lmdb

from kvstore.errors import StoreCorruptError
from kvstore.tiers.disk import segments as _seg
from kvstore.tiers.disk.index import DB_NAMES
from kvstore.tiers.disk.lmdb_meta import IndexDamage, ShortFile, read_meta
from kvstore.tiers.disk.lmdb_trees import TreeReport, check_trees

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class IndexCheck:
    """Result of :func:`check_index`."""

    path: str
    ok: bool
    problem: str | None
    report: TreeReport | None


def validate_file(path: str, *, full_pages: int | None = None,
                  required: tuple[bytes, ...] = ()) -> TreeReport:
    """:func:`read_meta` + :func:`check_trees` of ``path`` (a data.mdb); IndexDamage."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise IndexDamage(f"cannot open {path}: {e.strerror}") from None
    try:
        if os.fstat(fd).st_size == 0:
            raise IndexDamage(f"{path} is empty")
        return settled(fd, lambda f: _walk(f, full_pages=full_pages, required=required))
    except OSError as e:
        raise IndexDamage(f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def _walk(fd: int, *, full_pages: int | None, required: tuple[bytes, ...]) -> TreeReport:
    """:func:`read_meta` + :func:`check_trees`: a file that ends before the meta page's last
    page is damaged only when a page past its end is not free (:class:`ShortFile`)."""
    try:
        meta = read_meta(fd)
    except ShortFile as e:
        meta = e.meta
    return check_trees(fd, meta, full_pages=full_pages, required=required)


def _meta_fits(fd: int) -> None:
    """:func:`read_meta`, O(1) unless the file ends before the meta page's last page: then
    the pages past its end must be free ones (the free list is walked, and the named
    databases at their root pages)."""
    try:
        read_meta(fd)
    except ShortFile as e:
        check_trees(fd, e.meta, full_pages=0)


#: a live index is read again this many times before its damage counts, after these waits
_SETTLE_WAITS_S = (0.002, 0.005, 0.01, 0.02)


def settled(fd: int, check: Callable[[int], T]) -> T:
    """``check(fd)``, not fooled by a writer in another process: a damaged-looking read is
    repeated after a short wait, and the damage counts only once two reads in a row find the
    same (the same message, the same file size) — a file that another process commits to
    while it is read changes between them (its size, the txn its meta page names)."""
    last: tuple[str, int] | None = None
    for wait in (*_SETTLE_WAITS_S, None):
        try:
            return check(fd)
        except IndexDamage as e:
            seen = (str(e), os.fstat(fd).st_size)
            if seen == last or wait is None:
                raise
            last = seen
        time.sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


def check_index(index_dir: str, *, full: bool = True) -> IndexCheck:
    """Validate ``index_dir/data.mdb`` completely (``full``: every leaf page, whatever the
    size). Never opens LMDB; never raises for damage."""
    path = os.path.join(index_dir, "data.mdb")
    try:
        rep = validate_file(path, full_pages=(1 << 62) if full else None, required=DB_NAMES)
    except IndexDamage as e:
        return IndexCheck(path, False, str(e), None)
    return IndexCheck(path, True, None, rep)


# -- what the disk index calls around opening LMDB ---------------------------------------------

def _corrupt_types() -> tuple[type[BaseException], ...]:
    names = ("CorruptedError", "PageNotFoundError", "PanicError", "InvalidError",
             "VersionMismatchError", "BadTxnError", "IncompatibleError", "CursorFullError",
             "PageFullError")
    return tuple(getattr(lmdb, n) for n in names if hasattr(lmdb, n))


#: LMDB errors that mean a damaged file (never MapFull/MapResized, which are handled)
LMDB_CORRUPT: tuple[type[BaseException], ...] = _corrupt_types()


def store_of(index_dir: str) -> str:
    return os.path.dirname(os.path.abspath(index_dir))


def recover_hint(store: str) -> str:
    return (f"stop the engines using the store and run `kvstore recover --store {store}`: it "
            "rebuilds the index from the segment files (the damaged index is kept as "
            "index.damaged-<time>)")


def corrupt_error(index_dir: str, why: object) -> StoreCorruptError:
    """StoreCorruptError for a damaged index at ``index_dir``, naming ``kvstore recover``."""
    store = store_of(index_dir)
    return StoreCorruptError(f"the disk index of the store at {store} is damaged ({why}); "
                             f"nothing was changed. To use the store again, {recover_hint(store)}")


def segment_ids(segdir: str) -> tuple[list[int], int]:
    """Ids of the committed segment files in ``segdir`` and the largest id of any segment or
    temp file there (0 when none)."""
    ids: list[int] = []
    top = 0
    try:
        names = os.listdir(segdir)
    except (FileNotFoundError, NotADirectoryError):
        return ids, 0
    for name in names:
        m = _seg.SEGMENT_RE.match(name)
        if m:
            sid = int(m.group(1), 16)
            ids.append(sid)
            top = max(top, sid)
        else:
            m = _seg.TEMP_RE.match(name)
            if m:
                top = max(top, int(m.group(1), 16))
    return ids, top


def _missing_index(index_dir: str, state: str, nseg: int) -> StoreCorruptError:
    store = store_of(index_dir)
    return StoreCorruptError(
        f"the store at {store} has {nseg} segment file(s) but {state}: refusing to start an "
        f"empty index over them (their blocks would be lost). To use the store again, "
        f"{recover_hint(store)}")


def dir_id(path: str) -> tuple[int, int] | None:
    """(device, inode) of a directory: LMDB opens lock.mdb and data.mdb by name one after
    the other, so a change across the open means the index was swapped in between."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def before_open(index_dir: str) -> None:
    """Checks before LMDB maps ``index_dir/data.mdb``: a missing or empty index beside
    segment files, and the meta pages of an existing one. Raises StoreCorruptError."""
    path = os.path.join(index_dir, "data.mdb")
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        size = -1
    except NotADirectoryError:
        size = -1
    if size <= 0:
        ids, _top = segment_ids(os.path.join(store_of(index_dir), "segments"))
        if ids:
            state = ("no index (index/data.mdb is missing)" if size < 0
                     else "an empty index (index/data.mdb has 0 bytes)")
            raise _missing_index(index_dir, state, len(ids))
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return  # unreadable (permissions): LMDB reports it
    try:
        settled(fd, _meta_fits)
    except IndexDamage as e:
        raise corrupt_error(index_dir, e) from None
    except OSError as e:
        raise corrupt_error(index_dir, f"cannot read data.mdb: {e.strerror}") from None
    finally:
        os.close(fd)


def check_snapshot(env: lmdb.Environment, index_dir: str, *,
                   full_pages: int | None = None) -> TreeReport:
    """Walk the trees of the committed state while a read transaction of ``env`` pins it (no
    writer in any process can reuse its pages meanwhile). Raises StoreCorruptError; also
    when the index holds no database at all but segment files exist."""
    path = os.path.join(index_dir, "data.mdb")
    with env.begin():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise corrupt_error(index_dir, f"cannot open data.mdb: {e.strerror}") from None
        try:
            rep = settled(fd, lambda f: _walk(f, full_pages=full_pages, required=DB_NAMES))
        except IndexDamage as e:
            raise corrupt_error(index_dir, e) from None
        except OSError as e:
            raise corrupt_error(index_dir, f"cannot read data.mdb: {e.strerror}") from None
        finally:
            os.close(fd)
    if not rep.databases:
        ids, _top = segment_ids(os.path.join(store_of(index_dir), "segments"))
        if ids:
            raise _missing_index(index_dir, "an uninitialized index", len(ids))
    return rep


# -- for callers outside the disk tier (admin commands) ----------------------------------------

def missing_index_error(store: str) -> StoreCorruptError | None:
    """The StoreCorruptError for a store directory whose ``segments/`` holds segment files
    but whose ``index/data.mdb`` is missing or empty (None otherwise)."""
    index_dir = os.path.join(store, "index")
    try:
        before_open(index_dir)
    except StoreCorruptError as e:
        return e
    return None


def require_intact(index_dir: str) -> TreeReport:
    """Walk ``index_dir/data.mdb`` completely, whatever its size (``kvstore verify``);
    StoreCorruptError naming ``kvstore recover`` when anything is off."""
    before_open(index_dir)
    try:
        rep = validate_file(os.path.join(index_dir, "data.mdb"), full_pages=1 << 62,
                            required=DB_NAMES)
    except IndexDamage as e:
        raise corrupt_error(index_dir, e) from None
    return rep
