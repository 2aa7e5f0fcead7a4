"""What every admin function shares: the store path, opening the disk tier without ever
creating a store, the admin error, JSON conversion and human formatting of ages."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from kvstore.tiers.disk import DiskTier

#: environment variable naming the default store
STORE_ENV = "KVSTORE_PATH"


class AdminError(KVStoreError):
    """An admin command cannot run: no store at the path, a bad target, no daemon support.
    The CLI prints the message and exits with status 2."""


class StoreNotFoundError(AdminError, FileNotFoundError):
    """There is no kvstore store at the path (admin commands never create one)."""


class StoreServedError(AdminError):
    """A ``kvstore serve`` daemon serves the store: a change that its memory tier would not
    see is refused (stop the daemon first, or go through it)."""

    def __init__(self, message: str, socket: str) -> None:
        super().__init__(message)
        self.socket = socket


def serving_socket(path: str | os.PathLike[str] | None) -> str | None:
    """The socket of the daemon serving the store at ``path``, or None (also when this
    kvstore cannot tell: the daemon lock support is missing)."""
    try:
        from kvstore.admin.live import serving_daemon
    except ImportError:  # older kvstore.admin.live: no daemon lock to read
        return None
    return serving_daemon(path)


def refuse_if_served(path: str | os.PathLike[str] | None, what: str) -> None:
    """Raise :class:`StoreServedError` when a daemon serves the store at ``path``: ``what``
    (prune, verify --fix, compact) would change the disk under its warm tier, which keeps
    serving what the disk no longer holds, and the daemon's own writes race the repair."""
    sock = serving_socket(path)
    if sock is not None:
        raise StoreServedError(
            f"the store at {resolve_store_path(path)} is served by the kvstore daemon at "
            f"{sock}: stop it ('kvstore serve' holds the store's daemon.lock) before {what}",
            sock)


def default_store_path() -> Path:
    """``$KVSTORE_PATH``, else ``~/.cache/kvstore``."""
    env = os.environ.get(STORE_ENV)
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/kvstore").expanduser()


def demo_store_path() -> Path:
    """Where ``kvstore demo`` keeps its store: ``$XDG_CACHE_HOME/kvstore/demo``
    (``~/.cache/kvstore/demo``), not the default store."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstore" / "demo"


def _demo_hint(path: str | os.PathLike[str] | None) -> str:
    """Named when the default store is missing but ``kvstore demo`` left one (a newcomer's
    ``kvstore ls`` right after the demo)."""
    if path is not None and str(path) != "":
        return ""
    demo = Path(os.path.abspath(demo_store_path()))
    if not (demo / "index" / "data.mdb").is_file() or demo == resolve_store_path(None):
        return ""
    return f"; kvstore demo's store is {demo}: kvstore ls --store {demo}"


def resolve_store_path(path: str | os.PathLike[str] | None) -> Path:
    """``path`` (``~`` expanded, absolute), or the default store path."""
    p = default_store_path() if path is None or str(path) == "" else Path(os.fspath(path))
    return Path(os.path.abspath(p.expanduser()))


def check_store(path: str | os.PathLike[str] | None) -> Path:
    """The resolved store path; :class:`StoreNotFoundError` unless a store lives there."""
    p = resolve_store_path(path)
    hint = f"pass --store PATH or set ${STORE_ENV}"
    if not p.exists():
        raise StoreNotFoundError(f"no kvstore store at {p}: the path does not exist ({hint})"
                                 + _demo_hint(path))
    if not p.is_dir():
        raise StoreNotFoundError(f"{p} is not a kvstore store: it is not a directory ({hint})")
    if not (p / "index" / "data.mdb").is_file():
        from kvstore.tiers.disk import missing_index_error

        err = missing_index_error(str(p))  # segments without an index: recover, not "empty"
        if err is not None:
            raise err
        raise StoreNotFoundError(
            f"{p} is not a kvstore store: it has no index/data.mdb (nothing was ever written "
            f"there, or it is another directory; {hint})" + _demo_hint(path)
        )
    return p


@contextlib.contextmanager
def open_disk(path: str | os.PathLike[str] | None, *, readonly: bool) -> Iterator[DiskTier]:
    """The store's disk tier, opened for admin work; the store must exist (never created).

    Read-only opens take no write lock and change nothing (not even access times); writable
    opens go through LMDB's write lock like every engine, so both are safe while engines and
    daemons use the store.
    """
    from kvstore.tiers.disk import DiskTier

    p = check_store(path)
    # the disk capacity is a setting of the engines that open the store, not recorded in it;
    # admin work never evicts, so the value here is never used
    tier = DiskTier(p, capacity_bytes=0, readonly=readonly)
    try:
        yield tier
    finally:
        tier.close()


@contextlib.contextmanager
def quiet_disk_log() -> Iterator[None]:
    """Silence the disk tier's per-block damage warnings while an admin pass reports them
    itself (as findings)."""
    lg = logging.getLogger("kvstore.disk")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)


# -- JSON ------------------------------------------------------------------------------------

def to_jsonable(obj: Any) -> Any:
    """A dataclass (recursively) as plain JSON values: dataclass -> object of its fields in
    order, tuple/list -> array, bytes -> hex string, enum -> its value, Path -> str, and
    non-finite floats -> null."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj).hex()
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


# -- ages ----------------------------------------------------------------------------------

def format_age(ts: float | None, now: float | None = None) -> str:
    """``ts`` (seconds since the epoch) as ``"3 min ago"``; ``"never"`` for None."""
    if ts is None:
        return "never"
    now = time.time() if now is None else now
    s = now - ts
    if s < 0:
        return "just now" if s > -60 else "in the future"
    if s < 60:
        return f"{int(s)} s ago"
    if s < 3600:
        return f"{int(s // 60)} min ago"
    if s < 86400:
        return f"{int(s // 3600)} h ago"
    d = int(s // 86400)
    if d < 14:
        return "1 day ago" if d == 1 else f"{d} days ago"
    if d < 60:
        return f"{d // 7} weeks ago"
    if d < 730:
        return f"{d // 30} months ago"
    return f"{d // 365} years ago"
