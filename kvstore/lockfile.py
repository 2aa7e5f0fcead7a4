"""One daemon per store path: ``<path>/daemon.lock``, held with ``flock`` for the daemon's life.

The file holds a JSON record of the daemon that holds it (socket, pid, instance id) so that
a second ``kvstore serve`` and the admin commands can name the socket of the daemon serving a
store. The lock, not the file, says whether a daemon is there: the kernel drops it when the
daemon dies, however it dies, so a stale file from a killed daemon is taken over silently.

The record also carries ``flushed``: earlier daemon instances on this path that stopped
cleanly with every committed put written to disk. A client whose puts went to one of them
knows they are durable although it never got to flush (see ``Client.flush``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.filemodes import StoreModes, create_file, file_mode_in, make_dirs

LOCK_NAME = "daemon.lock"
#: earlier clean instances remembered (a client that missed more restarts than this while
#: holding un-flushed puts is told they may be lost)
MAX_FLUSHED = 64
#: a reader (``read_daemon_lock``) holds a shared lock for a moment: a starting daemon waits
#: this long for it before deciding that another daemon holds the path
_TAKE_S = 1.0


@dataclass(frozen=True, slots=True)
class DaemonRecord:
    """What ``daemon.lock`` says about the daemon holding it."""

    socket: str
    pid: int
    instance: str  # hex, random per daemon start
    started: float  # seconds since the epoch
    flushed: tuple[str, ...] = ()  # earlier instances (hex) that stopped with everything on disk

    def to_json(self) -> bytes:
        return json.dumps({"socket": self.socket, "pid": self.pid, "instance": self.instance,
                           "started": self.started, "flushed": list(self.flushed)}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> DaemonRecord | None:
        try:
            d = json.loads(raw)
            return cls(str(d["socket"]), int(d["pid"]), str(d["instance"]), float(d["started"]),
                       tuple(str(x) for x in d.get("flushed", ())))
        except (ValueError, KeyError, TypeError):
            return None


def lock_path(store_path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.path.expanduser(os.fspath(store_path)))) / LOCK_NAME


def _read(fd: int) -> DaemonRecord | None:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return DaemonRecord.from_json(b"".join(chunks))


class DaemonLock:
    """The held lock of a running daemon; :meth:`release` when it stops."""

    def __init__(self, fd: int, path: Path, record: DaemonRecord) -> None:
        self._fd: int | None = fd
        self.path = path
        self.record = record

    @classmethod
    def acquire(cls, store_path: str | os.PathLike[str], socket_path: str, instance: str) -> DaemonLock:
        """Take the store path's lock, or raise :class:`ConfigError` naming the daemon that
        holds it. Creates the store directory if missing."""
        path = lock_path(store_path)
        try:
            # private (0700), unless the store is shared with a group; the file likewise
            # (0600, or 0640), whatever the umask
            make_dirs(path.parent, StoreModes())
            fd = create_file(path, os.O_RDWR | os.O_CLOEXEC, file_mode_in(path.parent))
        except OSError as e:
            raise ConfigError(f"cannot create the daemon lock file {path} ({e.strerror}); the "
                              "daemon needs a writable --store") from None
        try:
            deadline = time.monotonic() + _TAKE_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    if time.monotonic() >= deadline:
                        raise ConfigError(_held_message(path, _read(fd))) from None
                    time.sleep(0.05)
            prev = _read(fd)
            record = DaemonRecord(socket_path, os.getpid(), instance, time.time(),
                                  prev.flushed if prev is not None else ())
            _write(fd, record)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, record)

    def release(self, *, clean: bool) -> None:
        """Unlock; ``clean``: every put this daemon acknowledged is on disk (remembered for
        clients that reconnect to the next daemon with puts they did not flush)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if clean:
                r = self.record
                flushed = (*r.flushed, r.instance)[-MAX_FLUSHED:]
                with contextlib.suppress(OSError):  # then clients are told their puts may be lost
                    _write(fd, DaemonRecord(r.socket, r.pid, r.instance, r.started, flushed))
        finally:
            os.close(fd)  # drops the lock


def _write(fd: int, record: DaemonRecord) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.to_json(), 0)


def _held_message(path: Path, record: DaemonRecord | None) -> str:
    if record is None:
        return (f"store {path.parent} is already served by another kvstore daemon (it holds "
                f"{path}); one daemon per store path: stop it or choose another --store")
    return (f"store {path.parent} is already served by the kvstore daemon at {record.socket} "
            f"(pid {record.pid}); one daemon per store path: connect to that socket, or stop "
            "it first")


def read_daemon_lock(store_path: str | os.PathLike[str], *, wait: float = 1.0) -> DaemonRecord | None:
    """The record of the daemon serving ``store_path``, or ``None`` when none holds its lock.

    Never creates anything. A daemon that holds the lock but has not written its record yet
    (it just started) is waited for up to ``wait`` seconds; :class:`ConfigError` if its record
    stays unreadable.
    """
    path = lock_path(store_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None  # nobody holds it: no daemon (a killed one's record is stale)
        deadline = time.monotonic() + wait
        while (record := _read(fd)) is None:
            if time.monotonic() >= deadline:
                raise ConfigError(f"a kvstore daemon holds {path} but its record there is "
                                  "unreadable; find it with 'fuser' and check its --socket")
            time.sleep(0.02)
        return record
    finally:
        os.close(fd)
