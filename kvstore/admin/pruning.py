"""``kvstore prune``: orphan and temp files, records without payload, undecodable records,
inconsistent side indexes and blocks that no lookup can reach — everything a structural
check finds, without reading block data (``verify`` reads it)."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from kvstore.admin.common import open_disk, quiet_disk_log, refuse_if_served
from kvstore.admin.findings import (
    DEFAULT_GRACE_S,
    FindingEntry,
    check_grace,
    entries,
    entry_block_id,
    file_sizes,
)
from kvstore.admin.reachability import (
    find_unreachable,
    late_entries,
    remove_unreachable,
    unreachable_grace,
)

__all__ = ["PruneResult", "prune"]


@dataclass(frozen=True, slots=True)
class PruneResult:
    store: str
    dry_run: bool
    grace_s: float
    findings: tuple[FindingEntry, ...]
    removed: int  # findings fixed
    freed_bytes: int  # file bytes removed (orphan segments, temp files)
    unreachable: int  # blocks removed (or, dry run, to remove) that no lookup could reach
    unreachable_bytes: int  # their stored bytes
    young_unreachable: int  # unreachable blocks written less than grace_s ago: left alone


def prune(path: str | os.PathLike[str] | None = None, *, dry_run: bool = False,
          grace_s: float = DEFAULT_GRACE_S) -> PruneResult:
    """Remove orphan segment files and temp files older than ``grace_s``, records whose
    payload is missing or cut off, undecodable records, blocks that no lookup can reach (their
    parent is not in the index: the whole subtree below a missing block), and rebuild
    inconsistent side indexes (``DiskTier.check(fix=True, verify_data=False)``; no block data
    is read — use :func:`~kvstore.admin.verification.verify` for checksums). ``dry_run`` only
    reports."""
    check_grace(grace_s)
    if not dry_run:
        refuse_if_served(path, "pruning")
    with open_disk(path, readonly=dry_run) as t, quiet_disk_log():
        segdir = os.path.join(t.path, "segments")
        sizes = file_sizes(segdir)
        before = {r.key: r for r in t.records()}
        found = t.check(fix=not dry_run, grace_s=grace_s, verify_data=False)
        listed = entries(found, sizes, before)
        gone = {entry_block_id(e) for e in listed
                if e.key is not None and e.action == "drop" and (dry_run or e.fixed)}
        unreach, young = find_unreachable(t.records(), gone, segdir, now=time.time(),
                                          grace_s=unreachable_grace(t.path, grace_s),
                                          why_gone="dropped by this prune")
        if not dry_run and unreach:
            done, late, _ = remove_unreachable(t, (entry_block_id(e) for e in unreach), gone)
            unreach = [dataclasses.replace(e, fixed=entry_block_id(e) in done)
                       for e in unreach] + late_entries(late, segdir)
        store = t.path
    listed += unreach
    fixed = [e for e in listed if e.fixed]
    freed = sum(e.nbytes for e in fixed if e.kind in ("orphan_segment", "temp_file"))
    counted = [e for e in unreach if e.fixed or dry_run]
    return PruneResult(store, dry_run, float(grace_s), tuple(listed), len(fixed), freed,
                       len(counted), sum(e.nbytes for e in counted), young)
