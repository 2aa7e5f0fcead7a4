"""The copy engine: every data movement of the store, one queue per path.

Paths: ``h2d`` (anything written into the hot tier or a caller's output: fetches, promotions,
puts), ``d2h`` (hot -> warm demotion, staging for disk writes) and ``disk_read`` (disk ->
warm/host). Each path is a FIFO worker thread, so work on one path keeps submission order: a
fetch queued after a put of the same key copies after the put's bytes landed.

With CUDA, each path also owns a stream; a job enqueues its copies on the stream and
records one event per layer. The worker polls those events with ``event.query()`` (no host
callbacks crossing threads) and marks layers ready as they complete, while it already
starts the next job. Without CUDA the same queues run the copies synchronously on the worker
threads, which is what the tests exercise here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvstore.errors import StoreClosedError
from kvstore.transfer import Transfer

log = logging.getLogger("kvstore.copy_engine")

PATHS = ("h2d", "d2h", "disk_read")


@dataclass(slots=True)
class Job:
    """One unit of work on a path.

    ``run(stream)`` does (or enqueues) the copies and returns the per-layer CUDA events to
    wait for (empty when the copies already completed); ``finish(ok, error)`` runs on the
    worker once they have, and completes the transfer. ``finish`` also runs for a job
    cancelled at close, with ``ok=False``.
    """

    transfer: Transfer
    run: Callable[[torch.cuda.Stream | None], list[torch.cuda.Event]]
    finish: Callable[[bool, BaseException | None], None]
    events: list = field(default_factory=list)
    layers_done: int = 0


class _PathWorker:
    """A FIFO of jobs for one path, drained by one thread."""

    def __init__(self, name: str, stream: torch.cuda.Stream | None) -> None:
        self.name = name
        self.stream = stream
        self._cv = threading.Condition()
        self._queue: deque[Job] = deque()
        self._inflight: deque[Job] = deque()  # CUDA jobs whose events are pending
        self._closing = False
        self._cancel = False
        self._busy = False
        self.submitted = 0
        self.completed = 0
        self.failed = 0
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
                with torch.cuda.stream(self.stream):
                    job.events = job.run(self.stream)
            else:
                job.events = job.run(None)
        except BaseException as e:  # reported through the transfer
            self._complete(job, False, e)
            return
        if job.events:
            self._inflight.append(job)
        else:
            self._complete(job, True, None)

    def _poll(self, *, block: bool) -> None:
        """Advance in-flight CUDA jobs: mark finished layers, complete finished jobs."""
        while self._inflight:
            job = self._inflight[0]
            while job.layers_done < len(job.events) and job.events[job.layers_done].query():
                job.layers_done += 1
                job.transfer.set_layers_ready(job.layers_done)
            if job.layers_done < len(job.events):
                if not block:
                    return
                time.sleep(20e-6)  # the DMA is running; check again shortly
                continue
            self._inflight.popleft()
            self._complete(job, True, None)

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
    """The store's data mover: one :class:`_PathWorker` per path (and CUDA stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        use_cuda = device.type == "cuda" and torch.cuda.is_available()
        self.cuda = use_cuda
        self._workers = {
            p: _PathWorker(p, torch.cuda.Stream(device) if use_cuda else None) for p in PATHS
        }
        self._closed = False

    def stream(self, path: str) -> torch.cuda.Stream | None:
        return self._workers[path].stream

    def submit(self, path: str, job: Job) -> Transfer:
        self._workers[path].submit(job)
        return job.transfer

    def pending(self) -> int:
        return sum(w.pending for w in self._workers.values())

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
    layer: int | None, layer_nbytes: int, stream: torch.cuda.Stream | None,
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
                     src.shape[1], layer_nbytes, n, 4, stream.cuda_stream)  # 4: cudaMemcpyDefault
        return
    for d, s, n in runs:
        dst[d : d + n, lo:hi].copy_(src[s : s + n, lo:hi], non_blocking=stream is not None)


def layerwise_supported(stream: torch.cuda.Stream | None) -> bool:
    """Whether copies can be split per layer here (always on CPU; with CuPy on CUDA)."""
    return stream is None or _cupy_memcpy2d() is not None


def mark_layer_done(t: Transfer, stream: torch.cuda.Stream | None, layer: int, events: list) -> None:
    """Layer ``layer`` is copied (CPU: ready now) or queued (CUDA: record its event)."""
    if stream is None:
        t.set_layers_ready(layer + 1)
    else:
        ev = torch.cuda.Event()
        ev.record(stream)
        events.append(ev)
