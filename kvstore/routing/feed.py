"""``EngineFeed``: one publisher's stream into the index, kept in step by sequence numbers.

A state machine with no sockets (the subscriber owns those): it is handed live messages,
replay/snapshot replies and the clock, applies what is in order, and says when to ask the
publisher for a replay or a snapshot (:class:`Ask`).

- First contact, or after falling silent: ask for a **snapshot** (the state "after batch S"),
  apply it over an emptied entry, then the live batches after S.
- A sequence number other than the next one (a lost batch, a garbled one, a restarted
  publisher) is a **gap**: ask for a **replay** from the expected number; it is taken only if
  it continues the stream exactly, else a snapshot is asked for. A restarted kvstore publisher
  numbers from its start time, so its batches never pass for the old one's.
- A publisher without snapshots (vLLM's answers the request with an empty reply) is followed
  from what arrives, its entry emptied first.
- Nothing heard for ``silence_s`` (kvstore publishers send a heartbeat every second): the
  engine **falls out** (its entry is emptied) until it is heard again and resynced.

Sequence numbers wrap to 0 after ``2**64 - 2`` and are compared the shorter way round
(:func:`~kvstore.events.frames.seq_diff`): a snapshot at ``2**64 - 2`` continues with batch 0.

Malformed messages (a number out of range or not an int, a payload that is not a batch) are
counted and never raised: the worst they cause is a resync.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from kvstore.events.codec import DEFAULT_MAX_PAYLOAD, EventFormatError, decode_batch
from kvstore.events.frames import StreamMessage, next_seq, seq_diff, valid_seq
from kvstore.routing.index import PrefixIndex

log = logging.getLogger("kvstore.routing")

NEW, LIVE, SYNCING, SILENT = "new", "live", "syncing", "silent"


@dataclass(frozen=True, slots=True)
class Ask:
    """A request for the publisher's replay socket."""

    snapshot: bool
    start_seq: int = 0


@dataclass(frozen=True, slots=True)
class FeedStats:
    engine: str
    state: str
    expected: int | None  # next sequence number, when live
    batches: int  # applied
    bad_messages: int
    gaps: int
    replays: int  # replays taken
    snapshots: int  # snapshots applied
    silences: int  # times the engine fell out
    snapshot_supported: bool


class EngineFeed:
    def __init__(self, name: str, index: PrefixIndex, *, silence_s: float | None = 5.0,
                 request_timeout_s: float = 5.0, max_pending: int = 100_000,
                 max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.name = name
        self.index = index
        self.silence_s = silence_s
        self.request_timeout_s = request_timeout_s
        self.max_pending = max_pending
        self.max_payload = max_payload
        self.state = NEW
        self.expected: int | None = None
        self.last_heard: float | None = None
        self._pending: deque[StreamMessage] = deque()
        self._overflow = False
        self._asked: Ask | None = None
        self._asked_at = 0.0
        self._reply: list[StreamMessage] = []
        self._failures = 0  # resync attempts in a row that did not end live
        self._retry_at = 0.0
        self.snapshot_supported = True
        self._n = {"batches": 0, "bad": 0, "gaps": 0, "replays": 0, "snapshots": 0,
                   "silences": 0}
        index.add_engine(name)

    # -- inputs --------------------------------------------------------------------------------
    def on_live(self, msg: StreamMessage, now: float) -> Ask | None:
        self.last_heard = now
        if not self._valid(msg):
            return None
        if self.state == LIVE:
            if self.expected is None:
                self.expected = msg.seq  # following a publisher without snapshots
            if msg.seq == self.expected and self._apply(msg):
                return None
            self._n["gaps"] += 1
            log.info("engine %s: batch %d where %d was expected (lost batches, or a restarted "
                     "publisher); resyncing", self.name, msg.seq, self.expected)
            self._pend(msg)
            return self._ask(Ask(False, self.expected), now)
        self._pend(msg)
        if self.state in (NEW, SILENT) or (self._asked is None and now >= self._retry_at):
            return self._ask(Ask(True), now)
        return None

    def on_reply(self, msg: StreamMessage | None, now: float) -> Ask | None:
        """A reply message (``None``: the end marker) to the request outstanding."""
        if self._asked is None:
            return None  # a late reply to a request given up on
        if msg is not None and not self._valid(msg):
            return None
        if msg is not None:
            if len(self._reply) < self.max_pending:
                self._reply.append(msg)
            return None
        asked, reply = self._asked, self._reply
        self._asked, self._reply = None, []
        ok = self._finish_snapshot(reply) if asked.snapshot else self._finish_replay(reply)
        if not ok:
            return self._failed(now)
        return self._drain(now)

    def on_bad(self) -> None:
        """A message that was not even framed right (nothing to learn from it but that)."""
        self._n["bad"] += 1

    def tick(self, now: float) -> Ask | None:
        """Time passes: requests time out, silent engines fall out, retries come due."""
        if self._asked is not None and now - self._asked_at > self.request_timeout_s:
            log.info("engine %s: no answer to a %s request; retrying", self.name,
                     "snapshot" if self._asked.snapshot else "replay")
            self._asked, self._reply = None, []
            return self._failed(now)
        if (self.silence_s is not None and self.state != SILENT and self.last_heard is not None
                and now - self.last_heard > self.silence_s):
            log.warning("engine %s: silent for %.1f s; it falls out of the index", self.name,
                        now - self.last_heard)
            self._n["silences"] += 1
            self.index.clear(self.name)
            self.state, self.expected = SILENT, None
            self._asked, self._reply = None, []
            self._pending.clear()
            return None
        if self.state == SYNCING and self._asked is None and now >= self._retry_at:
            return self._ask(Ask(True), now)
        return None

    @property
    def waiting(self) -> bool:
        """A request is outstanding (its socket must not be reused for another)."""
        return self._asked is not None

    def stats(self) -> FeedStats:
        n = self._n
        return FeedStats(self.name, self.state, self.expected, n["batches"], n["bad"],
                         n["gaps"], n["replays"], n["snapshots"], n["silences"],
                         self.snapshot_supported)

    # -- internals -----------------------------------------------------------------------------
    def _valid(self, msg: StreamMessage) -> bool:
        if valid_seq(msg.seq) and type(msg.payload) is bytes:
            return True
        self._n["bad"] += 1
        log.debug("engine %s: a message numbered %r dropped", self.name, msg.seq)
        return False

    def _pend(self, msg: StreamMessage) -> None:
        if len(self._pending) >= self.max_pending:
            self._pending.clear()
            self._overflow = True  # the replay/snapshot can no longer be joined to it
        self._pending.append(msg)

    def _ask(self, ask: Ask, now: float) -> Ask | None:
        if self._asked is not None:
            return None
        if ask.snapshot and not self.snapshot_supported:
            self.index.clear(self.name)
            self.state, self.expected = LIVE, None
            return self._drain(now)
        self.state = SYNCING
        self._asked, self._asked_at, self._reply = ask, now, []
        return ask

    def _failed(self, now: float) -> Ask | None:
        if self.snapshot_supported:
            # a snapshot comes next, the state after everything published before it is asked
            # for, so it covers whatever waits here. Kept, a message numbered ahead of what the
            # publisher has (a garbled number, an earlier publisher's) was a gap after every
            # snapshot, its replay came back empty, a snapshot again: a request loop, no end
            self._pending.clear()
            self._overflow = False
        self._failures += 1
        self._retry_at = now + min(5.0, 0.05 * 2 ** min(self._failures, 7))
        self.state = SYNCING
        if self._failures == 1:  # the first miss is usually a replay that came up short
            return self._ask(Ask(True), now)
        return None  # tick() asks again once the back-off is over

    def _decode(self, msg: StreamMessage):
        try:
            return decode_batch(msg.payload, self.max_payload)
        except EventFormatError as e:
            self._n["bad"] += 1
            log.debug("engine %s: bad batch %d: %s", self.name, msg.seq, e)
            return None

    def _apply(self, msg: StreamMessage) -> bool:
        batch = self._decode(msg)
        if batch is None:
            return False
        self.index.apply(self.name, batch.events)
        self._n["batches"] += 1
        self.expected = next_seq(msg.seq)
        return True

    def _finish_replay(self, reply: list[StreamMessage]) -> bool:
        if not reply or reply[0].seq != self.expected:
            return False  # that history is gone (or belongs to another publisher)
        batches = [self._decode(m) for m in reply]
        if any(b is None for b in batches) or any(
                m.seq != next_seq(p.seq) for p, m in zip(reply, reply[1:], strict=False)):
            return False
        for b in batches:
            self.index.apply(self.name, b.events)  # type: ignore[union-attr]
            self._n["batches"] += 1
        self.expected = next_seq(reply[-1].seq)
        self._n["replays"] += 1
        return True

    def _finish_snapshot(self, reply: list[StreamMessage]) -> bool:
        if not reply:
            log.info("engine %s: its publisher has no snapshots; following it from now on",
                     self.name)
            self.snapshot_supported = False
            self.index.clear(self.name)
            self.expected = None
            return True
        seq = reply[0].seq
        batches = [self._decode(m) for m in reply]
        if any(b is None for b in batches) or any(m.seq != seq for m in reply):
            return False
        self.index.clear(self.name)
        for b in batches:
            self.index.apply(self.name, b.events)  # type: ignore[union-attr]
        self._n["snapshots"] += 1
        self.expected = next_seq(seq)
        log.info("engine %s: resynced from its publisher's snapshot (after batch %d)",
                 self.name, seq)
        return True

    def _drain(self, now: float) -> Ask | None:
        """Live again: apply what arrived meanwhile (what the replay or snapshot covers is
        skipped); a hole in it is a gap like any other."""
        if self._overflow:
            self._overflow = False
            self._pending.clear()
            return self._failed(now)
        self.state, self._failures = LIVE, 0
        while self._pending:
            msg = self._pending[0]
            if self.expected is None:
                self.expected = msg.seq  # following a publisher without snapshots
            if seq_diff(msg.seq, self.expected) < 0:
                self._pending.popleft()  # covered by the replay or the snapshot
                continue
            if msg.seq == self.expected:
                self._pending.popleft()
                if self._apply(msg):
                    continue
            self._n["gaps"] += 1
            return self._ask(Ask(False, self.expected), now)
        return None
