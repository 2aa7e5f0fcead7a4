"""``Transfer``: the future every asynchronous store operation returns."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from kvstore.errors import TransferError

T = TypeVar("T")


class Transfer(Generic[T]):
    """A copy in flight. ``wait()`` returns its result; ``wait_layer(i)`` returns once layer
    ``i`` of every block has landed, so an engine can start layer 0 while later layers load.

    A fetch's result is a tensor ``[n, L, P, T, H, D]`` where ``n`` may be smaller than the
    number of keys asked for (misses and damaged blocks end the run); a put's result is the
    number of blocks stored; a ``load_into``'s the number of blocks loaded.
    """

    __slots__ = ("_cond", "_done", "_result", "_error", "_layers_ready", "_num_layers")

    def __init__(self, num_layers: int = 1) -> None:
        self._cond = threading.Condition()
        self._done = False
        self._result: T | None = None
        self._error: BaseException | None = None
        self._layers_ready = 0
        self._num_layers = num_layers

    @classmethod
    def completed(cls, result: T, num_layers: int = 1) -> Transfer[T]:
        t: Transfer[T] = cls(num_layers)
        t.set_result(result)
        return t

    # -- consumer side -------------------------------------------------------------------
    def done(self) -> bool:
        """True once the transfer finished (successfully or not)."""
        return self._done

    def wait(self, timeout: float | None = None) -> T:
        """Block until done and return the result; raises ``TransferError`` if it failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"transfer not done after {timeout} s")
        if self._error is not None:
            raise TransferError(f"transfer failed: {self._error}") from self._error
        return self._result  # type: ignore[return-value]

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` of every block is in place."""
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self._num_layers})")
        with self._cond:
            ok = self._cond.wait_for(lambda: self._done or self._layers_ready > layer, timeout)
        if not ok:
            raise TimeoutError(f"layer {layer} not ready after {timeout} s")
        if self._error is not None:
            raise TransferError(f"transfer failed: {self._error}") from self._error

    def result(self, timeout: float | None = None) -> T:
        """Alias of :meth:`wait` (``concurrent.futures`` spelling)."""
        return self.wait(timeout)

    def exception(self) -> BaseException | None:
        return self._error

    # -- producer side -------------------------------------------------------------------
    def set_layers_ready(self, count: int) -> None:
        with self._cond:
            self._layers_ready = max(self._layers_ready, count)
            self._cond.notify_all()

    def set_result(self, result: T) -> None:
        with self._cond:
            self._result = result
            self._layers_ready = self._num_layers
            self._done = True
            self._cond.notify_all()

    def set_error(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._done = True
            self._cond.notify_all()

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "pending")
        return f"<Transfer {state}>"
