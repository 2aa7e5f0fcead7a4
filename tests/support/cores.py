"""A machine whose load the tests set, for :class:`~kvstore.integrations.batch.engines.threads.CoreShare`."""

from __future__ import annotations

from kvstore.integrations.batch.engines.threads import CoreShare, CpuTimes


class FakeCores:
    """A machine whose cores' busy seconds and this process's CPU seconds the test sets."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.readable = True
        self.reads = 0
        self.others = 0.0

    def read(self) -> CpuTimes | None:
        self.reads += 1
        return CpuTimes(self.busy, self.own) if self.readable else None

    def sleep(self, s: float) -> None:
        self.advance(s, self.others, 0.0)

    def advance(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` pass with other processes on ``others`` cores and this one on ``own``
        (other processes go on so while this one sleeps)."""
        self.others = others
        self.t += seconds
        self.busy += seconds * (others + own)
        self.own += seconds * own

    def share(self, cores: int) -> CoreShare:
        return CoreShare(cores, reader=self.read, clock=lambda: self.t, sleep=self.sleep)
