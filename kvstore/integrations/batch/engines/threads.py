"""CPU threads of the batched engine, chosen from what the process may really use, again and
again while it runs.

Two things matter on a CPU, most when the cores are shared with other processes:

- the thread count: the cores this process may run on (``os.sched_getaffinity``, a cgroup's
  CPU quota), not the machine's (:func:`usable_cores`);
- who else is running. OpenMP threads spin a while (libgomp: about 3 ms) when they finish
  their share of a parallel region, waiting for the others; when one of them is descheduled
  by another process, every thread of every small operation waits a scheduler time slice for
  it. Measured on a shared 2-core machine (a 110M Llama's decode step of 64 rows, load 6-11):
  2 spinning threads 3.5-4.8 s a step, 1 thread 0.43-0.56 s. Threads that sleep instead
  (``OMP_WAIT_POLICY=PASSIVE``) avoid the stall but pay a wake-up on every parallel region:
  idle, the 110M engine ran 6-12 % slower with them.

So the engine keeps OpenMP's default waits and chooses the thread count as it runs
(:class:`CoreShare`): every half second it reads how busy its cores were (``/proc/stat``)
less what it used itself (``os.times``), and runs on the cores other processes leave it.
Idle, every usable core spins; beside one busy process on 2 cores, one thread runs alone,
which is as fast as two passive threads there, and the engine takes the core back once the
other process stops. Where ``/proc/stat`` cannot be read, or a cgroup quota (not the
affinity) sets the cores, the count stays :func:`usable_cores`.

This module imports no torch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CoreShare", "CpuTimes", "proc_stat_reader", "quota_limited", "set_threads",
           "usable_cores"]

#: a core counts as taken by other processes once they keep it busy this share of the time
TAKEN = 0.4
#: seconds between two looks at the cores' load
INTERVAL = 0.5
#: the shortest window a look measures (100 ticks a second: 10 ticks a core)
MIN_WINDOW = 0.05


def _cgroup_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The cores a cgroup's CPU quota allows (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), or
    None without a quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return q / p if q > 0 and p > 0 else None
    except (OSError, ValueError):
        return None


def _affinity_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on (its CPU affinity, capped by a cgroup CPU quota),
    at least 1."""
    n = _affinity_cores()
    quota = _cgroup_cores(cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 0.05)))
    return n


def quota_limited(cgroup_root: Path = Path("/sys/fs/cgroup")) -> bool:
    """Whether a cgroup CPU quota, not the affinity, sets :func:`usable_cores`: then other
    processes' use of the CPUs (other containers') does not take this process's share."""
    return usable_cores(cgroup_root) < _affinity_cores()


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """One look at the cores: seconds they were busy (every process), seconds of CPU this
    process used, both since boot."""

    busy: float
    own: float


def proc_stat_reader(cpus: Iterable[int] | None = None, stat: Path = Path("/proc/stat")
                     ) -> Callable[[], CpuTimes | None]:
    """A reader of :class:`CpuTimes` for ``cpus`` (default: this process's affinity) from
    ``/proc/stat``; it returns None where the file cannot be read or parsed."""
    try:
        want = {f"cpu{c}" for c in (os.sched_getaffinity(0) if cpus is None else cpus)}
        tick = float(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, OSError, ValueError):
        return lambda: None

    def read() -> CpuTimes | None:
        try:
            text = stat.read_text()
        except OSError:
            return None
        busy = 0
        seen = 0
        for line in text.splitlines():
            name, _, rest = line.partition(" ")
            if name not in want:
                continue
            try:
                f = [int(x) for x in rest.split()[:8]]  # user .. steal (guest is in user)
            except ValueError:
                return None
            if len(f) < 5:
                return None
            busy += sum(f) - f[3] - f[4]  # less idle and iowait
            seen += 1
        if not seen:
            return None
        t = os.times()
        return CpuTimes(busy / tick, t.user + t.system)

    return read


class CoreShare:
    """How many threads to run on now: the usable cores less the ones other processes keep
    busy (see the module docstring). :meth:`threads` looks again at most every ``interval``
    seconds and is otherwise a clock read; ``threads(now=True)``, as a run starts, looks over
    a fresh window of :data:`MIN_WINDOW` (it sleeps that long)."""

    __slots__ = ("cores", "interval", "_read", "_clock", "_sleep", "_last", "_at", "_threads",
                 "others")

    def __init__(self, cores: int | None = None, *, interval: float = INTERVAL,
                 reader: Callable[[], CpuTimes | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.cores = cores or usable_cores()
        self.interval = interval
        # under a quota the CPUs' load is other containers', not a share of this one's
        self._read = reader or ((lambda: None) if quota_limited() else proc_stat_reader())
        self._clock, self._sleep = clock, sleep
        self._at = clock()
        self._last = self._read()
        self._threads = self.cores
        self.others = 0.0  # cores other processes kept busy in the last window

    def threads(self, now: bool = False) -> int:
        if self._last is None:
            return self._threads
        t = self._clock()
        if now:  # a fresh window: what ran before (another job's burst) is not now
            fresh = self._read()
            if fresh is None:
                return self._fail()
            self._last, self._at = fresh, t
            self._sleep(MIN_WINDOW)
            t = self._clock()
        elif t - self._at < self.interval:
            return self._threads
        cur = self._read()
        if cur is None:
            return self._fail()
        wall = max(t - self._at, 1e-9)
        others = max(0.0, (cur.busy - self._last.busy) - (cur.own - self._last.own)) / wall
        self._last, self._at, self.others = cur, t, others
        taken = math.floor(others + (1.0 - TAKEN)) if others > TAKEN else 0
        self._threads = max(1, self.cores - taken)
        return self._threads

    def _fail(self) -> int:
        """The load cannot be read (any more): every usable core, no more looks."""
        self._last = None
        self._threads = self.cores
        return self._threads


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``threads`` (default :func:`usable_cores`); returns
    the count before, to restore."""
    import torch

    before = torch.get_num_threads()
    n = threads or usable_cores()
    if n != before:
        torch.set_num_threads(n)
    return before
