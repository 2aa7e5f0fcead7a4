"""The client's hold on its daemon: the current :class:`~kvstore.client.session.Session`,
reopened with backoff when the daemon goes and comes back, and round trips whose failures are
the daemon's trouble answered as ``None`` (a miss for the caller), with a warning now and
then, never an exception into the engine."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from kvstore.client.session import Session, SharedMemoryUnavailable
from kvstore.errors import DaemonUnavailableError, StoreClosedError, TransferError
from kvstore.keys import KEY_BYTES
from kvstore.ratelog import Every
from kvstore.wire import messages as m
from kvstore.wire.channel import ChannelClosed
from kvstore.wire.errors import ErrorCode, PermissionDeniedError, ProtocolVersionError, ServerError

__all__ = ["CLOSED_MESSAGE", "Link", "unsound_slots"]

log = logging.getLogger("kvstore.client")

#: raised at connect (and logged, not raised, on a later reconnect): the setup is wrong
_CONFIG_ERRORS = (ProtocolVersionError, PermissionDeniedError)
#: error replies that are the daemon's trouble, not the caller's: a miss and a warning
_SOFT_CODES = frozenset({ErrorCode.LIMIT, ErrorCode.SHUTTING_DOWN, ErrorCode.INTERNAL,
                         ErrorCode.UNKNOWN_ID, ErrorCode.FRAME_TOO_LARGE})
_WARN_EVERY = 10.0  # seconds between two warnings about the same error code

CLOSED_MESSAGE = ("this client is closed; connect again with kvstore.connect() "
                  "(or use an embedded store from open_store())")


def unsound_slots(s: Session, req: m.Request, reply: object) -> str:
    """Why a lease or grant in ``reply`` cannot be right for ``req`` on ``s`` ("" when it
    can): more slots than the request has keys, a slot outside the shared slab or named
    twice, a put position outside the put or named twice."""
    if not isinstance(reply, (m.Lease, m.Grant)) or not isinstance(req, (m.Fetch, m.Put)):
        return ""
    n = len(req.keys) // KEY_BYTES
    slots, rows = reply.slots, int(s.slab.shape[0])
    if len(slots) > n:
        return f"{len(slots)} slots for {n} keys"
    if slots and (min(slots) < 0 or max(slots) >= rows):
        return f"a slot outside its {rows}-slot shared memory"
    if len(set(slots)) != len(slots):
        return "the same slot twice"
    pos = reply.positions if isinstance(reply, m.Grant) else ()
    if pos and (min(pos) < 0 or max(pos) >= n or len(set(pos)) != len(pos)):
        return f"a position outside the put's {n} blocks, or one twice"
    return ""


class Link:
    """The session to the daemon at ``socket_path``, opened by ``open_session``; while the
    daemon is down :meth:`get` answers ``None`` and retries after a backoff that doubles from
    ``backoff[0]`` up to ``backoff[1]`` seconds.

    A session belongs to the process that opened it. In a process forked from it (a
    ``multiprocessing`` worker, a pre-forking server) the inherited socket is the parent's
    too: each reply went to whichever process read first, so one could take the other's
    answer to a request of the same id (another process's slots: wrong blocks). There it is
    left to the parent (this process's copy of the socket closed) and :meth:`get` connects
    afresh."""

    def __init__(self, socket_path: str, open_session: Callable[[], Session],
                 backoff: tuple[float, float]) -> None:
        self.socket_path = socket_path
        self._open = open_session
        self.closed = False
        self._session: Session | None = None
        self._pid = os.getpid()  # the process the session belongs to
        self._lock = threading.Lock()  # connecting / swapping the session
        self._backoff_min, self._backoff_max = backoff
        self._backoff = self._backoff_min
        self._next_attempt = 0.0
        self._down = False
        self._warned = Every(_WARN_EVERY)  # per error code

    @property
    def session(self) -> Session | None:
        """This process's session (``None`` in a forked child until :meth:`get` opens one)."""
        if self._pid != os.getpid():
            self._after_fork()
        return self._session

    @session.setter
    def session(self, s: Session | None) -> None:
        self._session = s

    def _after_fork(self) -> None:
        """Forget the parent's session here: close only this process's copy of its socket
        (no frame sent, no lock of the parent's taken: they were copied in whatever state
        the fork found them); the next :meth:`get` connects at once."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        s, self._session = self._session, None
        if s is not None:
            with contextlib.suppress(OSError):
                s.channel.close()
        self._down = False
        self._next_attempt = 0.0
        self._backoff = self._backoff_min

    def connect_first(self, wait: bool = False) -> None:
        """At ``connect``: configuration errors raise, and so does a daemon that does not
        answer (:class:`DaemonUnavailableError`: a mistyped path, a daemon not started),
        unless ``wait``: then it only warns, and :meth:`get` connects once it answers."""
        try:
            with self._lock:
                self.session = self._open()
        except _CONFIG_ERRORS:
            raise
        except ServerError as e:
            # a daemon that answered with its own transient trouble (busy namespaces,
            # shutting down) is there: miss and retry, as later; anything else raises
            if e.code in (ErrorCode.CONFIG, ErrorCode.BAD_REQUEST) or (
                    not wait and e.code not in _SOFT_CODES):
                raise
            self._mark_down(e)
        except SharedMemoryUnavailable as e:
            if not wait:
                raise DaemonUnavailableError(str(e)) from None
            self._mark_down(e)
        except (OSError, ChannelClosed) as e:
            if not wait:
                why = (e.strerror if isinstance(e, OSError) else None) or str(e) or type(e).__name__
                if isinstance(e.__cause__ or e, (TimeoutError, BlockingIOError)):  # timed out
                    why = "something listens there but did not answer the handshake in time"
                raise DaemonUnavailableError(
                    f"no kvstore daemon answers at {self.socket_path} ({why}): start "
                    f"'kvstore serve --socket {self.socket_path}' or fix the path; "
                    "connect(..., wait_for_daemon=True) waits for a daemon that is starting"
                ) from None
            self._mark_down(e)

    def _mark_down(self, e: BaseException) -> None:
        now = time.monotonic()
        if not self._down:
            self._down = True
            self._backoff = self._backoff_min
            self._next_attempt = now  # the next call tries again at once, then backs off
            log.warning("kvstore daemon at %s is unavailable (%s): lookups miss and puts are "
                        "dropped until it is back; reconnecting with backoff", self.socket_path, e)
        else:
            self._next_attempt = now + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)

    def get(self) -> Session | None:
        """The live session, reconnecting if it is time to; ``None`` while the daemon is down."""
        if self.closed:
            raise StoreClosedError(CLOSED_MESSAGE)
        s = self.session  # None in a forked child: connects its own below
        if s is not None and not s.channel.broken:
            return s
        with self._lock:
            s = self.session
            if s is not None and not s.channel.broken:
                return s
            if s is not None:
                self._drop(s, ChannelClosed("connection lost"))
            if time.monotonic() < self._next_attempt:
                return None
            try:
                s = self.session = self._open()
            except _CONFIG_ERRORS as e:
                log.error("kvstore daemon at %s refused us: %s", self.socket_path, e)
                self._mark_down(e)
                return None
            except (OSError, ChannelClosed, ServerError) as e:
                self._mark_down(e)
                return None
            if self._down:
                log.warning("reconnected to the kvstore daemon at %s", self.socket_path)
                self._down = False
            return s

    def _drop(self, s: Session, e: BaseException) -> None:
        """Forget a broken session (caller holds ``_lock``)."""
        s.close()
        if self.session is s:
            self.session = None
        self._mark_down(e)

    def lost(self, s: Session, e: BaseException) -> None:
        """``s`` broke (``e``): forget it, unless it was replaced meanwhile."""
        with self._lock:
            if self.session is s:
                self._drop(s, e)

    def request(self, s: Session, req: m.Request,
                timeout: float | None | bool = True) -> object | None:
        """A round trip on ``s``; ``None`` when it could not be answered (a miss for the
        caller). Only errors that are the caller's to fix raise (bad arguments)."""
        try:
            reply = s.channel.call(req, timeout)
        except ChannelClosed as e:
            self.lost(s, e)
            return None
        except ServerError as e:
            if e.code == ErrorCode.TIMEOUT:
                raise TimeoutError(e.message) from None
            if e.code not in _SOFT_CODES:
                raise
            if self._warned.due(e.code):
                log.warning("kvstore daemon: %s failed (%s); answered as a miss", req.OP, e)
            if s.channel.broken:
                self.lost(s, e)
            return None
        bad = unsound_slots(s, req, reply)
        if bad:
            # copying by those slots would read other blocks (wrong KV) or write past the
            # slab: the connection goes (the daemon frees a dead connection's slots)
            log.error("kvstore daemon: its %s reply names %s; answered as a miss and the "
                      "connection dropped (a daemon of another version, or not kvstore's?)",
                      req.OP, bad)
            self.lost(s, TransferError(f"the daemon's {req.OP} reply names {bad}"))
            return None
        return reply

    def mark_closed(self) -> bool:
        """Refuse every later :meth:`get`; False if it was closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def detach(self) -> Session | None:
        """The session, no longer held here (the caller closes it)."""
        with self._lock:
            s, self.session = self.session, None
        return s
