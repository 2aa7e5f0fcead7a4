"""The connector's counters: kept per connector (:class:`ConnectorStats`), written as JSON under
``stats_path`` (``<role>-<pid>.json``) and read back, summed per role, by :func:`read_stats`.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref
from pathlib import Path

from kvstore.errors import ConfigError

__all__ = ["COUNTERS", "ConnectorStats", "flush_stats", "read_stats", "write_interval"]

log = logging.getLogger("vllm.kvstore")

#: the environment variable that sets :func:`write_interval`
INTERVAL_ENV = "KVSTORE_VLLM_STATS_INTERVAL"
#: its default: at most one write per connector a second, and at shutdown / exit. A write is
#: a file write and a rename: ~1.3 ms of wall time on this VM's disk (0.25 ms of CPU), and both
#: roles wrote once per engine step: ~1 ms of a 9-10 ms decode step (issue 29's TPOT).
DEFAULT_INTERVAL_S = 1.0


def write_interval() -> float:
    """Seconds between two writes of one connector's stats file: ``$KVSTORE_VLLM_STATS_INTERVAL``
    (0: every engine step), else :data:`DEFAULT_INTERVAL_S`. Read when a connector with a
    ``stats_path`` is made; a value that is not a number >= 0 raises :class:`ConfigError`
    saying what to set (the engine does not start with it, rather than write stats at a rate
    nobody asked for)."""
    raw = os.environ.get(INTERVAL_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_INTERVAL_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v >= 0:  # negative or NaN
        raise ConfigError(
            f"{INTERVAL_ENV}={raw!r:.60}: set it to a number of seconds >= 0 between two writes "
            f"of the vLLM connector's stats files (0: every engine step; unset: "
            f"{DEFAULT_INTERVAL_S:g})")
    return v

_live: weakref.WeakSet[ConnectorStats] = weakref.WeakSet()

#: every counter, in the order the stats files list them
COUNTERS = (
    "lookups", "lookup_tokens", "hit_tokens", "hit_requests",
    "loads", "load_blocks", "loaded_blocks", "failed_blocks",
    "load_timeouts",  # loads past load_timeout: reported failed, recomputed
    "async_loads",  # hits loaded in the background (load_kv_async)
    "memory_loads",  # hits loaded before the step: every block in a memory tier
    "idle_loads",  # hits below memory loaded before the step: the engine ran nothing else
    "cheap_loads",  # hits below memory loaded before the step: cheaper than a step (load_cost)
    "saves", "save_blocks", "save_errors", "skipped_saves",
    "layer_waits",
    # microseconds spent on the engine's critical path
    "lookup_us", "load_submit_us", "load_wait_us", "save_us", "async_poll_us",
)


class ConnectorStats:
    """One connector's counters; ``stats_path`` (a directory, or None) is where
    :meth:`write` puts them, at most once every ``interval`` seconds (default:
    :func:`write_interval`, read only when there is a ``stats_path``)."""

    def __init__(self, role: str, mode: str, stats_path: str | None,
                 interval: float | None = None) -> None:
        self.role = role
        self.mode = mode
        self.stats_path = stats_path
        self.interval = (interval if interval is not None
                         else write_interval() if stats_path else DEFAULT_INTERVAL_S)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._dirty = False
        self._last = float("-inf")  # monotonic time of the last write
        if stats_path:
            try:  # a directory that cannot be made is a bad config, not stats silently lost
                Path(stats_path).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"kv_connector_extra_config: 'stats_path' {stats_path!r} is "
                                  f"not a directory the connector can write to ({e})") from e
            _live.add(self)

    def count(self, **inc: int) -> None:
        for k, v in inc.items():
            self.counters[k] += v
        self._dirty = True

    def write(self, force: bool = False) -> None:
        """Write the counters if they changed since the last write and the last write is
        ``interval`` old (``force``: now, changed or not)."""
        if not self.stats_path or not (self._dirty or force):
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        self._dirty = False
        role = self.role
        d = Path(self.stats_path)
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{role}-{os.getpid()}.json.tmp"
            tmp.write_text(json.dumps({"role": role, "pid": os.getpid(),
                                       "mode": self.mode, **self.counters}))
            os.replace(tmp, d / f"{role}-{os.getpid()}.json")
        except OSError as e:  # stats are a diagnostic, never a failure
            log.debug("kvstore: could not write stats: %s", e)


def flush_stats() -> None:
    """Write every connector's counters in this process now (a reader in the same process,
    e.g. a benchmark's driver, sees them at once; also run at exit)."""
    for st in list(_live):
        if st._dirty:
            st.write(force=True)


atexit.register(flush_stats)


def read_stats(stats_path: str | os.PathLike[str]) -> dict[str, dict[str, int]]:
    """Connector counters written under ``stats_path``, summed per role."""
    out: dict[str, dict[str, int]] = {}
    for f in sorted(Path(stats_path).glob("*.json")):
        d = json.loads(f.read_text())
        role = d.pop("role")
        d.pop("pid", None)
        d.pop("mode", None)
        acc = out.setdefault(role, {})
        for k, v in d.items():
            acc[k] = acc.get(k, 0) + v
    return out
