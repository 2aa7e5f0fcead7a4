"""``Subscriber``: N publishers' event streams into one :class:`PrefixIndex`.

One thread owns every socket: a SUB per engine (its live stream) and, while a resync is under
way, a DEALER to the engine's replay socket (a fresh one per request, so a late answer to an
abandoned request can never be taken for the next one). Each engine's :class:`EngineFeed`
decides what to apply and what to ask for; anything that goes wrong with a message is counted
and the thread carries on.

Each socket has one owner, this thread, and one way out, :meth:`Subscriber._close_socket`:
it leaves the poller and the socket map, then closes, exactly once. A DEALER is closed when
its request is answered (before the feed hears the end marker, so whatever the feed asks next
gets a fresh one) or abandoned (a request that timed out, a new one due).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvstore.errors import ConfigError
from kvstore.events import frames
from kvstore.events.codec import DEFAULT_MAX_PAYLOAD, EventFormatError
from kvstore.events.config import replay_endpoint_for
from kvstore.routing.feed import LIVE, Ask, EngineFeed, FeedStats
from kvstore.routing.index import PrefixIndex

log = logging.getLogger("kvstore.routing")

_POLL_MS = 50
_BURST = 256  # messages taken from one socket before the others get a turn


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """An engine's event sockets: ``endpoint`` (its PUB) and ``replay_endpoint`` (default
    the one :func:`~kvstore.events.config.replay_endpoint_for` derives; ``""``: none).
    ``heartbeats=False`` for publishers that say nothing while idle (vLLM's): they never fall
    out for silence."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    heartbeats: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("an engine needs a name")
        if self.replay_endpoint is None:
            object.__setattr__(self, "replay_endpoint", replay_endpoint_for(self.endpoint))


@dataclass(slots=True)
class _Engine:
    spec: EngineSpec
    feed: EngineFeed
    sub: zmq.Socket
    dealer: zmq.Socket | None = None


class Subscriber:
    """Subscribes to ``engines`` and keeps ``index`` up to date until :meth:`close`.

    ``silence_s``: an engine not heard from for that long falls out of the index (``None``:
    never; for publishers without heartbeats, such as vLLM's, which say nothing while idle).
    """

    def __init__(self, engines: Sequence[EngineSpec] = (), index: PrefixIndex | None = None, *,
                 silence_s: float | None = 5.0, request_timeout_s: float = 5.0,
                 max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.silence_s = silence_s
        self.request_timeout_s = request_timeout_s
        self.max_payload = max_payload
        self._ctx = zmq.Context()
        self._engines: dict[str, _Engine] = {}
        self._by_socket: dict[zmq.Socket, _Engine] = {}
        self._poller = zmq.Poller()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stats: dict[str, FeedStats] = {}
        self._running = True
        self._closed = False
        for spec in engines:
            self.add(spec)
        self._thread = threading.Thread(target=self._run, name="kvstore-routing", daemon=True)
        self._thread.start()

    # -- public --------------------------------------------------------------------------------
    def add(self, spec: EngineSpec) -> None:
        """Subscribe to one more engine (its name must be new)."""
        self._commands.put(("add", spec))

    def remove(self, name: str) -> None:
        """Stop following ``name`` and forget what it held."""
        self._commands.put(("remove", name))

    def stats(self) -> tuple[FeedStats, ...]:
        return tuple(self._stats.values())

    def live_engines(self) -> tuple[str, ...]:
        """Engines in step with their publisher right now."""
        return tuple(s.engine for s in self._stats.values() if s.state == LIVE)

    def wait_live(self, names: Sequence[str] | None = None, timeout: float = 30.0) -> bool:
        """Wait until ``names`` (default: every engine) are live; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = {s.engine: s.state for s in self._stats.values()}
            want = list(st) if names is None else names
            if want and all(st.get(n) == LIVE for n in want):
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Stop the thread and close every socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._running = False
        self._thread.join(10)
        if self._thread.is_alive():  # its sockets are its own: leave them to it
            log.warning("the KV event subscriber's thread did not stop; its sockets are left")
            return
        for e in list(self._engines.values()):
            if e.dealer is not None:
                self._close_socket(e, e.dealer)
            self._close_socket(e, e.sub)
        self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while self._running:
            try:
                self._step()
            except Exception:  # a bug must not stop the index from following the rest
                log.exception("the KV event subscriber hit an error; carrying on")
                time.sleep(0.1)

    def _step(self) -> None:
        self._take_commands()
        ready = dict(self._poller.poll(_POLL_MS))
        now = time.monotonic()
        for sock in ready:
            e = self._by_socket.get(sock)
            if e is None:
                continue
            if sock is e.sub:
                self._read_live(e, now)
            else:
                self._read_reply(e, now)
        for e in list(self._engines.values()):
            self._send(e, e.feed.tick(now), now)
            self._stats[e.spec.name] = e.feed.stats()

    def _take_commands(self) -> None:
        while True:
            try:
                op, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self._add(arg)
            elif arg in self._engines:
                e = self._engines.pop(arg)
                self._close_socket(e, e.sub)
                if e.dealer is not None:
                    self._close_socket(e, e.dealer)
                self.index.remove_engine(arg)
                self._stats.pop(arg, None)

    def _add(self, spec: EngineSpec) -> None:
        if spec.name in self._engines:
            log.warning("engine %s is subscribed to already", spec.name)
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_payload + 4096)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, spec.topic.encode())
        try:
            sub.connect(spec.endpoint)
        except zmq.ZMQError as e:
            sub.close(linger=0)
            log.error("engine %s: cannot connect to %s: %s", spec.name, spec.endpoint, e)
            return
        feed = EngineFeed(spec.name, self.index,
                          silence_s=self.silence_s if spec.heartbeats else None,
                          request_timeout_s=self.request_timeout_s, max_payload=self.max_payload)
        e = _Engine(spec, feed, sub)
        self._engines[spec.name] = e
        self._by_socket[sub] = e
        self._poller.register(sub, zmq.POLLIN)
        self._stats[spec.name] = feed.stats()

    def _close_socket(self, e: _Engine, sock: zmq.Socket) -> None:
        """The one way a registered socket goes: out of the poller, then closed, once."""
        if sock is e.dealer:
            e.dealer = None
        if self._by_socket.pop(sock, None) is None:
            return  # not registered (so not ours to close again)
        self._poller.unregister(sock)
        sock.close(linger=0)

    def _read_live(self, e: _Engine, now: float) -> None:
        for _ in range(_BURST):
            try:
                parts = e.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = frames.parse_stream(parts)
            except EventFormatError:
                e.feed.on_bad()
                continue
            self._send(e, e.feed.on_live(msg, now), now)

    def _read_reply(self, e: _Engine, now: float) -> None:
        dealer = e.dealer
        for _ in range(_BURST):
            if dealer is None or e.dealer is not dealer:
                return  # closed for a new request meanwhile
            try:
                parts = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = frames.parse_reply(parts)
            except EventFormatError:
                e.feed.on_bad()
                continue
            if msg is None:
                # answered: this socket is done before the feed, which may ask again at once
                self._close_socket(e, dealer)
                self._send(e, e.feed.on_reply(None, now), now)
                return
            self._send(e, e.feed.on_reply(msg, now), now)

    def _send(self, e: _Engine, ask: Ask | None, now: float) -> None:
        if ask is None:
            return
        if e.dealer is not None:
            self._close_socket(e, e.dealer)  # abandoned: its late answers must not count
        if not e.spec.replay_endpoint:
            # no replay socket: an empty answer, so the feed follows the stream from here
            self._send(e, e.feed.on_reply(None, now), now)
            return
        try:
            request = (frames.snapshot_request() if ask.snapshot
                       else frames.replay_request(ask.start_seq))
        except ValueError as err:  # the feed's numbers are checked: a bug, not a peer
            log.warning("engine %s: request not sent: %s", e.spec.name, err)
            return
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.MAXMSGSIZE, self.max_payload + 4096)
        d.setsockopt(zmq.RCVHWM, 0)  # a snapshot arrives whole
        d.setsockopt(zmq.LINGER, 0)
        try:
            d.connect(e.spec.replay_endpoint)
            d.send_multipart(request, zmq.NOBLOCK)
        except zmq.ZMQError as err:
            d.close(linger=0)  # never registered: closed here, its only owner so far
            log.debug("engine %s: request not sent: %s", e.spec.name, err)
            return
        e.dealer = d
        self._by_socket[d] = e
        self._poller.register(d, zmq.POLLIN)
