"""``Every``: let a repeated warning through at most once per interval.

A failure that hits every block or every call (a process out of file descriptors, an index
that cannot be read, a daemon answering errors) would write the same line thousands of times;
the first one says it, the next one an interval later says it goes on."""

from __future__ import annotations

import time
from collections.abc import Hashable


class Every:
    """:meth:`due` is True at most once per ``interval`` seconds for each ``key``."""

    __slots__ = ("interval", "_next", "_counts")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._next: dict[Hashable, float] = {}  # key -> monotonic time it is due again
        self._counts: dict[Hashable, int] = {}  # key -> occurrences not yet reported

    def due(self, key: Hashable = None) -> bool:
        now = time.monotonic()
        at = self._next.get(key)
        if at is not None and now < at:
            return False
        self._next[key] = now + self.interval
        return True

    def tally(self, n: int = 1, key: Hashable = None) -> int:
        """Count ``n`` occurrences; when :meth:`due`, how many were counted since it last was
        (these included), else 0: the number a "... N since the last such line" reports."""
        self._counts[key] = self._counts.get(key, 0) + n
        return self._counts.pop(key) if self.due(key) else 0
