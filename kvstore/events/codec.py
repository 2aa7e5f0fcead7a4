"""vLLM's KV event schema as msgpack bytes, both ways.

A batch is a msgpack array ``[ts, events, data_parallel_rank]`` (msgspec ``array_like``). Each
event is a msgspec *tagged* struct, in one of two layouts:

- ``"map"`` (vLLM >= 0.28, what ``msgspec`` writes for vLLM's classes today): a map whose
  first entry is ``"type": "<EventName>"``, then the fields in declaration order, fields left
  at their default omitted (``omit_defaults``);
- ``"array"`` (vLLM < 0.28, ``array_like`` events): ``["<EventName>", field, field, ...]``.

``encode_batch`` writes the bytes vLLM's own encoder writes for the same events (pinned by
``tests/vllm/test_vllm_kv_events.py``); ``decode_batch`` reads either layout, bounded and
strict, and raises :class:`EventFormatError` for anything else. Unknown event types are skipped,
and unknown map fields and trailing fields (of an array event or of the batch) ignored, so a
newer publisher's additions do not break the reader.
"""

from __future__ import annotations

import msgpack

from kvstore.errors import KVStoreError
from kvstore.events.types import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)
from kvstore.wire.codec import CodecError, CodecLimits, unpack

LAYOUTS = ("map", "array")

#: the largest event payload a reader accepts by default (a snapshot is sent in pieces)
DEFAULT_MAX_PAYLOAD = 64 << 20
_MAX_HASH_BYTES = 64  # kvstore's keys are 32; vLLM's bytes hashes are 32 as well
_U64 = 1 << 64
_I64 = -(1 << 63)


class EventFormatError(KVStoreError, ValueError):
    """A message is not a KV event batch in vLLM's schema (truncated, garbled, wrong types)."""


# -- encoding ------------------------------------------------------------------------------------

def _event_obj(ev: Event, layout: str) -> object:
    if isinstance(ev, BlockStored):
        if layout == "array":
            return ["BlockStored", list(ev.block_hashes), ev.parent_block_hash,
                    list(ev.token_ids), ev.block_size, ev.lora_id, ev.medium, ev.lora_name]
        return {"type": "BlockStored", "block_hashes": list(ev.block_hashes),
                "parent_block_hash": ev.parent_block_hash, "token_ids": list(ev.token_ids),
                "block_size": ev.block_size, "lora_id": ev.lora_id, "medium": ev.medium,
                "lora_name": ev.lora_name}
    if isinstance(ev, BlockRemoved):
        if layout == "array":
            return ["BlockRemoved", list(ev.block_hashes), ev.medium]
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"] if layout == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {type(ev).__name__}")


def encode_batch(batch: EventBatch, layout: str = "map") -> bytes:
    """The msgpack bytes of ``batch`` in vLLM's schema (``layout``: ``"map"`` or ``"array"``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    obj = [float(batch.ts), [_event_obj(e, layout) for e in batch.events],
           batch.data_parallel_rank]
    return msgpack.packb(obj, use_bin_type=True)


# -- decoding ------------------------------------------------------------------------------------

def limits_for(max_payload: int) -> CodecLimits:
    """The bounds a payload of at most ``max_payload`` bytes is decoded within."""
    return CodecLimits(max_buffer=max_payload, max_bin=_MAX_HASH_BYTES, max_str=64 << 10,
                       max_array=1 << 20, max_map=64)


def _fail(what: str) -> EventFormatError:
    return EventFormatError(f"not a KV event batch: {what}")


def _int(v: object, what: str, *, optional: bool = False) -> int | None:
    if v is None and optional:
        return None
    if type(v) is not int:
        raise _fail(f"{what} must be an int, got {type(v).__name__}")
    return v


def _str(v: object, what: str) -> str | None:
    if v is not None and type(v) is not str:
        raise _fail(f"{what} must be a string or nil, got {type(v).__name__}")
    return v


def _hash(v: object, what: str) -> BlockHash:
    if type(v) is bytes:
        if not v:
            raise _fail(f"{what} is an empty bin")
        return v
    if type(v) is int and _I64 <= v < _U64:
        return v
    raise _fail(f"{what} must be bytes or a 64-bit int, got {type(v).__name__}")


def _hashes(v: object, what: str) -> tuple[BlockHash, ...]:
    if type(v) is not list:
        raise _fail(f"{what} must be an array, got {type(v).__name__}")
    return tuple(_hash(h, what) for h in v)


def _stored(f: dict[str, object]) -> BlockStored:
    tokens = f.get("token_ids", [])
    if type(tokens) is not list or not all(type(t) is int for t in tokens):
        raise _fail("BlockStored.token_ids must be an array of ints")
    size = _int(f.get("block_size"), "BlockStored.block_size")
    if size is None or size <= 0:
        raise _fail("BlockStored.block_size must be > 0")
    parent = f.get("parent_block_hash")
    return BlockStored(
        block_hashes=_hashes(f.get("block_hashes"), "BlockStored.block_hashes"),
        parent_block_hash=None if parent is None else _hash(parent, "BlockStored.parent_block_hash"),
        token_ids=tuple(tokens), block_size=size,
        medium=_str(f.get("medium"), "BlockStored.medium"),
        lora_id=_int(f.get("lora_id"), "BlockStored.lora_id", optional=True),
        lora_name=_str(f.get("lora_name"), "BlockStored.lora_name"),
    )


def _removed(f: dict[str, object]) -> BlockRemoved:
    return BlockRemoved(_hashes(f.get("block_hashes"), "BlockRemoved.block_hashes"),
                        _str(f.get("medium"), "BlockRemoved.medium"))


#: tag -> (field names of the array layout, after the tag; required ones; builder)
_SCHEMA = {
    "BlockStored": (("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                     "medium", "lora_name"), 4, _stored),
    "BlockRemoved": (("block_hashes", "medium"), 1, _removed),
    "AllBlocksCleared": ((), 0, lambda f: AllBlocksCleared()),
}


def _event(obj: object) -> Event | None:
    """One event of either layout; ``None`` for a well-formed event of an unknown type."""
    if type(obj) is dict:
        tag = obj.get("type")
        fields = obj
    elif type(obj) is list and obj:
        tag = obj[0]
        fields = None
    else:
        raise _fail(f"an event must be a map or a tagged array, got {type(obj).__name__}")
    if type(tag) is not str:
        raise _fail("an event's tag must be a string")
    schema = _SCHEMA.get(tag)
    if schema is None:
        return None
    names, required, build = schema
    if fields is None:
        values = obj[1:]
        if len(values) < required:
            raise _fail(f"{tag} has {len(values)} fields, needs at least {required}")
        fields = dict(zip(names, values, strict=False))  # newer trailing fields are ignored
    elif any(n not in fields for n in names[:required]):
        raise _fail(f"{tag} lacks one of {', '.join(names[:required])}")
    return build(fields)


def decode_batch(payload: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> EventBatch:
    """The batch in ``payload`` (either layout); :class:`EventFormatError` if it is not one."""
    try:
        obj = unpack(payload, limits_for(max_payload))
    except CodecError as e:
        raise _fail(str(e)) from None
    # fields after data_parallel_rank are a newer publisher's (msgspec appends them): ignored
    if type(obj) is not list or not 2 <= len(obj) <= 64:
        raise _fail("a batch is an array [ts, events, data_parallel_rank]")
    ts, events = obj[0], obj[1]
    if type(ts) not in (float, int):
        raise _fail(f"ts must be a number, got {type(ts).__name__}")
    if type(events) is not list:
        raise _fail(f"events must be an array, got {type(events).__name__}")
    rank = _int(obj[2], "data_parallel_rank", optional=True) if len(obj) >= 3 else None
    decoded = tuple(e for e in map(_event, events) if e is not None)
    return EventBatch(float(ts), decoded, rank)
