"""What ``kvstore serve`` checks before it takes the store's lock or binds its socket: the
store directory (a directory we can write; an index the engines can open), the socket path
(short enough for ``sun_path``, in a directory we can create), the shared-memory base and the
metrics file's directory. A problem is a :class:`~kvstore.errors.ConfigError` naming the
option and the path, raised at start — not at the first client's hello, nor as an OS error
without its path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvstore.daemon.config import DaemonConfig
from kvstore.errors import ConfigError, KVStoreError

#: ``sizeof(sockaddr_un.sun_path)`` on Linux, less the terminating NUL
MAX_SOCKET_PATH = 107


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_creatable_dir(p: Path, flag: str, what: str) -> None:
    """``p`` is a directory we can write, or can be created as one."""
    if p.exists() or p.is_symlink():
        if not p.is_dir():
            raise ConfigError(f"{flag} {p} is not a directory ({what}); give a directory, "
                              "or a path where one can be created")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {p}: no permission to write in it ({what})")
        return
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise ConfigError(f"{flag} {p} cannot be created: {base} is not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {p} cannot be created: no permission to write in {base}")


def check_store_dir(path: Path, *, disk: bool, group: str | int | None = None) -> None:
    """The store directory: writable (the daemon's lock lives there), not writable by
    other users (and private, or shared with ``group``: kvstore.filemodes) and, when it holds
    an index and the disk tier is on, one the engines can open (format version, damage)."""
    from kvstore import filemodes

    _check_creatable_dir(path, "--store", "the store directory")
    modes = filemodes.resolve_modes(path, group)
    filemodes.check_store(path, modes, writable=True)  # refused, or set as promised
    try:  # the lock file is created in it next: create it now, so an error names it
        filemodes.make_dirs(path, modes)
    except OSError as e:
        raise ConfigError(f"--store {path} cannot be created: {e.strerror or e}") from None
    if not disk or not (path / "index" / "data.mdb").exists():
        from kvstore.tiers.disk.guard import missing_index_error

        err = missing_index_error(str(path)) if disk and path.is_dir() else None
        if err is not None:
            raise err  # segments without an index: 'kvstore recover', named in the message
        return
    from kvstore.tiers.disk import DiskTier

    try:
        tier = DiskTier(path, capacity_bytes=0, readonly=True)
        try:
            tier.namespaces()  # opens the index: format version and damage checks
        finally:
            tier.close()
    except KVStoreError as e:
        raise ConfigError(f"--store {path}: {e}") from None
    except OSError as e:
        raise ConfigError(f"--store {path}: cannot open its index: "
                          f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")) from None


def check_socket_path(path: Path) -> None:
    """Short enough to bind; its directory a directory we can create or write in."""
    n = len(os.fsencode(os.path.abspath(path)))
    if n > MAX_SOCKET_PATH:
        raise ConfigError(f"--socket {path} is {n} bytes long; a Unix socket path is at most "
                          f"{MAX_SOCKET_PATH}: choose a shorter one (e.g. "
                          "$XDG_RUNTIME_DIR/kvstore.sock)")
    if path.is_dir():
        raise ConfigError(f"--socket {path} is a directory; name the socket file in it, e.g. "
                          f"{path / 'kvstore.sock'}")
    if path.exists() and not stat.S_ISSOCK(path.stat().st_mode):
        raise ConfigError(f"--socket {path} exists and is not a socket; remove it or choose "
                          "another path")
    _check_creatable_dir(path.parent, "--socket", "the socket's directory")


def check_config(cfg: DaemonConfig) -> None:
    """Every path the daemon will use, before it uses any (see the module docstring)."""
    check_store_dir(cfg.path, disk=bool(cfg.disk_capacity), group=cfg.group)
    check_socket_path(cfg.socket_path)
    if not cfg.shm_base.is_dir():
        raise ConfigError(f"--shm-dir {cfg.shm_base} is not a directory (is /dev/shm mounted?)")
    if not os.access(cfg.shm_base, os.W_OK | os.X_OK):
        raise ConfigError(f"--shm-dir {cfg.shm_base}: no permission to write in it")
    # a namespace's warm tier is a --cpu-capacity file there, created at its first hello:
    # one that cannot fit is refused now, not in the first client's connect
    from kvstore.memcheck import check_shared_memory

    check_shared_memory(cfg.cpu_capacity, cfg.shm_base, what="--cpu-capacity")
    if cfg.metrics_path is not None:
        d = cfg.metrics_path.parent
        if not d.is_dir() or not os.access(d, os.W_OK | os.X_OK):
            raise ConfigError(f"--metrics-path {cfg.metrics_path}: {d} is not a directory "
                              "this user can write in")
