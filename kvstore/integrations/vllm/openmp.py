"""Advice for engines whose vLLM pages are in host memory: torch's OpenMP spin-wait."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

__all__ = ["log_openmp_spin_hint", "openmp_spin_hint"]

log = logging.getLogger("vllm.kvstore")


def openmp_spin_hint(environ: Mapping[str, str], maps: str) -> str | None:
    """The advice to log when vLLM's pages are in host memory and torch's OpenMP runtime is
    libgomp left at its default spin (``maps``: the process's ``/proc/self/maps``), else
    None. Its workers keep spinning 6-8 ms of CPU after every parallel region, through the
    disk loads that start right after one (docs/vllm.md, "On few cores")."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ or "libgomp" not in maps:
        return None
    return ("kvstore: torch's OpenMP workers (libgomp) spin for ms after every parallel region "
            "and take the cores a load from disk needs; with few cores, GOMP_SPINCOUNT=10000 "
            "(or OMP_WAIT_POLICY=passive) in the engine's environment took a 32 MiB page-cache "
            "load from 9.9-12.5 to 6.6-8.6 ms on 2 cores (docs/vllm.md, 'On few cores')")


def log_openmp_spin_hint() -> None:
    """Log :func:`openmp_spin_hint`'s advice for this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:  # not Linux: nothing to tell
        return
    hint = openmp_spin_hint(os.environ, maps)
    if hint is not None:
        log.info(hint)
