"""``kvstore compact``: rewriting the segments whose live fraction is low, so that the dead
bytes that removals, evictions and overwrites leave behind go back to the file system."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.admin.common import AdminError, open_disk, quiet_disk_log, refuse_if_served

__all__ = ["CompactReport", "compact"]


@dataclass(frozen=True, slots=True)
class CompactReport:
    store: str
    threshold: float
    segments_rewritten: int
    blocks_moved: int
    bytes_before: int  # file bytes of the rewritten segments
    bytes_after: int  # file bytes of the segments written in their place
    reclaimed_bytes: int  # bytes_before - bytes_after
    segment_bytes_before: int  # all segment files, before and after
    segment_bytes_after: int
    dead_bytes_before: int
    dead_bytes_after: int
    seconds: float


def compact(path: str | os.PathLike[str] | None = None, *, threshold: float | None = None,
            progress: Callable[[int, int], None] | None = None) -> CompactReport:
    """Rewrite the segments whose live fraction is below ``threshold`` (default 0.5; 1.0
    rewrites every segment with any dead byte) into new ones. ``progress(done, total)``
    counts segments."""
    if threshold is not None and not 0.0 <= float(threshold) <= 1.0:
        raise AdminError(f"threshold must be in [0, 1], got {threshold}")
    refuse_if_served(path, "compacting it")
    t0 = time.perf_counter()
    with open_disk(path, readonly=False) as t, quiet_disk_log():
        thr = t.compact_threshold if threshold is None else float(threshold)
        before = t.stats()
        res = t.compact(thr, progress=progress)
        after = t.stats()
        store = t.path
    return CompactReport(
        store=store, threshold=thr, segments_rewritten=res.segments_rewritten,
        blocks_moved=res.blocks_moved, bytes_before=res.bytes_before, bytes_after=res.bytes_after,
        reclaimed_bytes=max(0, res.bytes_before - res.bytes_after),
        segment_bytes_before=before.segment_bytes, segment_bytes_after=after.segment_bytes,
        dead_bytes_before=before.dead_bytes, dead_bytes_after=after.dead_bytes,
        seconds=time.perf_counter() - t0,
    )
