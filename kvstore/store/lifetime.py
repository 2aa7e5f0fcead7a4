"""Stores left open when the interpreter exits are closed first: drained and flushed.

The copy engines and the write-behind run on daemon threads, which the interpreter stops
wherever they are at exit: without this, a script that ends after ``put`` and no ``close``
lost every unflushed block and died in ``std::terminate`` (a thread still inside torch),
and a fetch's background warm fill failed on the disk tier's already shut-down pool. The
hook runs where ``concurrent.futures`` shuts its own pools down (``threading``'s exit
callbacks, last registered first), so a store closes while its pools still take work. Only
stores opened by this process are closed: a forked child must not flush its parent's.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours)
import logging
import os
import threading
import weakref
from typing import Protocol

log = logging.getLogger("kvstore")


class Closable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[Closable] = weakref.WeakSet()


def track(store: Closable) -> None:
    """Close ``store`` at interpreter exit if it is still open then."""
    _open.add(store)


def untrack(store: Closable) -> None:
    _open.discard(store)


def close_open_stores() -> None:
    """Close every store this process opened and did not close (the exit hook)."""
    for store in list(_open):
        try:
            store.close()
        except Exception as e:  # exiting anyway: say what was not flushed, close the rest
            log.warning("closing a store at exit failed (%s: %s); blocks put since its last "
                        "flush() may be lost: call close() before exiting", type(e).__name__, e)
    _open.clear()


def _register() -> None:
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(close_open_stores)
    else:  # pragma: no cover - every CPython we support has it (3.9+)
        import atexit

        atexit.register(close_open_stores)
    os.register_at_fork(after_in_child=_open.clear)


_register()
