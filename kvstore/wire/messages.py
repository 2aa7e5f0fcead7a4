"""The daemon protocol's envelopes and its catalogue of typed requests and replies.

A request frame is ``[op, request_id, args]``; a reply frame is ``[request_id, status, body]``
with ``status`` 0 (``body`` is the reply's array) or 1 (``body`` is ``[code, message]``).
Request ids let a client pipeline requests; the daemon answers one connection's requests in
order. ``request_id`` 0 is reserved for errors about the connection itself (a frame that
could not be read, a peer that is not allowed). See ``docs/protocol.md``.

The messages live in modules named for what they are for, and are all importable from here:

| module | messages |
| --- | --- |
| ``handshake`` | ``Hello`` -> ``HelloReply`` |
| ``data_ops`` | ``Lookup``, ``Prefetch``, ``Pin``, ``Unpin``, ``Evict``, ``Flush``, ``Ping``; ``Count``, ``Empty`` |
| ``zero_copy`` | ``Fetch`` -> ``Lease`` -> ``Release``; ``Put`` -> ``Grant`` -> ``Commit`` / ``Abort`` |
| ``stats`` | ``Stats`` -> ``StatsReply`` (``StoreStats``, ``ServerStats``); ``LookupReport`` |
| ``admin_ops`` | ``Remove`` (an admin connection's, sent instead of hello) |
| ``errors`` | ``ErrorCode``, ``ServerError`` and the exceptions of error replies |
| ``fields`` | checked decoding of each field; the ``[keys, parent]`` and ``[id]`` shapes |
"""

from __future__ import annotations

from kvstore.wire.admin_ops import ADMIN_OPS, Remove
from kvstore.wire.data_ops import (
    TIERS,
    Count,
    Empty,
    Evict,
    Flush,
    Lookup,
    Pin,
    Ping,
    Prefetch,
    Unpin,
)
from kvstore.wire.errors import (
    FATAL_CODES,
    BadRequest,
    ErrorCode,
    PermissionDeniedError,
    ProtocolVersionError,
    ServerError,
    error_for,
)
from kvstore.wire.fields import KEY_BYTES, MAX_ID, split_keys
from kvstore.wire.handshake import Hello, HelloReply
from kvstore.wire.stats import (
    LookupReport,
    ServerStats,
    Stats,
    StatsReply,
    store_stats_from_wire,
    store_stats_to_wire,
)
from kvstore.wire.zero_copy import Abort, Commit, Fetch, Grant, Lease, Put, Release

__all__ = [
    "ADMIN_OPS",
    "ERROR",
    "FATAL_CODES",
    "KEY_BYTES",
    "MAX_ID",
    "OK",
    "REPLIES",
    "REQUESTS",
    "SILENT_OPS",
    "TIERS",
    "Abort",
    "BadRequest",
    "Commit",
    "Count",
    "Empty",
    "ErrorCode",
    "Evict",
    "Fetch",
    "Flush",
    "Grant",
    "Hello",
    "HelloReply",
    "Lease",
    "Lookup",
    "LookupReport",
    "PermissionDeniedError",
    "Pin",
    "Ping",
    "Prefetch",
    "ProtocolVersionError",
    "Put",
    "Release",
    "Remove",
    "Request",
    "ServerError",
    "ServerStats",
    "Stats",
    "StatsReply",
    "Unpin",
    "decode_envelope",
    "decode_reply",
    "encode_error",
    "encode_reply",
    "encode_request",
    "error_for",
    "parse_request",
    "split_keys",
    "store_stats_from_wire",
    "store_stats_to_wire",
]

OK, ERROR = 0, 1

#: ops the daemon answers only when they fail (a client that only reports lookups must not
#: have replies pile up unread in its socket)
SILENT_OPS = frozenset({LookupReport.OP})

Request = (Hello | Lookup | Fetch | Put | Prefetch | Pin | Unpin | Release | Commit | Abort
           | Evict | Stats | Flush | Ping | LookupReport | Remove)
REQUESTS: dict[str, type] = {c.OP: c for c in (
    Hello, Lookup, Fetch, Put, Prefetch, Pin, Unpin, Release, Commit, Abort, Evict, Stats,
    Flush, Ping, LookupReport, Remove)}

#: the reply type of each request
REPLIES: dict[type, type] = {
    Hello: HelloReply, Lookup: Count, Fetch: Lease, Put: Grant, Prefetch: Count, Pin: Count,
    Unpin: Count, Release: Empty, Commit: Count, Abort: Empty, Evict: Count, Stats: StatsReply,
    Flush: Empty, Ping: Empty, LookupReport: Empty, Remove: Count,
}


def encode_request(rid: int, req: Request) -> list:
    return [req.OP, rid, req.to_wire()]


def decode_envelope(obj: object) -> tuple[int, str, object]:
    """``[op, id, args]`` -> its parts; raises :class:`BadRequest` (code BAD_FRAME)."""
    if (not isinstance(obj, list) or len(obj) != 3 or not isinstance(obj[0], str)
            or isinstance(obj[1], bool) or not isinstance(obj[1], int)
            or not 0 < obj[1] <= MAX_ID):
        raise BadRequest("a request must be [op: str, request_id: int > 0, args: array]",
                         ErrorCode.BAD_FRAME)
    return obj[1], obj[0], obj[2]


def parse_request(op: str, args: object) -> Request:
    cls = REQUESTS.get(op)
    if cls is None:
        raise BadRequest(f"unknown op {op[:40]!r}; this daemon knows {', '.join(REQUESTS)}",
                         ErrorCode.UNKNOWN_OP)
    return cls.from_wire(args)


def encode_reply(rid: int, reply: object) -> list:
    return [rid, OK, reply.to_wire()]  # type: ignore[attr-defined]


def encode_error(rid: int, code: int, message: str) -> list:
    return [rid, ERROR, [int(code), message[:4096]]]


def decode_reply(obj: object) -> tuple[int, int, object]:
    """``[id, status, body]`` -> its parts (the client trusts little, checks shape)."""
    if (not isinstance(obj, list) or len(obj) != 3 or type(obj[0]) is not int
            or obj[1] not in (OK, ERROR)):
        raise BadRequest("a reply must be [request_id, status, body]", ErrorCode.BAD_FRAME)
    if obj[1] == ERROR:
        b = obj[2]
        if not isinstance(b, list) or len(b) != 2 or type(b[0]) is not int or not isinstance(b[1], str):
            raise BadRequest("an error reply body must be [code, message]", ErrorCode.BAD_FRAME)
    return obj[0], obj[1], obj[2]
