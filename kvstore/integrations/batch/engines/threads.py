"""CPU threads of the batched engine, chosen from what the process may really use.

Two settings matter on a CPU, most when the cores are shared with other processes:

- the thread count: the cores this process may run on (``os.sched_getaffinity``), not the
  machine's (:func:`usable_cores`);
- the OpenMP wait policy: by default an OpenMP thread that finishes its share of a parallel
  region spins, waiting for the others; when one of them is descheduled by another process,
  every thread of every small operation waits a scheduler time slice for it. Measured on a
  shared 2-core machine (load 6-11, a 110M Llama's decode step of 64 rows): 2 threads with
  the default policy 3.5-4.8 s a step, 1 thread 0.43-0.56 s, 2 threads with
  ``OMP_WAIT_POLICY=PASSIVE`` 0.8-1.3 s against 1 thread's 0.8-1.7 s in the same run.
  OpenMP reads the policy once, when the runtime loads (``import torch``):
  :func:`prefer_passive_waits` sets it when that has not happened yet and the user has not
  chosen one.

This module imports no torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["PASSIVE_ENV", "prefer_passive_waits", "set_threads", "usable_cores"]

#: the environment the engine's OpenMP runtime should start with (unless the user set it)
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def prefer_passive_waits(env: MutableMapping[str, str] | None = None) -> bool:
    """Ask for OpenMP threads that sleep instead of spinning while they wait (unless the
    environment already says otherwise). Only takes effect before torch is imported (for
    ``env`` None, this process's environment); returns whether the policy is now passive
    for the runtime that will read it."""
    target = os.environ if env is None else env
    for key, value in PASSIVE_ENV.items():
        target.setdefault(key, value)
    if env is None and "torch" in sys.modules:
        return False  # the runtime already read its policy
    return target.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads to ``threads`` (default :func:`usable_cores`); returns
    the count before, to restore."""
    import torch

    before = torch.get_num_threads()
    n = threads or usable_cores()
    if n != before:
        torch.set_num_threads(n)
    return before
