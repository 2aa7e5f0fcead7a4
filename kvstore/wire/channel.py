"""The client's end of one connection: blocking request/reply with pipelined requests.

``call`` sends a request and reads replies until its own arrives; ``send`` sends a request
whose reply is not waited for (``release``, ``abort``) - the daemon answers in order, so that
reply is read, and any error in it logged, by the next ``call``. One lock serialises the
socket; a round trip holds it, so the calling thread does the I/O itself (no hand-off to a
reader thread on the latency-critical path). Any socket, framing or decoding failure breaks
the channel (:class:`ChannelClosed`); the client then reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
from collections import OrderedDict

from kvstore.wire import messages as m
from kvstore.wire.codec import CodecError, CodecLimits, pack, unpack
from kvstore.wire.framing import DEFAULT_MAX_FRAME, FrameError, FrameReader, send_frame

log = logging.getLogger("kvstore.client")

_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)

#: bound on the daemon's replies (a 65,536-block lease reply is well under this)
MAX_REPLY_FRAME = 16 << 20


class ChannelClosed(ConnectionError):
    """The connection to the daemon is gone (or was never there)."""


class Channel:
    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        self._sock = sock
        self._timeout = timeout
        # A blocking socket whose time limits the kernel enforces (SO_RCVTIMEO/SO_SNDTIMEO):
        # Python's own socket timeouts poll() before every send and recv, two extra system
        # calls on each round trip.
        sock.settimeout(None)
        self._sock_timeout: float | None = None
        self._set_timeout(timeout)
        self._reader = FrameReader(sock)
        self._lock = threading.Lock()
        self._rid = 0
        self._deferred: set[int] = set()
        self._silent: OrderedDict[int, None] = OrderedDict()  # sent, answered only on failure
        self._codec = CodecLimits.for_frames(MAX_REPLY_FRAME, 1 << 20)
        self.max_frame = DEFAULT_MAX_FRAME  # the daemon's cap; updated from its hello reply
        self.broken = False

    @classmethod
    def connect(cls, path: str, timeout: float | None) -> Channel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return cls(sock, timeout)

    def _set_timeout(self, t: float | None) -> None:
        if t == self._sock_timeout:
            return
        tv = _timeval(t)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._sock_timeout = t

    def peer_alive(self) -> bool:
        """False once the daemon has closed the connection (or died): one ``poll`` for a
        hang-up (replies still unread do not hide it), for callers that answer without a
        round trip. Marks the channel broken then."""
        if self.broken:
            return False
        p = select.poll()
        p.register(self._sock, _HANGUP)
        try:
            gone = any(ev & _HANGUP for _fd, ev in p.poll(0))
        except OSError:
            gone = True
        if gone:
            self.broken = True
        return not gone

    def close(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _fail(self, e: BaseException) -> ChannelClosed:
        # Marked broken, not closed: the owner closes the socket once no copy into or out of
        # this connection's leased/granted slots is in flight (the daemon frees those slots
        # when it sees the connection go, and may hand them to someone else right away).
        self.broken = True
        return ChannelClosed(f"connection to the kvstore daemon lost: {e}")

    def _send(self, req: m.Request) -> int:
        self._rid += 1
        body = pack(m.encode_request(self._rid, req))
        if len(body) > self.max_frame:
            raise m.ServerError(m.ErrorCode.LIMIT, f"a {req.OP} request of {len(body)} bytes "
                                f"exceeds the daemon's frame cap ({self.max_frame} B)")
        send_frame(self._sock, body)
        return self._rid

    def send(self, req: m.Request) -> None:
        """Send without waiting for the reply (read, and logged if an error, later). Ops in
        ``messages.SILENT_OPS`` get no reply unless they fail."""
        with self._lock:
            if self.broken:
                raise ChannelClosed("not connected")
            try:
                rid = self._send(req)
            except OSError as e:
                raise self._fail(e) from e
            if req.OP in m.SILENT_OPS:
                self._silent[rid] = None
                if len(self._silent) > 256:  # only a failure answers: forget the oldest
                    self._silent.popitem(last=False)
            else:
                self._deferred.add(rid)

    def call(self, req: m.Request, timeout: float | None | bool = True) -> object:
        """Send ``req`` and return its typed reply; an error reply raises ``ServerError``.

        ``timeout=True`` uses the channel's default; ``None`` waits as long as it takes.
        """
        t = self._timeout if timeout is True else timeout
        with self._lock:
            if self.broken:
                raise ChannelClosed("not connected")
            try:
                self._set_timeout(t)
                unsent: OSError | None = None
                try:
                    rid = self._send(req)
                except (BrokenPipeError, ConnectionResetError) as e:
                    # the daemon may have refused us (uid, connections) and hung up before
                    # reading the request: its reason, an error about the connection (id 0),
                    # may still wait unread in our socket
                    rid, unsent = -1, e
                while True:
                    body = self._reader.read(MAX_REPLY_FRAME)
                    if body is None:
                        raise unsent or ConnectionError("the daemon closed the connection")
                    r_rid, status, rbody = m.decode_reply(unpack(body, self._codec))
                    if r_rid == rid or (r_rid == 0 and status == m.ERROR):
                        break
                    if r_rid in self._deferred or r_rid in self._silent:
                        self._deferred.discard(r_rid)
                        self._silent.pop(r_rid, None)
                        if status == m.ERROR:
                            log.warning("kvstore daemon: request %d failed: %s", r_rid, rbody[1])
                        continue
                    raise FrameError(f"reply to unknown request {r_rid}")
            except (OSError, FrameError, CodecError, m.BadRequest) as e:
                raise self._fail(e) from e
        if status == m.ERROR:
            err = m.error_for(rbody[0], rbody[1])
            if rbody[0] in m.FATAL_CODES or r_rid == 0:
                self.close()
            raise err
        try:
            return m.REPLIES[type(req)].from_wire(rbody)
        except m.BadRequest as e:
            raise self._fail(e) from e


def _timeval(t: float | None) -> bytes:
    """``struct timeval`` for SO_RCVTIMEO/SO_SNDTIMEO; all zero waits forever."""
    if t is None:
        return struct.pack("@ll", 0, 0)
    t = max(t, 1e-6)  # zero would mean forever
    sec = int(t)
    return struct.pack("@ll", sec, max(int((t - sec) * 1e6), 1 if sec == 0 else 0))
