"""Stores left open when the interpreter exits are closed first: drained and flushed.

The copy engines and the write-behind run on daemon threads, which the interpreter stops
wherever they are at exit: without this, a script that ends after ``put`` and no ``close``
lost every unflushed block and died in ``std::terminate`` (a thread still inside torch),
and a fetch's background warm fill failed on the disk tier's already shut-down pool. The
hook runs where ``concurrent.futures`` shuts its own pools down (``threading``'s exit
callbacks, last registered first), so a store closes while its pools still take work. Only
stores opened by this process are closed: a forked child must not flush its parent's.

Closing is bounded: every store left open starts closing at once and all of them get
:data:`EXIT_CLOSE_TIMEOUT_S` together (a store whose disk writer waits for another process's
index lock, e.g. an engine stopped with SIGSTOP, is logged and left, not waited for: exit
never hangs on it). :func:`close_stores` is the same for a caller's own list (the daemon's
shutdown).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours)
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Protocol

log = logging.getLogger("kvstore")

#: how long the exit hook waits, all stores together, for the stores left open to close
EXIT_CLOSE_TIMEOUT_S = 30.0


class Closable(Protocol):
    def begin_close(self) -> threading.Event: ...

    def close(self, timeout: float | None = ...) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()


def track(store: Closable) -> None:
    """Close ``store`` at interpreter exit if it is still open then."""
    _open.add(store)


def untrack(store: Closable) -> None:
    _open.discard(store)


def close_stores(stores: Iterable[Closable], timeout: float | None) -> bool:
    """Close ``stores`` side by side within ``timeout`` seconds in all (None: no limit).
    Each failure (a close that raised, or did not finish in time) is logged, never raised;
    returns whether every store closed."""
    stores = list(stores)
    for store in stores:
        store.begin_close()  # all at once: N stuck stores cost one timeout, not N
    deadline = None if timeout is None else time.monotonic() + timeout
    ok = True
    for store in stores:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            store.close(timeout=left)
        except Exception as e:  # say what was not flushed, close the rest
            ok = False
            log.error("closing a store failed (%s: %s)", type(e).__name__, e)
    return ok


def close_open_stores() -> None:
    """Close every store this process opened and did not close (the exit hook), within
    :data:`EXIT_CLOSE_TIMEOUT_S` in all."""
    stores = list(_open)
    _open.clear()
    if not close_stores(stores, EXIT_CLOSE_TIMEOUT_S):
        log.warning("exiting with a store not closed: blocks put since its last flush() may "
                    "be lost; call close() (and flush()) before exiting")


def _register() -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(close_open_stores)
    else:  # pragma: no cover - every CPython we support has it (3.9+)
        import atexit

        atexit.register(close_open_stores)
    os.register_at_fork(after_in_child=_open.clear)


_register()
