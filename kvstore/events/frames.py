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
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.events.codec import EventFormatError

SEQ_BYTES = 8
#: vLLM's end-of-replay marker: -1 as a signed 8-byte big-endian integer
END_SEQ = b"\xff" * SEQ_BYTES
SNAPSHOT_REQUEST = b"kvstore-snapshot/1"
_MAX_SEQ = (1 << 64) - 2  # END_SEQ read unsigned is 2**64 - 1


def seq_bytes(seq: int) -> bytes:
    if not 0 <= seq <= _MAX_SEQ:
        raise ValueError(f"sequence number {seq} is out of range")
    return seq.to_bytes(SEQ_BYTES, "big")


def parse_seq(b: bytes) -> int:
    if len(b) != SEQ_BYTES:
        raise EventFormatError(f"a sequence number is {SEQ_BYTES} bytes, got {len(b)}")
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
