"""``EventPublisher``: KV events out over ZMQ PUB, with replay and snapshots for resync.

Sinks (one per namespace, :meth:`EventPublisher.sink`) only queue what the store tells them;
one thread owns the sockets and does the rest: it keeps each namespace's :class:`Mirror`,
turns the queued changes into events, packs them into batches (at most ``max_batch_blocks``
hashes each), numbers and sends them, keeps the last ``buffer_steps`` batches for replay, and
answers replay and snapshot requests on the ROUTER socket (:mod:`kvstore.events.frames`).

Sequence numbers start at the publisher's start time in microseconds since the epoch, so a
restarted publisher's numbers never continue the old ones: a consumer's next expected number
is never found in the new buffer, and it resyncs from a snapshot instead of splicing two
histories. Numbers wrap to 0 after ``2**64 - 2`` (:mod:`kvstore.events.frames`), some
584,000 years after the epoch. The first batch of every publisher is ``AllBlocksCleared``; an
empty batch goes out after ``heartbeat_s`` without one, so consumers can tell a quiet
publisher from a dead one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvstore.errors import ConfigError
from kvstore.events import frames
from kvstore.events.codec import encode_batch
from kvstore.events.config import EventsConfig
from kvstore.events.mirror import Mirror
from kvstore.events.sink import check_stored, check_tier
from kvstore.events.types import AllBlocksCleared, Event, EventBatch
from kvstore.keys import BlockKey

log = logging.getLogger("kvstore.events")

_POLL_S = 0.05  # longest a replay request waits while nothing else happens
#: replay/snapshot requests answered per pass: a peer sending requests as fast as they are
#: answered kept the thread in that loop, so nothing was published, not even a heartbeat
_REQUESTS_PER_PASS = 64
#: how long one reply may wait for its client to take what was queued before it is abandoned
#: (the client gets no end marker, times out and asks again); a client that stalled a reply
#: gets none of that patience for :data:`_STALLED_FOR_S`, so a client that sends requests and
#: never reads costs the thread at most this once per that period
_STALL_S = 0.25
_STALLED_FOR_S = 10.0
_STOP = object()


class _Stalled(Exception):
    """The client's queue stayed full past its patience: the reply is abandoned."""


@dataclass(frozen=True, slots=True)
class PublisherStats:
    last_seq: int
    batches: int
    events: int
    replays: int
    snapshots: int
    bad_requests: int
    blocks: int  # (block, namespace) pairs held in some tier, as published
    queued: int  # sink calls not yet turned into events
    abandoned_replies: int = 0  # replies cut off because their client did not read them


@dataclass(frozen=True, slots=True)
class _Change:
    mirror: Mirror
    op: str  # "stored" | "removed" | "cleared"
    tier: str | None
    keys: tuple[BlockKey, ...]
    parents: tuple[BlockKey | None, ...]


@dataclass(frozen=True, slots=True)
class _Forget:
    namespace_id: bytes  # released: forget its mirror if it holds nothing (EventPublisher.release)


class NamespaceSink:
    """The :class:`~kvstore.events.sink.EventSink` of one namespace on a publisher."""

    __slots__ = ("_put", "_mirror")

    def __init__(self, publisher: EventPublisher, mirror: Mirror) -> None:
        self._put = publisher._queue.put
        self._mirror = mirror

    def stored(self, tier: str, keys: Sequence[BlockKey],
               parents: Sequence[BlockKey | None]) -> None:
        check_stored(tier, keys, parents)
        if keys:
            self._put(_Change(self._mirror, "stored", tier, tuple(keys), tuple(parents)))

    def removed(self, tier: str | None, keys: Sequence[BlockKey]) -> None:
        check_tier(tier, optional=True)
        if keys:
            self._put(_Change(self._mirror, "removed", tier, tuple(keys), ()))

    def cleared(self, tier: str | None = None) -> None:
        check_tier(tier, optional=True)
        self._put(_Change(self._mirror, "cleared", tier, (), ()))


class EventPublisher:
    """Binds ``config.endpoint`` (PUB) and ``config.replay_endpoint`` (ROUTER) at once;
    ``endpoint`` / ``replay_endpoint`` are the addresses bound (a port 0 resolved)."""

    def __init__(self, config: EventsConfig, *, context: zmq.Context | None = None,
                 first_seq: int | None = None) -> None:
        """``first_seq``: the first batch's sequence number (default: the start time in
        microseconds since the epoch, modulo :data:`~kvstore.events.frames.SEQ_MOD`)."""
        if first_seq is not None and not frames.valid_seq(first_seq):
            raise ConfigError(f"first_seq must be an int in 0 .. {frames.MAX_SEQ}, got "
                              f"{first_seq!r}")
        self.config = config
        self._ctx = context or zmq.Context()
        self._own_ctx = context is None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._mirrors: dict[bytes, Mirror] = {}
        self._sinks: dict[bytes, NamespaceSink] = {}
        self._refs: dict[bytes, int] = {}  # namespace -> holders (acquire - release)
        self._lock = threading.Lock()
        self._buffer: deque[frames.StreamMessage] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._next_seq = (int(time.time() * 1e6) % frames.SEQ_MOD if first_seq is None
                          else first_seq)
        self._counts = {"batches": 0, "events": 0, "replays": 0, "snapshots": 0, "bad": 0,
                        "abandoned": 0}
        self._stalled: dict[bytes, float] = {}  # client -> when a reply to it was abandoned
        self._last_sent = 0.0
        self.endpoint = ""
        self.replay_endpoint = ""
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._bind()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._publish([AllBlocksCleared()])  # before any sink call: consumers start from empty
        self._thread.start()

    # -- public --------------------------------------------------------------------------------
    def sink(self, namespace_id: bytes, block_size: int) -> NamespaceSink:
        """The sink of one namespace (the same one every time it is asked for)."""
        with self._lock:
            s = self._sinks.get(namespace_id)
            if s is None:
                m = Mirror(block_size, self.config.max_batch_blocks)
                self._mirrors[namespace_id] = m
                s = self._sinks[namespace_id] = NamespaceSink(self, m)
            return s

    def acquire(self, namespace_id: bytes, block_size: int) -> NamespaceSink:
        """:meth:`sink`, held until :meth:`release`: a namespace a daemon opened."""
        with self._lock:
            self._refs[namespace_id] = self._refs.get(namespace_id, 0) + 1
        return self.sink(namespace_id, block_size)

    def release(self, namespace_id: bytes) -> None:
        """The namespace's store is closed: once every change it queued is applied, its
        mirror and sink are forgotten if it holds nothing (no tier announces a block of it)
        and nobody acquired it again meanwhile. Namespaces come and go over months (tenants,
        adapters, revisions): each one's empty mirror was kept forever. A later
        :meth:`sink` of the same namespace starts a fresh one, as empty as this was."""
        with self._lock:
            n = self._refs.get(namespace_id, 0) - 1
            if n > 0:
                self._refs[namespace_id] = n
            else:
                self._refs.pop(namespace_id, None)
        self._queue.put(_Forget(namespace_id))

    def _forget(self, namespace_id: bytes) -> None:
        with self._lock:
            m = self._mirrors.get(namespace_id)
            if m is not None and not len(m) and namespace_id not in self._refs:
                del self._mirrors[namespace_id]
                del self._sinks[namespace_id]

    def sink_of(self, namespace_id: bytes) -> NamespaceSink | None:
        """The namespace's sink if it was ever asked for, else ``None``."""
        with self._lock:
            return self._sinks.get(namespace_id)

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every sink call made before this one has been published."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def stats(self) -> PublisherStats:
        c = self._counts
        return PublisherStats(frames.prev_seq(self._next_seq), c["batches"], c["events"],
                              c["replays"], c["snapshots"], c["bad"],
                              sum(len(m) for m in list(self._mirrors.values())),
                              self._queue.qsize(), c["abandoned"])

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=int(timeout * 1000))
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sockets -------------------------------------------------------------------------------
    def _bind(self) -> None:
        cfg = self.config
        try:
            pub = self._pub = self._ctx.socket(zmq.PUB)
            pub.set_hwm(cfg.hwm)
            pub.bind(cfg.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            r = self._router = self._ctx.socket(zmq.ROUTER)
            r.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client is an error, not a stall
            # a client's queue holds one whole replay (the buffer and the end marker); a client
            # that asks and does not read holds at most that, where an unbounded queue grew by
            # a whole buffer per request (sends are non-blocking: _send)
            r.setsockopt(zmq.SNDHWM, cfg.buffer_steps + 2)
            r.setsockopt(zmq.MAXMSGSIZE, 4096)  # requests are tiny
            assert cfg.replay_endpoint is not None
            r.bind(cfg.replay_endpoint)
            self.replay_endpoint = r.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            for s in (self._pub, self._router):
                if s is not None:
                    s.close(linger=0)
            if self._own_ctx:
                self._ctx.term()
            raise ConfigError(f"cannot bind the KV events sockets ({cfg.endpoint}, replay "
                              f"{cfg.replay_endpoint}): {e}; choose free addresses") from None

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        get = self._queue.get
        more = False  # requests were left waiting by the last pass
        while True:
            wait = 0.0 if more else max(
                0.0, min(_POLL_S, self._last_sent + self.config.heartbeat_s - time.monotonic()))
            try:
                item = get(timeout=wait)
            except queue.Empty:
                item = None
            events: list[Event] = []
            waiters: list[threading.Event] = []
            stop = False
            while item is not None:
                if item is _STOP:
                    stop = True
                elif isinstance(item, threading.Event):
                    waiters.append(item)
                elif isinstance(item, _Forget):
                    self._forget(item.namespace_id)
                else:
                    events.extend(self._apply(item))
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            try:
                if events or time.monotonic() - self._last_sent >= self.config.heartbeat_s:
                    self._publish(events)
                more = self._serve_requests()
            except Exception:  # never let a bad moment kill the stream
                more = False
                log.exception("publishing KV events failed")
            for w in waiters:
                w.set()
            if stop:
                return

    @staticmethod
    def _apply(c: _Change) -> list[Event]:
        if c.op == "stored":
            assert c.tier is not None
            return c.mirror.stored(c.tier, c.keys, c.parents)
        if c.op == "removed":
            return c.mirror.removed(c.tier, c.keys)
        return c.mirror.cleared(c.tier)

    def _batches(self, events: Sequence[Event]) -> list[list[Event]]:
        cap = self.config.max_batch_blocks
        out: list[list[Event]] = [[]]
        n = 0
        for e in events:
            w = len(e.block_hashes) if not isinstance(e, AllBlocksCleared) else 1
            if out[-1] and n + w > cap:
                out.append([])
                n = 0
            out[-1].append(e)
            n += w
        return out

    def _encode(self, events: Sequence[Event]) -> bytes:
        cfg = self.config
        return encode_batch(EventBatch(time.time(), tuple(events), cfg.data_parallel_rank),
                            cfg.layout)

    def _publish(self, events: Sequence[Event]) -> None:
        assert self._pub is not None
        for chunk in self._batches(events):
            msg = frames.StreamMessage(self._topic, self._next_seq, self._encode(chunk))
            self._next_seq = frames.next_seq(self._next_seq)
            self._pub.send_multipart([msg.topic, frames.seq_bytes(msg.seq), msg.payload])
            self._buffer.append(msg)
            self._counts["batches"] += 1
            self._counts["events"] += len(chunk)
        self._last_sent = time.monotonic()

    def _serve_requests(self) -> bool:
        """Answer up to :data:`_REQUESTS_PER_PASS` requests; True if more may be waiting."""
        r = self._router
        assert r is not None
        for _ in range(_REQUESTS_PER_PASS):
            if not r.poll(0):
                return False
            try:
                req = frames.parse_request(r.recv_multipart(zmq.NOBLOCK))
            except Exception as e:  # garbage from a peer: tell nobody, count it
                self._counts["bad"] += 1
                log.debug("bad replay request: %s", e)
                continue
            try:
                if req.snapshot:
                    self._send_snapshot(req.client)
                else:
                    self._send_replay(req.client, req.start_seq)
                self._send(req.client, frames.end_of_reply(req.client))
            except _Stalled:
                self._counts["abandoned"] += 1
                log.debug("replay client %r does not read: reply abandoned", req.client)
            except zmq.ZMQError as e:  # the client left meanwhile
                log.debug("replay client gone: %s", e)
        return True

    def _send(self, client: bytes, parts: list[bytes]) -> None:
        """Queue one message of a reply without blocking the thread for longer than the
        client's patience (:data:`_STALL_S`, none while it is marked stalled)."""
        r = self._router
        assert r is not None
        now = time.monotonic()
        since = self._stalled.get(client)
        if since is not None and now - since >= _STALLED_FOR_S:
            del self._stalled[client]
            since = None
        deadline = now + (0.0 if since is not None else _STALL_S)
        while True:
            try:
                r.send_multipart(parts, zmq.NOBLOCK)
                return
            except zmq.Again:
                if time.monotonic() >= deadline:
                    if len(self._stalled) >= 1024:  # bounded: forget the oldest
                        del self._stalled[next(iter(self._stalled))]
                    self._stalled[client] = time.monotonic()
                    raise _Stalled from None
                time.sleep(0.001)

    def _send_replay(self, client: bytes, start: int) -> None:
        """Every buffered batch from number ``start`` on (vLLM's ``seq >= start``), "on"
        counted the shorter way round the wrap (:func:`~kvstore.events.frames.seq_diff`): in
        the order published, ``2**64 - 2`` before ``0``; nothing for an invalid ``start``."""
        self._counts["replays"] += 1
        if not frames.valid_seq(start):
            return
        for msg in list(self._buffer):
            if frames.seq_diff(msg.seq, start) >= 0:
                self._send(client, frames.reply(client, msg))

    def _send_snapshot(self, client: bytes) -> None:
        self._counts["snapshots"] += 1
        seq = frames.prev_seq(self._next_seq)  # the state now is the state after this batch
        events: list[Event] = [AllBlocksCleared()]
        for m in list(self._mirrors.values()):
            events.extend(m.snapshot())
        for chunk in self._batches(events):
            msg = frames.StreamMessage(self._topic, seq, self._encode(chunk))
            self._send(client, frames.reply(client, msg))

