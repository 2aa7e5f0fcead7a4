"""Streams and events: the one ordering rule of every asynchronous copy, and its seam.

**The rule** (the only place it is written; docs/architecture.md "Stream ordering"):

1. *Producer side.* A copy never reads or writes a caller's tensor before the work the caller
   queued on it: at submit time, on the caller's thread, :func:`handoff` records an event on
   the caller's current stream (after whatever produced ``kv``: a forward, ``save_from``'s
   gather; after whatever last used ``out``: the previous step's scatter, allocator reuse).
   The copy job's first act on its own stream is :func:`begin_copy`: the stream waits on that
   event, and the caller's tensors are handed to the copy stream (``record_stream``) so the
   caching allocator does not give their memory to anyone else while the copy runs. A host
   thread that touches such a tensor (a disk read into a pinned ``out``, the writer's overflow
   copy) waits on the event first (:func:`host_wait`).
2. *Consumer side.* A copy records one event per layer on its stream; a ``Transfer`` marks a
   layer ready only once the copy engine saw its event complete, so anything the caller queues
   after ``wait``/``wait_layer`` returns is ordered after the copy on every stream.
3. *Bounds.* Every host wait on an event is bounded (:data:`COPY_TIMEOUT_S`); a copy that
   does not complete in time, or whose event raises (an asynchronous CUDA error), fails its
   transfer with a :class:`~kvstore.errors.TransferError`.

**The seam.** :class:`Stream`, :class:`Event` and :class:`Streams` are the few operations the
rule needs. :class:`CudaStreams` is torch's CUDA implementation (``torch.cuda.Stream`` and
``torch.cuda.Event`` satisfy the protocols as they are); :class:`RecordingStreams` is a CPU
fake that runs every copy synchronously but keeps a vector clock per stream and checks each
declared access (:meth:`Streams.access`) against it, so the tests assert on the CPU that
every wait happens before every read (``violations``), and can make events fail or hang.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvstore.errors import TransferError

#: the longest any host thread waits on one copy's event before failing it
COPY_TIMEOUT_S = 120.0


class Event(Protocol):
    """A point in a stream (``torch.cuda.Event``)."""

    def record(self, stream: Stream) -> None: ...

    def query(self) -> bool: ...


class Stream(Protocol):
    """An ordered queue of device work (``torch.cuda.Stream``)."""

    def wait_event(self, event: Event) -> None: ...

    def record_event(self) -> Event: ...


class Streams(Protocol):
    """One device's streams: what the copy engine and the store's jobs need of it."""

    def new_stream(self) -> Stream: ...

    def current(self) -> Stream:
        """The calling thread's current stream on the device."""
        ...

    def event(self) -> Event: ...

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` current on this thread for the ``with`` block."""
        ...

    def hand_over(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor`` (allocated on another stream) is used by ``stream``: keep its memory
        from being reused before that stream is done with it (``record_stream``)."""
        ...

    def access(self, stream: Stream | None, *, reads: Iterable[torch.Tensor] = (),
               writes: Iterable[torch.Tensor] = ()) -> None:
        """Declare the tensors the next work on ``stream`` (None: the host) reads and writes.
        CUDA: nothing; the recording fake checks them against what the stream waited for."""
        ...


class CudaStreams:
    """:class:`Streams` on one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Stream:
        return torch.cuda.Stream(self.device)

    def current(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def event(self) -> Event:
        return torch.cuda.Event()

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def hand_over(self, tensor: torch.Tensor, stream: Stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)  # type: ignore[arg-type]

    def access(self, stream: Stream | None, *, reads: Iterable[torch.Tensor] = (),
               writes: Iterable[torch.Tensor] = ()) -> None:
        return None


def streams_for(device: torch.device) -> Streams | None:
    """The streams of ``device`` (None on the CPU: copies run synchronously there)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaStreams(device)
    return None


# -- the rule ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Handoff:
    """Where a copy job stands against the caller that submitted it: ``ready`` was recorded on
    the caller's stream after the work that produced (or last used) ``tensors``."""

    ready: Event | None = None
    tensors: tuple[torch.Tensor, ...] = ()


NO_HANDOFF = Handoff()


def handoff(streams: Streams | None, *tensors: torch.Tensor | None) -> Handoff:
    """On the caller's thread, at submit: mark what the copy must wait for (rule 1)."""
    if streams is None:
        return NO_HANDOFF
    ev = streams.event()
    ev.record(streams.current())
    return Handoff(ev, tuple(t for t in tensors if t is not None))


def begin_copy(streams: Streams | None, h: Handoff, stream: Stream | None) -> None:
    """On the copy's stream, before its first copy: wait for the caller, adopt its tensors."""
    if streams is None or stream is None or h.ready is None:
        return
    stream.wait_event(h.ready)
    for t in h.tensors:
        streams.hand_over(t, stream)


def host_wait(event: Event | None, timeout: float | None = None, what: str = "a copy") -> None:
    """Block this thread until ``event`` completed, at most ``timeout`` seconds (default
    :data:`COPY_TIMEOUT_S`; rule 3). Raises :class:`TransferError` when the device reports an
    error or does not finish."""
    if event is None:
        return
    if timeout is None:
        timeout = COPY_TIMEOUT_S
    deadline = time.monotonic() + timeout
    delay = 20e-6
    while True:
        try:
            if event.query():
                return
        except Exception as e:  # an asynchronous CUDA error surfaces here
            raise TransferError(
                f"{what} failed on the device ({type(e).__name__}: {e}); run with "
                "CUDA_LAUNCH_BLOCKING=1 or tools/gpu_check.py to find the faulting copy"
            ) from e
        if time.monotonic() >= deadline:
            raise TransferError(
                f"{what} did not complete within {timeout:.0f} s: the device is hung or "
                "overloaded (check nvidia-smi; a store opened with a longer copy_timeout_s "
                "waits longer)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


# -- the recording CPU fake ---------------------------------------------------------------------
_HOST = "host"


class FakeEvent:
    """An event of :class:`RecordingStreams`: complete once recorded, unless told to hang
    (``hang``) or to raise from ``query`` (``error``), as a faulting CUDA copy does."""

    def __init__(self, owner: RecordingStreams) -> None:
        self._owner = owner
        self.clock: dict[str, int] | None = None
        self.stream: str | None = None
        self.error: BaseException | None = None
        self.hang = False

    def record(self, stream: Stream) -> None:
        assert isinstance(stream, FakeStream)
        self._owner._record(self, stream)

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        if self.hang:
            return False
        if self.clock is not None:
            self._owner._observed(self.clock)
        return True

    def synchronize(self) -> None:
        host_wait(self, 5.0)


class FakeStream:
    """A stream of :class:`RecordingStreams` (a name and a vector clock)."""

    def __init__(self, owner: RecordingStreams, name: str) -> None:
        self._owner = owner
        self.name = name
        self.clock: dict[str, int] = {name: 0}

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, FakeEvent)
        self._owner._wait(self, event)

    def record_event(self) -> Event:
        ev = self._owner.event()
        ev.record(self)
        return ev

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


@dataclass(slots=True)
class _Access:
    lo: int
    hi: int
    stream: str
    tick: int
    write: bool
    what: str = ""


@dataclass(slots=True)
class RecordingStreams:
    """A CPU :class:`Streams` that checks the ordering rule (a happens-before race detector).

    Copies run synchronously (the tensors are CPU tensors), but each stream keeps a vector
    clock: ``wait_event`` merges the event's clock into the stream's, an event seen complete
    by a host thread (``query``) merges into the host's, and work enqueued from the host
    inherits what the host has seen. Every declared access (:meth:`access`) is checked against
    the last conflicting accesses of the same bytes on other streams: a read (or write) whose
    stream has not waited for them is appended to ``violations``. ``log`` lists every
    operation in order, for tests that assert on the sequence. ``fail_after(n, error)`` /
    ``hang_after(n)`` make the events recorded from the ``n``-th on raise or never complete.
    """

    violations: list[str] = field(default_factory=list)
    log: list[tuple[str, ...]] = field(default_factory=list)
    handed: list[tuple[int, str]] = field(default_factory=list)
    _host: dict[str, int] = field(default_factory=dict)
    _streams: list[FakeStream] = field(default_factory=list)
    _accesses: list[_Access] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _local: threading.local = field(default_factory=threading.local)
    _default: FakeStream | None = None
    _events: int = 0
    _fail_from: int | None = None
    _fail_error: BaseException | None = None
    _hang_from: int | None = None

    def __post_init__(self) -> None:
        self._default = self.new_stream("default")  # type: ignore[assignment]

    # -- Streams ------------------------------------------------------------------------
    def new_stream(self, name: str | None = None) -> FakeStream:  # type: ignore[override]
        with self._lock:
            s = FakeStream(self, name or f"s{len(self._streams)}")
            self._streams.append(s)
            return s

    def current(self) -> FakeStream:  # type: ignore[override]
        s = getattr(self._local, "stream", None)
        return s if s is not None else self._default  # type: ignore[return-value]

    def event(self) -> FakeEvent:  # type: ignore[override]
        return FakeEvent(self)

    @contextlib.contextmanager
    def use(self, stream: Stream) -> Iterator[None]:  # type: ignore[override]
        prev = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = prev

    def hand_over(self, tensor: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, FakeStream)
        with self._lock:
            self.handed.append((tensor.data_ptr(), stream.name))
            self.log.append(("hand_over", stream.name))

    def access(self, stream: Stream | None, *, reads: Iterable[torch.Tensor] = (),
               writes: Iterable[torch.Tensor] = (), what: str = "") -> None:
        with self._lock:
            name, clock = self._clock_of(stream)
            clock[name] = clock.get(name, 0) + 1
            tick = clock[name]
            for t, w in [(t, False) for t in reads] + [(t, True) for t in writes]:
                lo, hi = _span(t)
                if lo == hi:
                    continue
                for a in self._accesses:
                    if a.stream == name or a.hi <= lo or hi <= a.lo or not (w or a.write):
                        continue
                    if clock.get(a.stream, 0) < a.tick:
                        self.violations.append(
                            f"{'write' if w else 'read'} on {name} {what} does not wait for the "
                            f"{'write' if a.write else 'read'} on {a.stream} {a.what}".replace("  ", " "))
                self._accesses.append(_Access(lo, hi, name, tick, w, what))
            self.log.append(("access", name, what))

    # -- failure injection ----------------------------------------------------------------
    def fail_after(self, n: int, error: BaseException) -> None:
        """Events recorded from now, after ``n`` more, raise ``error`` from ``query``."""
        with self._lock:
            self._fail_from, self._fail_error = self._events + n, error

    def hang_after(self, n: int) -> None:
        with self._lock:
            self._hang_from = self._events + n

    def heal(self) -> None:
        with self._lock:
            self._fail_from = self._hang_from = None

    # -- internals ------------------------------------------------------------------------
    def _clock_of(self, stream: Stream | None) -> tuple[str, dict[str, int]]:
        if stream is None:
            return _HOST, self._host
        assert isinstance(stream, FakeStream)
        _merge(stream.clock, self._host)  # enqueued from a host that has seen these
        return stream.name, stream.clock

    def _record(self, ev: FakeEvent, stream: FakeStream) -> None:
        with self._lock:
            _merge(stream.clock, self._host)
            ev.clock = dict(stream.clock)
            ev.stream = stream.name
            self._events += 1
            if self._fail_from is not None and self._events > self._fail_from:
                ev.error = self._fail_error
            if self._hang_from is not None and self._events > self._hang_from:
                ev.hang = True
            self.log.append(("record", stream.name))

    def _wait(self, stream: FakeStream, ev: FakeEvent) -> None:
        with self._lock:
            if ev.clock is not None:
                _merge(stream.clock, ev.clock)
            self.log.append(("wait", stream.name, ev.stream or "?"))

    def _observed(self, clock: dict[str, int]) -> None:
        with self._lock:
            _merge(self._host, clock)


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch: from its first element to its last."""
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    lo = t.data_ptr()
    return lo, lo + extent * t.element_size()
