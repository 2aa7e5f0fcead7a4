"""The connector's counters: kept per connector (:class:`ConnectorStats`), written as JSON under
``stats_path`` (``<role>-<pid>.json``) and read back, summed per role, by :func:`read_stats`.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["COUNTERS", "ConnectorStats", "read_stats"]

log = logging.getLogger("vllm.kvstore")

#: every counter, in the order the stats files list them
COUNTERS = (
    "lookups", "lookup_tokens", "hit_tokens", "hit_requests",
    "loads", "load_blocks", "loaded_blocks", "failed_blocks",
    "async_loads",  # hits loaded in the background (load_kv_async)
    "saves", "save_blocks", "save_errors", "skipped_saves",
    "layer_waits",
    # microseconds spent on the engine's critical path
    "lookup_us", "load_submit_us", "load_wait_us", "save_us", "async_poll_us",
)


class ConnectorStats:
    """One connector's counters; ``stats_path`` (a directory, or None) is where
    :meth:`write` puts them."""

    def __init__(self, role: str, mode: str, stats_path: str | None) -> None:
        self.role = role
        self.mode = mode
        self.stats_path = stats_path
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._dirty = False

    def count(self, **inc: int) -> None:
        for k, v in inc.items():
            self.counters[k] += v
        self._dirty = True

    def write(self, force: bool = False) -> None:
        """Write the counters if they changed since the last write (or ``force``)."""
        if not self.stats_path or not (self._dirty or force):
            return
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
