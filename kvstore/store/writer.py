"""A background thread that drains work in batches, with a ``flush()`` that waits for it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvstore.writer")


class WriteBehind:
    """Runs ``work()`` on a thread until it returns False, each time it is notified.

    ``work`` processes one batch and returns True when more may be pending. ``flush()``
    returns once a pass that started after the call found nothing left to do or, with a
    ``ticket`` (the owner's progress mark when the call began), once the owner reports
    :meth:`reached` that mark: under puts that never pause, no pass finds nothing to do.
    """

    def __init__(self, work: Callable[[], bool], name: str) -> None:
        self._work = work
        self._cv = threading.Condition()
        self._wanted = 0  # bumped by notify/flush
        self._idle_at = 0  # value of _wanted when the worker last found nothing to do
        self._reached = 0  # the owner's progress: every ticket up to it is done
        self._tickets: list[int] = []  # tickets of flushes waiting
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def notify(self) -> None:
        with self._cv:
            self._wanted += 1
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._idle_at == self._wanted and not self._stop:
                    self._cv.wait()
                if self._stop and self._idle_at == self._wanted:
                    return
                seen = self._wanted
            try:
                more = self._work()
            except Exception:  # the work reports its own failures; never let the thread die
                log.exception("background writer pass failed")
                more = False
            if not more:
                with self._cv:
                    self._idle_at = seen
                    self._cv.notify_all()

    def flush(self, timeout: float | None = None, ticket: int | None = None) -> bool:
        """Wait until everything notified before this call is processed (or the owner has
        :meth:`reached` ``ticket``); False on timeout."""
        with self._cv:
            if not self._thread.is_alive():
                return True
            self._wanted += 1
            target = self._wanted
            if ticket is not None:
                self._tickets.append(ticket)
            self._cv.notify_all()
            try:
                return self._cv.wait_for(
                    lambda: self._idle_at >= target or not self._thread.is_alive()
                    or (ticket is not None and self._reached >= ticket), timeout)
            finally:
                if ticket is not None:
                    self._tickets.remove(ticket)

    def waiting(self) -> int | None:
        """The smallest ticket a flush waits for (None: no flush waits on one)."""
        with self._cv:
            return min(self._tickets, default=None)

    def reached(self, mark: int) -> None:
        """The owner: the work of every ticket up to ``mark`` is done."""
        with self._cv:
            if mark > self._reached:
                self._reached = mark
                self._cv.notify_all()

    def close(self) -> None:
        """Finish pending work, then stop the thread."""
        with self._cv:
            self._stop = True
            self._wanted += 1
            self._cv.notify_all()
        self._thread.join()
