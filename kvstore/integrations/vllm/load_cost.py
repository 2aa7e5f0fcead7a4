"""What a load from below memory costs in this process, measured: the worker's time per block of
its loads that read below memory (disk, Redis, the daemon's disk), the scheduler's engine step.

A background load costs its request one engine step (vLLM schedules it in the step after the
worker reports the load); a load before the step holds up every other request in that step by
the load's time. :meth:`LoadCost.cheaper_now` compares the two, so a hit the page cache serves
in a few milliseconds does not wait a whole step. The scheduler keeps it; the worker's samples
reach it through vLLM's worker -> scheduler channel (``KVStoreWorkerMetadata``, in whatever
process each runs). Until both are measured it never answers yes, and hits below memory load in
the background.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

__all__ = ["LoadCost"]

#: recent samples kept for each median (a few seconds of engine steps)
WINDOW = 32
#: a load before the step may take at most this share of a step, per request it holds up: the
#: estimate is a median of earlier loads, and a read the page cache no longer serves is slower
MARGIN = 0.5
#: engine steps measured before the step's median is trusted
MIN_STEPS = 4


class LoadCost:
    """Running medians of the engine step and of a below-memory load's time per block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._per_block: deque[float] = deque(maxlen=WINDOW)

    def note_step(self, seconds: float) -> None:
        """One engine step, from one scheduling to the next while requests kept running."""
        if seconds > 0:
            with self._lock:
                self._steps.append(seconds)

    def note_load(self, seconds: float, blocks: int) -> None:
        """A load that read ``blocks`` blocks below memory in ``seconds`` (the whole load's
        time: its memory blocks' copies count against it, so the estimate errs high)."""
        if blocks > 0 and seconds >= 0:
            with self._lock:
                self._per_block.append(seconds / blocks)

    def step_s(self) -> float | None:
        with self._lock:
            return statistics.median(self._steps) if len(self._steps) >= MIN_STEPS else None

    def block_s(self) -> float | None:
        with self._lock:
            return statistics.median(self._per_block) if self._per_block else None

    def cheaper_now(self, blocks: int, others: int) -> bool:
        """Whether loading ``blocks`` blocks before the step, holding up ``others`` requests
        (at least one counted), costs less than a step, with :data:`MARGIN` to spare. False
        while either median is unknown."""
        step, per = self.step_s(), self.block_s()
        if step is None or per is None or blocks <= 0:
            return False
        return blocks * per * max(others, 1) <= MARGIN * step
