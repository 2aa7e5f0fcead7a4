"""Error replies of the daemon protocol: their codes and the exceptions a client raises for
them (a reply body ``[code, message]``; see ``docs/protocol.md``)."""

from __future__ import annotations

from enum import IntEnum

from kvstore.errors import KVStoreError

__all__ = [
    "FATAL_CODES",
    "BadRequest",
    "ErrorCode",
    "PermissionDeniedError",
    "ProtocolVersionError",
    "ServerError",
    "error_for",
]


class ErrorCode(IntEnum):
    """The ``code`` of an error reply."""

    BAD_FRAME = 1  # the body is not msgpack, or not a [op, id, args] envelope
    FRAME_TOO_LARGE = 2  # the frame header announced more than the cap (connection closed)
    BAD_REQUEST = 3  # a well-formed envelope with invalid arguments
    UNKNOWN_OP = 4
    VERSION_MISMATCH = 5  # hello with another protocol version (connection closed)
    NOT_ALLOWED = 6  # the peer's uid is not in the allow-list (connection closed)
    HELLO_REQUIRED = 7  # a request before hello, or a second hello
    LIMIT = 8  # too many keys, leases, connections or namespaces
    UNKNOWN_ID = 9  # a lease or grant id this connection does not hold
    SHUTTING_DOWN = 10
    CONFIG = 11  # the hello names a layout or namespace this daemon cannot serve
    INTERNAL = 12  # a bug or an unexpected failure in the daemon (it keeps serving)
    TIMEOUT = 13  # the operation did not finish in the time asked (flush)
    NOT_DURABLE = 14  # flush: "flush: N block(s) ..." put before it are not on disk


#: codes after which the daemon closes the connection
FATAL_CODES = frozenset({ErrorCode.FRAME_TOO_LARGE, ErrorCode.VERSION_MISMATCH,
                         ErrorCode.NOT_ALLOWED, ErrorCode.SHUTTING_DOWN})


class ServerError(KVStoreError, RuntimeError):
    """An error reply from the daemon (or a request the client could not get answered)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BadRequest(ServerError):
    """A request that does not parse (raised by ``from_wire``)."""

    def __init__(self, message: str, code: int = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(code, message)


class ProtocolVersionError(ServerError):
    """Client and daemon speak different protocol versions."""


class PermissionDeniedError(ServerError, PermissionError):
    """The daemon refused this process (its uid is not in the daemon's allow-list)."""


def error_for(code: int, message: str) -> ServerError:
    """The exception a client raises for an error reply."""
    if code == ErrorCode.VERSION_MISMATCH:
        return ProtocolVersionError(code, message)
    if code == ErrorCode.NOT_ALLOWED:
        return PermissionDeniedError(code, message)
    return ServerError(code, message)
