"""The ZMQ messages around the event payloads (vLLM's ``ZmqEventPublisher`` framing).

- **Live stream** (PUB -> SUB): three frames ``[topic, seq, payload]``; ``seq`` is an 8-byte
  big-endian unsigned integer, one more for every batch; ``payload`` is a batch
  (:mod:`kvstore.events.codec`).
- **Replay** (DEALER/REQ -> ROUTER): the request is ``[b"", start_seq]`` (8 bytes, big-endian);
  the reply is every buffered batch with ``seq >= start_seq`` as ``[b"", topic, seq, payload]``,
  then the end marker ``[b"", b"", END_SEQ, b""]``. This is vLLM's protocol.
- **Snapshot** (kvstore's addition on the same socket): the request is
  ``[b"", SNAPSHOT_REQUEST]``; the reply is the publisher's whole current state as batches
  ``[b"", topic, seq, payload]`` that all carry the sequence number ``seq`` of the last batch
  published before it (the state is exactly "after batch ``seq``"), the first starting with
  ``AllBlocksCleared``, then the end marker. A vLLM publisher reads the request as a start
  number past its buffer and answers with the end marker alone: a consumer then knows there
  is no snapshot to be had.

**Sequence numbers** are ``0 .. MAX_SEQ`` (``2**64 - 2``): ``END_SEQ`` read unsigned is
``2**64 - 1`` and marks the end of a reply, so no batch may carry it. The number after
``MAX_SEQ`` is ``0`` (:func:`next_seq`): numbers run modulo ``SEQ_MOD = 2**64 - 1``, and
"before"/"after" are decided by serial number arithmetic (:func:`seq_diff`, RFC 1982): the
shorter way round the circle. For numbers less than ``2**63`` apart (every real stream:
kvstore's start at the wall clock in microseconds, vLLM's at 0) that is plain ``<``/``>``.
A frame that carries ``END_SEQ`` or is not 8 bytes where a batch's number belongs is refused
(:class:`~kvstore.events.codec.EventFormatError`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.events.codec import EventFormatError

SEQ_BYTES = 8
#: vLLM's end-of-replay marker: -1 as a signed 8-byte big-endian integer
END_SEQ = b"\xff" * SEQ_BYTES
SNAPSHOT_REQUEST = b"kvstore-snapshot/1"
#: sequence numbers run modulo this: 0 .. 2**64 - 2 (END_SEQ read unsigned is 2**64 - 1)
SEQ_MOD = (1 << 64) - 1
MAX_SEQ = SEQ_MOD - 1
_HALF = SEQ_MOD // 2


def valid_seq(seq: object) -> bool:
    """``seq`` is a sequence number a batch may carry (an int in ``0 .. MAX_SEQ``)."""
    return type(seq) is int and 0 <= seq <= MAX_SEQ


def next_seq(seq: int) -> int:
    """The number after ``seq``: ``seq + 1``, and ``0`` after ``MAX_SEQ``."""
    return (seq + 1) % SEQ_MOD


def prev_seq(seq: int) -> int:
    """The number before ``seq`` (``MAX_SEQ`` before ``0``)."""
    return (seq - 1) % SEQ_MOD


def seq_diff(a: int, b: int) -> int:
    """How far ``a`` is after ``b`` (negative: before), the shorter way round: in
    ``-(SEQ_MOD // 2) .. SEQ_MOD // 2``."""
    d = (a - b) % SEQ_MOD
    return d - SEQ_MOD if d > _HALF else d


def seq_bytes(seq: int) -> bytes:
    if not valid_seq(seq):
        raise ValueError(f"sequence number {seq!r} is out of range (0 .. {MAX_SEQ}, an int)")
    return seq.to_bytes(SEQ_BYTES, "big")


def parse_seq(b: bytes) -> int:
    if type(b) is not bytes:
        raise EventFormatError(f"a sequence number is {SEQ_BYTES} bytes, got a "
                               f"{type(b).__name__}")
    if len(b) != SEQ_BYTES:
        raise EventFormatError(f"a sequence number is {SEQ_BYTES} bytes, got {len(b)}")
    if b == END_SEQ:
        raise EventFormatError("0xFF x 8 is the end marker, not a batch's sequence number")
    return int.from_bytes(b, "big")


@dataclass(frozen=True, slots=True)
class StreamMessage:
    """One batch as it travels: topic, sequence number, encoded payload."""

    topic: bytes
    seq: int
    payload: bytes


def parse_stream(frames: list[bytes]) -> StreamMessage:
    """A live-stream message (``[topic, seq, payload]``)."""
    if len(frames) != 3:
        raise EventFormatError(f"a stream message has 3 frames, got {len(frames)}")
    return StreamMessage(frames[0], parse_seq(frames[1]), frames[2])


def parse_reply(frames: list[bytes]) -> StreamMessage | None:
    """A replay/snapshot reply as a DEALER receives it; ``None`` for the end marker."""
    if len(frames) != 4 or frames[0] != b"":
        raise EventFormatError(f"a reply has 4 frames after its envelope, got {len(frames)}")
    if frames[2] == END_SEQ:
        if frames[3]:
            raise EventFormatError("the end marker carries no payload")
        return None
    return StreamMessage(frames[1], parse_seq(frames[2]), frames[3])


def replay_request(start_seq: int) -> list[bytes]:
    return [b"", seq_bytes(start_seq)]


def snapshot_request() -> list[bytes]:
    return [b"", SNAPSHOT_REQUEST]


@dataclass(frozen=True, slots=True)
class Request:
    """A request as the publisher's ROUTER receives it."""

    client: bytes
    snapshot: bool
    start_seq: int  # replay from here (unused for a snapshot)


def parse_request(frames: list[bytes]) -> Request:
    if len(frames) != 3 or frames[1] != b"":
        raise EventFormatError(f"a request has an identity, an empty frame and a body; "
                               f"got {len(frames)} frames")
    body = frames[2]
    if body == SNAPSHOT_REQUEST:
        return Request(frames[0], True, 0)
    # vLLM reads any length as a big-endian number; so do we, bounded
    if not 1 <= len(body) <= SEQ_BYTES:
        raise EventFormatError(f"a replay request names an 8-byte sequence number, got "
                               f"{len(body)} bytes")
    return Request(frames[0], False, int.from_bytes(body, "big"))


def reply(client: bytes, msg: StreamMessage) -> list[bytes]:
    return [client, b"", msg.topic, seq_bytes(msg.seq), msg.payload]


def end_of_reply(client: bytes) -> list[bytes]:
    return [client, b"", b"", END_SEQ, b""]
