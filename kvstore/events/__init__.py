"""KV cache events: what a store holds, published in vLLM's KV event schema over ZMQ.

- :mod:`~kvstore.events.types`: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
  ``EventBatch`` (frozen dataclasses) and the tier -> medium names;
- :mod:`~kvstore.events.codec`: their msgpack bytes, exactly as vLLM's encoder writes them;
- :mod:`~kvstore.events.frames`: the ZMQ messages (live stream, replay, snapshot);
- :mod:`~kvstore.events.sink`: ``EventSink``, the protocol a store reports its tier changes to;
- :mod:`~kvstore.events.publisher`: ``EventPublisher`` (PUB + ROUTER, sequence numbers,
  heartbeats, replay buffer, snapshots) and its per-namespace sinks.

Consumers: :mod:`kvstore.routing`. Wire format: docs/protocol.md, "KV events".
"""

from kvstore.events.codec import EventFormatError, decode_batch, encode_batch
from kvstore.events.config import EventsConfig
from kvstore.events.sink import EventSink
from kvstore.events.types import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    TIER_MEDIUM,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
)

__all__ = [
    "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "TIER_MEDIUM", "AllBlocksCleared", "BlockHash",
    "BlockRemoved", "BlockStored", "Event", "EventBatch", "EventFormatError", "EventSink",
    "EventsConfig", "decode_batch", "encode_batch",
]
