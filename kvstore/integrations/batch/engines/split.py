"""Small operations on one thread, large kernels on all, in the engine's small forwards.

With OpenMP threads that sleep while they wait (:mod:`.threads`), every parallel region
wakes them first: an element-wise operation on a decode step's ``[64, 768]`` (RMSNorm's
six, rotary, the residual adds, the K/V writes and gathers) took 57-63 us on 2 threads and
5 us on one (2-core machine, idle, float32). A decode step runs ~25 such operations per
layer and ~8 large kernels (the linear layers, the attention). Within :func:`small_ops`
torch runs on one thread, and the large kernels go through :func:`wide`, which gives them
the run's threads for the call (``torch.set_num_threads`` is an ICV write: 0.2 us a pair).
No thread spins, so a shared machine costs what it did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["small_ops", "wide", "wide_threads"]

T = TypeVar("T")

#: threads the large kernels get while :func:`small_ops` is active (0: not active)
_wide = 0


def wide_threads() -> int:
    """The threads :func:`wide` gives a kernel now (0: no split is active)."""
    return _wide


@contextlib.contextmanager
def small_ops(threads: int) -> Iterator[bool]:
    """Within the block torch runs on one thread, :func:`wide` calls on ``threads``; yields
    whether the split is on (not for ``threads`` <= 1, nor nested)."""
    global _wide
    if threads <= 1 or _wide:
        yield False
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    _wide = threads
    try:
        yield True
    finally:
        _wide = 0
        torch.set_num_threads(before)


def wide(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on the run's threads (as it is outside :func:`small_ops`)."""
    n = _wide
    if not n:
        return fn(*args, **kwargs)
    torch.set_num_threads(n)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(1)
