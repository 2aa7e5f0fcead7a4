"""Module forwards swapped for the duration of a run, and put back however it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["swapped_forwards"]


@contextlib.contextmanager
def swapped_forwards(swaps: Iterable[tuple[torch.nn.Module, Callable[[], Callable[..., Any]]]]
                     ) -> Iterator[int]:
    """Within the block each module runs the forward its factory makes (a module whose
    forward someone else swapped meanwhile is left alone); yields how many were swapped."""
    swapped = []
    try:
        for m, make in swaps:
            if "forward" not in m.__dict__:
                m.forward = make()  # type: ignore[method-assign]
                swapped.append(m)
        yield len(swapped)
    finally:
        for m in swapped:
            m.__dict__.pop("forward", None)
