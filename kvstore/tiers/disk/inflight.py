"""The mark of a segment write in flight: a writer holds a shared ``flock`` on its file from
creation until its index commit; ``check``/``prune`` leave a locked file alone whatever its
mtime says, and remove one only while holding its lock."""

from __future__ import annotations

import errno
import fcntl
import os

from kvstore.filemodes import create_file

__all__ = ["create_locked", "in_flight", "unlink_unless_in_flight"]


def create_locked(tmp: str, flags: int, mode: int) -> int:
    """Create ``tmp`` and hold its in-flight lock, with ``tmp`` still naming the file.

    Between the create and the lock a ``prune --grace 0`` saw an unlocked temp file and
    unlinked it (the flush then failed with ENOENT), and a non-blocking lock failed while a
    prune's probe held the file for an instant, leaving the write unlocked for the next prune.
    So the lock waits (a probe holds it only around one stat and unlink: :func:`unlink_unless_in_flight`)
    and a file unlinked before we held it is created again."""
    for _ in range(8):
        try:
            fd = create_file(tmp, flags, mode)
        except FileExistsError:  # a leftover of a crashed writer holding the same id: not ours
            os.unlink(tmp)
            fd = create_file(tmp, flags, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError:  # a file system without flock: mtime alone judges
            return fd
        try:
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # removed by a prune before our lock: not a file of ours any more
    raise OSError(errno.EAGAIN, f"{tmp} was removed again and again as it was created "
                  "(a prune with --grace 0 in a loop?)", tmp)


def unlink_unless_in_flight(path: str) -> bool:
    """Unlink ``path`` unless a writer holds it (:func:`in_flight`), holding the file's lock
    across the unlink so that no writer can take it in between: judged first and unlinked
    later, a temp file created just before the judgement and locked just after it was
    removed under its writer. True when ``path`` is gone (or was already)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:  # not a file we can open (a FIFO without O_NONBLOCK, a link): judged by name
        fd = -1
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a write in flight
            except OSError:
                pass  # a file system without flock: mtime alone judges
            if not os.path.samestat(os.fstat(fd), os.lstat(path)):
                return False  # replaced meanwhile by another file: judged again next time
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)
    return True


def in_flight(path: str) -> bool:
    """Whether a writer holds ``path`` (a temp or named segment whose index commit has not
    happened yet: :func:`create_segment`'s lock). False for anything that cannot be opened
    or locked (a crashed writer's file, a FIFO, a file system without flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False
