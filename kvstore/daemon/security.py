"""Who may talk to the daemon, and where its files live.

- The socket is created ``0600`` inside a directory only its owner can write to (created
  ``0700`` when missing); a directory other users can write to is refused, since they could
  replace the socket.
- Every connection's peer uid is read with ``SO_PEERCRED`` and checked against an
  allow-list (default: the daemon's own uid) before a byte is read from it.
- Shared-memory slabs live in a private ``0700`` directory under ``/dev/shm``, one ``0600``
  file per namespace. Leftovers of a daemon that was killed are removed at the next start.
- :class:`Limits` bounds what one client can make the daemon hold.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.ratelog import Every
from kvstore.wire.framing import DEFAULT_MAX_FRAME

SHM_PREFIX = "kvstore-serve-"
_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may make the daemon hold."""

    max_frame: int = DEFAULT_MAX_FRAME  # bytes of one frame (checked before reading it)
    max_keys: int = 65536  # keys in one request
    max_leases: int = 1024  # leases + granted puts outstanding per connection
    max_pins: int = 1 << 20  # pinned block references per connection
    max_connections: int = 256
    max_namespaces: int = 16  # open stores; idle ones are closed (to disk) to make room
    hello_timeout: float = 10.0  # seconds a new connection has to say hello
    frame_timeout: float = 60.0  # seconds to finish sending a frame once its header arrived

    def __post_init__(self) -> None:
        for name in ("max_frame", "max_keys", "max_leases", "max_pins", "max_connections",
                     "max_namespaces"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.max_frame < 1024:
            raise ConfigError("max_frame must be at least 1 KiB")


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connecting process's pid/uid/gid, as the kernel saw them at ``connect``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return PeerCredentials(*_UCRED.unpack(raw))


#: refused peers are logged at most this often (with how many were refused since)
REFUSAL_LOG_S = 10.0


class PeerPolicy:
    """The allow-list of peer uids (default: the daemon's own uid)."""

    def __init__(self, allowed_uids: Iterable[int] | None = None) -> None:
        uids = set(allowed_uids or ())
        self.allowed_uids = frozenset(uids or {os.getuid()})
        self._log_every = Every(REFUSAL_LOG_S)  # refusals, counted between the lines logged

    def refusal_to_log(self, cred: PeerCredentials) -> str | None:
        """The line to log for refusing ``cred``, or None while the last one is recent: a
        refused engine retries for as long as it runs (every 5 s with the client's backoff,
        other processes as fast as they like), and each attempt logged its own WARNING."""
        n = self._log_every.tally()
        if not n:
            return None
        since = f" ({n - 1} more refused since the last such line)" if n > 1 else ""
        return (f"refused pid {cred.pid} uid {cred.uid}: not in the allow-list{since}; "
                f"logged at most every {REFUSAL_LOG_S:g} s")

    def allows(self, cred: PeerCredentials) -> bool:
        return cred.uid in self.allowed_uids

    def refusal(self, cred: PeerCredentials) -> str:
        return (f"uid {cred.uid} is not allowed to use this kvstore daemon (allowed: "
                f"{', '.join(map(str, sorted(self.allowed_uids)))}); start it with "
                f"--allow-uid {cred.uid} to admit it")


def check_socket_dir(sock_path: Path) -> None:
    """Create the socket's directory ``0700`` if missing; refuse one others can write to."""
    d = sock_path.parent
    if not d.exists():
        d.mkdir(mode=0o700, parents=True)
        os.chmod(d, 0o700)
        return
    st = d.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"the socket's directory {d} is writable by other users, who could replace the "
            "socket; use a private directory (it is created 0700 when missing), e.g. "
            "/run/kvstore/kvstore.sock or $XDG_RUNTIME_DIR/kvstore.sock"
        )
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"the socket's directory {d} belongs to uid {st.st_uid}, not to us")


def _listening(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def bind_unix_socket(path: Path, backlog: int = 128) -> socket.socket:
    """A listening socket at ``path``, mode ``0600``. A stale socket (a killed daemon's) is
    replaced; a live one, or any other file, is an error."""
    check_socket_dir(path)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket; remove it or choose another path")
        if _listening(path):
            raise ConfigError(f"another daemon is already serving {path}")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is born 0600: no window where others may connect
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: the lock each daemon holds on its shared-memory directory for as long as it runs (an flock
#: on an fd of the directory, kept open): a pid is no proof of death, since a daemon in
#: another pid namespace (another container sharing /dev/shm) has a pid that looks dead here
_held_shm: dict[str, int] = {}


def _lock_dir(d: Path) -> int | None:
    """An fd of ``d`` holding its exclusive flock, or None when another process holds it."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_stale_shm(base: Path) -> list[Path]:
    """Remove shared-memory directories of our daemons that died without cleaning up (their
    pid is not alive here and nobody holds their lock)."""
    removed = []
    if not base.is_dir():
        return removed
    for entry in base.iterdir():
        name = entry.name
        if not name.startswith(SHM_PREFIX):
            continue
        pid_s = name[len(SHM_PREFIX):].split("-", 1)[0]
        try:
            pid = int(pid_s)
            st = entry.lstat()
        except (ValueError, OSError):
            continue
        if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode) or _pid_alive(pid):
            continue
        try:
            fd = _lock_dir(entry)
        except OSError:
            continue
        if fd is None:  # its daemon runs (in another pid namespace)
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(entry)
    return removed


def make_shm_dir(base: Path) -> Path:
    """A private (``0700``) directory for this daemon's slabs under ``base`` (``/dev/shm``)."""
    if not base.is_dir():
        raise ConfigError(f"shared-memory base {base} is not a directory (is /dev/shm mounted?)")
    d = Path(tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=base))
    os.chmod(d, 0o700)
    fd = _lock_dir(d)  # held until this process exits (the kernel drops it then)
    if fd is not None:
        _held_shm[str(d)] = fd
    return d


def remove_path(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def is_disconnect(exc: BaseException) -> bool:
    """An error that just means the peer went away."""
    return isinstance(exc, (ConnectionError, BrokenPipeError)) or (
        isinstance(exc, OSError) and exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF))
