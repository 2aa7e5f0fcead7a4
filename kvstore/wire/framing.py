"""Length-prefixed frames: a 4-byte big-endian body length, then the body.

The length is checked against the frame cap *before* a single body byte is read, so a peer
can never make us buffer more than the cap. Helpers for asyncio streams (the daemon) and for
blocking sockets (the client).
"""

from __future__ import annotations

import asyncio
import socket
import struct

HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size
#: default frame cap: 1,024-key requests are 33 KiB, a 65,536-key one 2 MiB
DEFAULT_MAX_FRAME = 4 << 20


class FrameError(Exception):
    """The byte stream is not a sequence of frames (truncated or empty frame)."""


class FrameTooLarge(FrameError):
    """A frame header announced more bytes than the cap allows (the body was not read)."""

    def __init__(self, size: int, cap: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the {cap}-byte cap")
        self.size = size
        self.cap = cap


def encode_frame(body: bytes) -> bytes:
    """``body`` with its length prefix."""
    return HEADER.pack(len(body)) + body


def _check_length(n: int, cap: int) -> None:
    if n == 0:
        raise FrameError("empty frame")
    if n > cap:
        raise FrameTooLarge(n, cap)


# -- asyncio streams (daemon side) ---------------------------------------------------------
async def read_frame(
    reader: asyncio.StreamReader, max_frame: int, body_timeout: float | None = None
) -> bytes | None:
    """The next frame's body; ``None`` on a clean end of stream between frames.

    Waiting for a header has no time limit (an idle client is fine); once a header has
    arrived, the body must follow within ``body_timeout`` seconds.
    """
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise FrameError("stream ended inside a frame header") from None
    (n,) = HEADER.unpack(header)
    _check_length(n, max_frame)
    try:
        if body_timeout is None:
            return await reader.readexactly(n)
        async with asyncio.timeout(body_timeout):  # a timer, not a task per frame
            return await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise FrameError(f"stream ended inside a {n}-byte frame") from None


# -- blocking sockets (client side) --------------------------------------------------------
def send_frame(sock: socket.socket, body: bytes) -> None:
    sock.sendall(encode_frame(body))


def _recv_exactly(sock: socket.socket, n: int, *, inside: bool) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0 and not inside:
                return None
            raise FrameError("connection closed inside a frame")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, max_frame: int) -> bytes | None:
    """The next frame's body from a blocking socket; ``None`` on a clean close."""
    header = _recv_exactly(sock, HEADER_BYTES, inside=False)
    if header is None:
        return None
    (n,) = HEADER.unpack(header)
    _check_length(n, max_frame)
    body = _recv_exactly(sock, n, inside=True)
    assert body is not None
    return body


class FrameReader:
    """Frames from a blocking socket, read through one reusable buffer: a reply that arrives
    in one piece costs one ``recv_into`` call (header and body together), not two, and no
    allocation but the body's."""

    def __init__(self, sock: socket.socket, size: int = 64 << 10) -> None:
        self._sock = sock
        self._size = size
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0  # buffered bytes are _buf[_start:_end]
        self._end = 0

    def _fill(self, need: int, *, inside: bool) -> bool:
        """Make ``need`` bytes available from ``_start`` on."""
        have = self._end - self._start
        if have >= need:
            return True
        if self._start + need > len(self._buf):  # move the partial frame to the front / grow
            if need > len(self._buf):
                grown = bytearray(need)
                grown[:have] = self._view[self._start : self._end]
                self._buf, self._view = grown, memoryview(grown)
            else:
                self._buf[:have] = self._view[self._start : self._end]
            self._start, self._end = 0, have
        while self._end - self._start < need:
            k = self._sock.recv_into(self._view[self._end :])
            if k == 0:
                if self._end == self._start and not inside:
                    return False
                raise FrameError("connection closed inside a frame")
            self._end += k
        return True

    def read(self, max_frame: int) -> bytes | None:
        """The next frame's body; ``None`` on a clean close between frames."""
        if not self._fill(HEADER_BYTES, inside=False):
            return None
        (n,) = HEADER.unpack_from(self._buf, self._start)
        _check_length(n, max_frame)
        self._fill(HEADER_BYTES + n, inside=True)
        at = self._start + HEADER_BYTES
        body = bytes(self._view[at : at + n])
        self._start = at + n
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > self._size:  # a big reply passed: do not keep its buffer
                self._buf = bytearray(self._size)
                self._view = memoryview(self._buf)
        return body

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds now (it grows for a frame bigger than it, then shrinks)."""
        return len(self._buf)
