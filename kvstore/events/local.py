"""``LocalSink``: a store's KV events handed to an in-process consumer, synchronously.

The same events a publisher sends (a :class:`~kvstore.events.mirror.Mirror` turns the store's
tier changes into vLLM-schema events, encoded as a ``KVEventBatch``), without sockets or a
thread: each change is one batch, delivered as its encoded payload before the store's call
returns, or (``batched=True``) the changes since the last :meth:`LocalSink.flush` as one
batch when the owner calls it. For consumers living in the store's process (``kvstore replay
--engines``, tests) that want the wire format's exact behaviour and a deterministic order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvstore.events.codec import encode_batch
from kvstore.events.mirror import Mirror
from kvstore.events.sink import check_stored, check_tier
from kvstore.events.types import BlockHash, BlockRemoved, Event, EventBatch
from kvstore.keys import BlockKey

#: receives one encoded ``KVEventBatch`` (msgpack bytes)
Deliver = Callable[[bytes], None]


def _coalesce(events: list[Event]) -> list[Event]:
    """Adjacent removals from one medium as one ``BlockRemoved`` (evictions come one by one)."""
    out: list[Event] = []
    run: list[BlockHash] = []
    medium: str | None = None
    for e in events:
        if isinstance(e, BlockRemoved) and (not run or e.medium == medium):
            run += e.block_hashes
            medium = e.medium
            continue
        if run:
            out.append(BlockRemoved(tuple(run), medium))
            run = []
        if isinstance(e, BlockRemoved):
            run += e.block_hashes
            medium = e.medium
        else:
            out.append(e)
    if run:
        out.append(BlockRemoved(tuple(run), medium))
    return out


class LocalSink:
    """An :class:`~kvstore.events.sink.EventSink` that delivers each change as one batch.

    Thread-safe: the store calls it from its own threads (the disk writer reports what it
    wrote as it goes), and a change is delivered or held whole, in the order the store
    reported it. ``deliver`` runs on the store's thread, under its lock: it must only record or apply
    the batch (a :class:`~kvstore.routing.index.PrefixIndex` applying it is fine) and never
    call back into the store. ``clock`` stamps the batches (wall clock by default).
    ``batched``: hold the events until :meth:`flush` (a store evicting for a put reports
    each victim on its own; one batch per request is what a publisher's batching gives).
    """

    __slots__ = ("_mirror", "_deliver", "_clock", "_layout", "_batched", "_pending", "_lock",
                 "batches")

    def __init__(self, deliver: Deliver, *, block_size: int, layout: str = "map",
                 clock: Callable[[], float] = time.time, batched: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        self._mirror = Mirror(block_size)
        self._deliver = deliver
        self._clock = clock
        self._layout = layout
        self._batched = batched
        self._pending: list[Event] = []
        self._lock = threading.RLock()
        self.batches = 0  # delivered

    def _send(self, events: list[Event]) -> None:
        if self._batched:
            self._pending += events
        elif events:
            self._deliver(encode_batch(EventBatch(self._clock(), tuple(events)), self._layout))
            self.batches += 1

    def flush(self) -> None:
        """Deliver the events held since the last flush (``batched``) as one batch."""
        with self._lock:
            events, self._pending = _coalesce(self._pending), []
            if events:
                self._deliver(encode_batch(EventBatch(self._clock(), tuple(events)),
                                           self._layout))
                self.batches += 1

    def stored(self, tier: str, keys: Sequence[BlockKey],
               parents: Sequence[BlockKey | None]) -> None:
        check_stored(tier, keys, parents)
        if keys:
            with self._lock:
                self._send(self._mirror.stored(tier, keys, parents))

    def removed(self, tier: str | None, keys: Sequence[BlockKey]) -> None:
        check_tier(tier, optional=True)
        if keys:
            with self._lock:
                self._send(self._mirror.removed(tier, keys))

    def cleared(self, tier: str | None = None) -> None:
        check_tier(tier, optional=True)
        with self._lock:
            self._send(self._mirror.cleared(tier))

    def __len__(self) -> int:
        """Blocks the consumer has been told are held (in any tier)."""
        with self._lock:
            return len(self._mirror)
