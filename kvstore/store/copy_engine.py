"""The copy engine: every data movement of the store, one queue per path.

Paths: ``h2d`` (fetch outputs, promotions, scatters: everything a reader waits for), ``d2h``
(puts: a caller's tensor into the hot or warm tier; warm copies of direct disk reads) and
``disk_read`` (disk -> warm/host). Each path is a FIFO worker thread (and, on a device with
streams, a stream of its own), so work on one path keeps submission order; a fetch that needs
a put still copying waits for that put's transfer (``FetchPlan.deps``), so loads never queue
behind the last step's saves.

With streams (CUDA, or the recording fake of :mod:`kvstore.streams` in tests) a job enqueues
its copies on its path's stream, ordered against the caller by the rule written once in
:mod:`kvstore.streams`, and records one event per layer. The worker polls those events with
``event.query()`` (no host callbacks crossing threads) and marks layers ready as they
complete, while it already starts the next job. An event that raises (an asynchronous CUDA
error) or does not complete within ``copy_timeout_s`` fails its job and the jobs in flight
behind it on the same stream with a :class:`~kvstore.errors.TransferError`; the worker never
dies, so ``wait``/``drain`` always return. Without streams the same queues run the copies
synchronously on the worker threads.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvstore import streams as _streams
from kvstore.errors import StoreClosedError, TransferError
from kvstore.streams import Event, Stream, Streams
from kvstore.transfer import Transfer

log = logging.getLogger("kvstore.copy_engine")

PATHS = ("h2d", "d2h", "disk_read")


@dataclass(slots=True)
class Job:
    """One unit of work on a path.

    ``run(stream)`` does (or enqueues) the copies and returns the per-layer events to wait for
    (empty when the copies already completed); ``finish(ok, error)`` runs on the worker once
    they have, and completes the transfer. ``finish`` also runs for a job cancelled at close
    and for one whose copies failed on the device, with ``ok=False``.
    """

    transfer: Transfer
    run: Callable[[Stream | None], list[Event]]
    finish: Callable[[bool, BaseException | None], None]
    events: list = field(default_factory=list)
    layers_done: int = 0
    started: float = 0.0


class _PathWorker:
    """A FIFO of jobs for one path, drained by one thread that never dies."""

    def __init__(self, name: str, streams: Streams | None, *, copy_timeout_s: float) -> None:
        self.name = name
        self.streams = streams
        self.stream = streams.new_stream() if streams is not None else None
        self.copy_timeout_s = copy_timeout_s
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._inflight: deque[Job] = deque()  # jobs whose events are pending
        self._closing = False
        self._cancel = False
        self._busy = False
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.device_errors = 0
        self._thread = threading.Thread(target=self._loop, name=f"kvstore-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise StoreClosedError("the store is closing; no new transfers are accepted")
            self._queue.append(job)
            self.submitted += 1
            self._cv.notify()

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._queue) + len(self._inflight)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._inflight and not self._closing:
                    self._cv.wait()
                if self._closing and not self._queue and not self._inflight:
                    return
                job = self._queue.popleft() if self._queue else None
                cancel = self._cancel
                self._busy = True
            try:
                if job is not None:
                    if cancel:
                        self._complete(job, False, StoreClosedError("the store was closed before this transfer ran"))
                    else:
                        self._start(job)
                self._poll(block=job is None)
            except BaseException:  # never let the worker die: waiters would hang forever
                log.exception("the %s copy worker hit an unexpected error; failing its jobs", self.name)
                with contextlib.suppress(BaseException):
                    self._fail_inflight(TransferError(f"the {self.name} copy worker failed"))
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued, running or in flight on this path."""
        with self._cv:
            return self._cv.wait_for(
                lambda: not (self._queue or self._inflight or self._busy) or not self._thread.is_alive(),
                timeout,
            )

    def _start(self, job: Job) -> None:
        try:
            if self.stream is not None:
                assert self.streams is not None
                with self.streams.use(self.stream):
                    job.events = job.run(self.stream)
            else:
                job.events = job.run(None)
        except BaseException as e:  # reported through the transfer
            self._complete(job, False, e)
            return
        # the bound counts from the copies being queued, not from what run waited for first
        # (a fetch waits up to the bound for a put still copying: FetchPlan.deps)
        job.started = time.monotonic()
        if job.events:
            self._inflight.append(job)
        else:
            self._complete(job, True, None)

    def _poll(self, *, block: bool) -> None:
        """Advance in-flight jobs: mark finished layers, complete finished jobs; fail a job
        whose event raises or outlives ``copy_timeout_s``, with every job behind it."""
        delay = 20e-6
        while self._inflight:
            job = self._inflight[0]
            try:
                while job.layers_done < len(job.events) and job.events[job.layers_done].query():
                    job.layers_done += 1
                    job.transfer.set_layers_ready(job.layers_done)
            except Exception as e:  # an asynchronous device error: fail, keep running
                self.device_errors += 1
                log.error("a copy on the %s path failed on the device: %s: %s", self.name,
                          type(e).__name__, e)
                self._fail_inflight(TransferError(
                    f"a copy on the {self.name} path failed on the device ({type(e).__name__}: "
                    f"{e}); its blocks were not served or stored. Run tools/gpu_check.py (or "
                    "set CUDA_LAUNCH_BLOCKING=1) to find the faulting copy"))
                continue
            if job.layers_done < len(job.events):
                if time.monotonic() - job.started > self.copy_timeout_s:
                    self.device_errors += 1
                    log.error("a copy on the %s path did not complete in %.0f s", self.name,
                              self.copy_timeout_s)
                    self._fail_inflight(TransferError(
                        f"a copy on the {self.name} path did not complete within "
                        f"{self.copy_timeout_s:.0f} s: the device is hung or overloaded "
                        "(check nvidia-smi); its blocks were not served or stored"))
                    continue
                if not block:
                    return
                time.sleep(delay)  # the DMA is running; check again shortly
                delay = min(delay * 2, 1e-3)
                continue
            self._inflight.popleft()
            self._complete(job, True, None)
            if self._inflight:  # the stream runs it from now on: its bound starts now
                nxt = self._inflight[0]
                nxt.started = max(nxt.started, time.monotonic())

    def _fail_inflight(self, error: BaseException) -> None:
        """Fail every in-flight job, the oldest first: the copies behind a failed one on the
        same stream are queued after it and are no better (jobs not started yet run)."""
        while self._inflight:
            self._complete(self._inflight.popleft(), False, error)

    def _complete(self, job: Job, ok: bool, error: BaseException | None) -> None:
        try:
            job.finish(ok, error)
        except BaseException as e:
            log.exception("finishing a %s transfer failed", self.name)
            if not job.transfer.done():
                job.transfer.set_error(e)
        if not job.transfer.done():  # finish must complete it; never leave a waiter hanging
            job.transfer.set_error(error or RuntimeError("transfer finished without a result"))
        if ok:
            self.completed += 1
        else:
            self.failed += 1

    def close(self, *, cancel: bool) -> None:
        with self._cv:
            self._closing = True
            self._cancel = cancel
            self._cv.notify_all()
        self._thread.join()


class CopyEngine:
    """The store's data mover: one :class:`_PathWorker` per path (and stream).

    ``streams``: the device's streams (default: :func:`kvstore.streams.streams_for`, CUDA
    streams on a CUDA device, none on the CPU); tests pass the recording fake."""

    def __init__(self, device: torch.device, *, streams: Streams | None = None,
                 copy_timeout_s: float | None = None) -> None:
        self.device = device
        self.streams = streams if streams is not None else _streams.streams_for(device)
        if copy_timeout_s is None:
            copy_timeout_s = _streams.COPY_TIMEOUT_S
        self.cuda = device.type == "cuda" and self.streams is not None
        self._workers = {
            p: _PathWorker(p, self.streams, copy_timeout_s=copy_timeout_s) for p in PATHS
        }
        self._closed = False
        self._foreground = 0  # caller-thread reads in flight (foreground())
        self._fg_lock = threading.Lock()

    @property
    def asynchronous(self) -> bool:
        """Copies complete through events (a device with streams), not on return."""
        return self.streams is not None

    def stream(self, path: str) -> Stream | None:
        return self._workers[path].stream

    def submit(self, path: str, job: Job) -> Transfer:
        self._workers[path].submit(job)
        return job.transfer

    def pending(self) -> int:
        return sum(w.pending for w in self._workers.values())

    def busy(self) -> bool:
        """Whether a copy is queued or running on any path, or a caller's thread reads for a
        fetch (:meth:`foreground`). Read without the workers' locks: a hint for background
        work that stands aside (the warm slab's prefault), not a barrier."""
        if self._foreground:
            return True
        return any(w._queue or w._inflight or w._busy for w in self._workers.values())

    @contextlib.contextmanager
    def foreground(self) -> Iterator[None]:
        """Mark I/O a caller runs on its own thread (not a job) as in flight for :meth:`busy`."""
        with self._fg_lock:
            self._foreground += 1
        try:
            yield
        finally:
            with self._fg_lock:
                self._foreground -= 1

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every path is idle (jobs may hand work on: loop until all are)."""
        import time as _time

        deadline = None if timeout is None else _time.monotonic() + timeout
        while True:
            for p in ("disk_read", "h2d", "d2h"):
                left = None if deadline is None else max(0.0, deadline - _time.monotonic())
                if not self._workers[p].wait_idle(left):
                    return False
            if all(w.pending == 0 and not w._busy for w in self._workers.values()):
                return True

    def counters(self) -> dict[str, tuple[int, int, int]]:
        """Per path: (submitted, completed, failed)."""
        return {p: (w.submitted, w.completed, w.failed) for p, w in self._workers.items()}

    def device_errors(self) -> int:
        """Copies that failed on the device (an event raised, or did not complete in time)."""
        return sum(w.device_errors for w in self._workers.values())

    def close(self, *, cancel: bool = False) -> None:
        """Stop the workers: queued jobs run (or, with ``cancel``, fail with StoreClosedError)."""
        if self._closed:
            return
        self._closed = True
        # disk reads hand their blocks on to h2d: stop them first
        for p in ("disk_read", "h2d", "d2h"):
            self._workers[p].close(cancel=cancel)



def _cupy_memcpy2d():
    try:
        import cupy

        return cupy.cuda.runtime.memcpy2DAsync
    except (ImportError, AttributeError):
        return None


def copy_block_runs(
    dst: torch.Tensor, src: torch.Tensor, runs: list[tuple[int, int, int]], *,
    layer: int | None, layer_nbytes: int, stream: Stream | None,
) -> None:
    """Copy rows of ``src`` (``[rows, block_nbytes]`` uint8) into rows of ``dst``.

    ``runs`` holds ``(dst_row, src_row, length)``. With ``layer`` set, only that layer's
    ``layer_nbytes`` slice of each block moves: a strided copy, done as one
    ``cudaMemcpy2DAsync`` per run on CUDA (through CuPy) or a strided ``copy_`` on the CPU.
    """
    block = dst.shape[1]
    if layer is None:
        for d, s, n in runs:
            dst[d : d + n].copy_(src[s : s + n], non_blocking=stream is not None)
        return
    lo, hi = layer * layer_nbytes, (layer + 1) * layer_nbytes
    if stream is not None and (dst.is_cuda or src.is_cuda):
        memcpy2d = _cupy_memcpy2d()
        if memcpy2d is None:
            raise RuntimeError("layer-wise CUDA copies need CuPy")
        for d, s, n in runs:
            memcpy2d(dst.data_ptr() + d * block + lo, block, src.data_ptr() + s * src.shape[1] + lo,
                     src.shape[1], layer_nbytes, n, 4,
                     stream.cuda_stream)  # type: ignore[attr-defined]  # 4: cudaMemcpyDefault
        return
    for d, s, n in runs:
        dst[d : d + n, lo:hi].copy_(src[s : s + n, lo:hi], non_blocking=stream is not None)


def layerwise_supported(*tensors: torch.Tensor) -> bool:
    """Whether copies between ``tensors`` can be split per layer here (always between host
    tensors; with CuPy when one is on a CUDA device)."""
    return not any(t.is_cuda for t in tensors) or _cupy_memcpy2d() is not None


def mark_layer_done(t: Transfer, stream: Stream | None, layer: int, events: list) -> None:
    """Layer ``layer`` is copied (no stream: ready now) or queued (record its event)."""
    if stream is None:
        t.set_layers_ready(layer + 1)
    else:
        events.append(stream.record_event())


def copy_done(stream: Stream | None) -> list[Event]:
    """The events a job returns once its copies are enqueued: one on ``stream`` (none
    without a stream: the copies already completed)."""
    return [] if stream is None else [stream.record_event()]
