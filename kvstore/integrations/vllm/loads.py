"""The direct path's loads, in the background (vLLM's ``load_kv_async``) or before the forward:
the loader threads that read them, the record of one in flight, and its deadline (a load
before the forward: the engine's thread waits for it until then, and abandons it as below).

A background load has until ``load_timeout`` seconds after it started (a
``kv_connector_extra_config`` key; default 30). Past it the worker reports
the request to vLLM as finished with every block a load error (vLLM recomputes them into the
same pages, or frees them for another request) and *abandons* the load. Nothing an abandoned
load does can reach vLLM's pages, because no background read writes them: it reads into
buffers of its own (:class:`AsyncLoad`: ``staged`` on the direct path, ``out`` on the
fetch path), and vLLM's pages are written only on the engine's thread, by the worker's
``_finish_async``, for a load it still holds; a load leaves the worker's table once, finished
or abandoned. A read stuck in the kernel (``preadv`` on a dead mount) cannot be cancelled;
when it returns it writes into the abandoned load's own buffer, which the abandoned record
keeps alive until then, and nothing copies it anywhere.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .metadata import BlockRun

__all__ = ["MAX_WEDGED", "AsyncLoad", "Loader", "Loaders", "StagingPool", "staged_pieces"]

log = logging.getLogger("vllm.kvstore")

#: loader threads left stuck in abandoned reads before the worker stops starting new ones
#: (later loads then queue behind the stuck one, and time out in turn)
MAX_WEDGED = 4

_Job = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class Loader:
    """One daemon thread running submitted calls in order (a stuck call never holds up the
    interpreter's exit, as a ``ThreadPoolExecutor``'s worker would)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # the thread holds the queue, not the loader: a loader dropped without stop() is
        # collected, and its finalizer ends the thread (as a ThreadPoolExecutor's would)
        self._thread = threading.Thread(target=_serve, args=(self._jobs,),
                                        name="kvstore-vllm-load", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._jobs.put, None)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        f: Future = Future()
        self._jobs.put((f, fn, args))
        return f

    def hand_over(self, to: Loader) -> None:
        """Move the calls not started yet to ``to`` and stop this loader's thread once its
        current call returns (if ever)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                to._jobs.put(job)
        self.stop()

    def stop(self) -> None:
        self._jobs.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """A loader's thread: run its calls in order until told to stop (None)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        f, fn, args = job
        if not f.set_running_or_notify_cancel():  # cancelled while queued
            continue
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # the caller's future carries it
            f.set_exception(e)
        del job, f, fn, args  # nothing of a finished call kept while waiting for the next


@dataclass(slots=True)
class AsyncLoad:
    """One request's background load: the request waits, not scheduled, until ``get_finished``
    reports it; its pages are its own until then (vLLM neither zeroes nor caches them), and
    written only when the worker completes it on the engine's thread."""

    run: BlockRun
    deadline: float  # time.monotonic() past which it is abandoned
    future: Future | None = None  # direct path: -> (loaded, pinned keys, (position, slot)s)
    staged: torch.Tensor | None = None  # direct path: [>= planned, block bytes], disk reads fill
    transfer: Any = None  # fetch path: Transfer -> the fetched blocks
    out: torch.Tensor | None = None  # fetch path: this load's own staging rows
    ids: torch.Tensor | None = None  # fetch path: vLLM page ids, one per planned block

    def ready(self) -> bool:
        if self.future is not None:
            return self.future.done()
        return self.transfer is None or self.transfer.done()

    def late(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.deadline


class StagingPool:
    """The direct path's staging rows, reused: a fresh buffer is faulted in by the read that
    fills it (measured: 5x the read's time for 128 MiB), a reused one is not. Taken and
    given back on the engine's thread; an abandoned load's rows are never given back. Keeps
    at most ``keep`` free buffers and ``keep_bytes`` in all (the largest that fit)."""

    def __init__(self, row_nbytes: int, keep: int = 4, keep_bytes: int = 1 << 30) -> None:
        self.row_nbytes = row_nbytes
        self.keep = keep
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []

    def take(self, rows: int) -> torch.Tensor:
        """A ``[>= rows, row_nbytes]`` uint8 buffer: the smallest free one that fits, or new."""
        fits = [i for i, b in enumerate(self._free) if b.shape[0] >= rows]
        if fits:  # by index: == on tensors compares their elements
            return self._free.pop(min(fits, key=lambda i: self._free[i].shape[0]))
        return torch.empty((max(rows, 8), self.row_nbytes), dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)
        self._free.sort(key=lambda b: -b.shape[0])
        kept, total = [], 0
        for b in self._free:
            if len(kept) < self.keep and total + b.nbytes <= self.keep_bytes:
                kept.append(b)
                total += b.nbytes
        self._free = kept

    @property
    def free_bytes(self) -> int:
        return sum(b.nbytes for b in self._free)


def staged_pieces(staged: torch.Tensor, page_nbytes: int,
                  num_layers: int) -> Callable[[int], list[memoryview]]:
    """``into`` for ``lease_into``: block ``i``'s bytes go to row ``i`` of ``staged``
    (``[>= planned, block bytes]``, uint8), one piece per layer page, as they would into vLLM's
    pages (:class:`~kvstore.integrations.vllm.pages.PageBytes`)."""
    mv = memoryview(staged.numpy()).cast("B")
    row = staged.shape[1]

    def into(i: int) -> list[memoryview]:
        at = i * row
        return [mv[at + layer * page_nbytes: at + (layer + 1) * page_nbytes]
                for layer in range(num_layers)]

    return into


class Loaders:
    """The direct path's loader thread, and what abandoned loads leave behind: loader threads
    stuck in their reads, and the loads themselves until their reads return (their buffers
    stay referenced: a read that returns writes into memory still theirs)."""

    def __init__(self, release_lease: Callable[[Sequence[bytes]], None] | None) -> None:
        self._release_lease = release_lease  # gives back a late lease's pinned warm slots
        self._loader: Loader | None = None
        self._wedged: list[Loader] = []  # left stuck in an abandoned read
        self._abandoned: list[AsyncLoad] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._loader is None:
            self._loader = Loader()
        return self._loader.submit(fn, *args)

    def abandon(self, ld: AsyncLoad) -> None:
        """``ld`` is past its deadline (the caller no longer holds it). A load still queued is
        cancelled; one started has its lease given back when it returns, and its loader
        thread is left to it: loads queued behind move to a new one (while fewer than
        :data:`MAX_WEDGED` are stuck; then they wait, and time out in turn)."""
        f = ld.future
        if f is not None and not f.cancel():
            f.add_done_callback(self._release_late)
            if f.running() and self._loader is not None:
                self._wedged = [lo for lo in self._wedged if lo.alive]
                if len(self._wedged) < MAX_WEDGED:
                    old, self._loader = self._loader, Loader()
                    old.hand_over(self._loader)
                    self._wedged.append(old)
        self._abandoned.append(ld)
        self.prune()

    def prune(self) -> None:
        """Forget the abandoned loads whose reads have returned."""
        if self._abandoned:
            self._abandoned = [a for a in self._abandoned if not a.ready()]

    def _release_late(self, f: Future) -> None:
        """An abandoned load's lease came back after all (on its loader thread): give back
        the warm slots it pinned; nothing is copied."""
        if f.cancelled() or f.exception() is not None or self._release_lease is None:
            return
        pinned = f.result()[1]
        if pinned:
            try:
                self._release_lease(pinned)
            except Exception:  # a store closed meanwhile has no pins left to give back
                log.debug("kvstore: releasing an abandoned load's lease failed", exc_info=True)

    def stop(self) -> None:
        """At shutdown: the loader's thread ends once its queued calls are done; stuck ones
        are daemon threads, never waited for."""
        if self._loader is not None:
            self._loader.stop()
            self._loader = None
