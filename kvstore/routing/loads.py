"""``LoadTracker``: the work (tokens to compute) each engine was given in a recent window."""

from __future__ import annotations

import time
from collections import deque


class LoadTracker:
    """Sliding-window sums of the tokens routed to each engine (Preble counts an engine's
    load over its last few minutes of requests the same way)."""

    def __init__(self, window_s: float = 180.0) -> None:
        if not window_s > 0:
            raise ValueError("window_s must be > 0")
        self.window_s = window_s
        self._log: deque[tuple[float, str, float]] = deque()
        self._sum: dict[str, float] = {}

    def add(self, engine: str, tokens: float, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        self._log.append((t, engine, tokens))
        self._sum[engine] = self._sum.get(engine, 0.0) + tokens

    def loads(self, engines: tuple[str, ...] | list[str],
              now: float | None = None) -> list[float]:
        t = time.monotonic() if now is None else now
        log, sums = self._log, self._sum
        horizon = t - self.window_s
        while log and log[0][0] < horizon:
            _, e, tok = log.popleft()
            left = sums[e] - tok
            sums[e] = left if left > 1e-9 else 0.0
        return [sums.get(e, 0.0) for e in engines]
