"""``kvstore verify``: the whole store checked read-only — the index against the segment
files, every block's checksum read back in full, segment headers against the records, and
blocks that no lookup can reach. Its :class:`VerifyResult` carries the repair plan that
:func:`~kvstore.admin.repairing.repair` carries out."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.admin.common import open_disk, quiet_disk_log, refuse_if_served
from kvstore.admin.findings import (
    DEFAULT_GRACE_S,
    FindingEntry,
    check_grace,
    entries,
    entry_block_id,
    file_sizes,
)
from kvstore.admin.reachability import find_unreachable, unreachable_grace
from kvstore.admin.repairing import RepairPlan, plan_repair, repair

log = logging.getLogger("kvstore.admin")

if TYPE_CHECKING:
    import torch

    from kvstore.tiers.disk import DiskRecord, DiskTier, NamespaceInfo, ReadStatus
    from kvstore.tiers.disk import SegmentListing as Listing

__all__ = ["VerifyProgress", "VerifyResult", "verify"]

_VERIFY_BATCH_BYTES = 64 << 20

#: ``progress(blocks_done, blocks_total, bytes_done, bytes_total)``
VerifyProgress = Callable[[int, int, int, int], None]


@dataclass(frozen=True, slots=True)
class VerifyResult:
    store: str
    fix: bool  # the plan was carried out (``fixed`` says what is fixed)
    blocks_checked: int
    bytes_checked: int  # raw bytes read back and checksummed
    segments_checked: int
    findings: tuple[FindingEntry, ...]
    unfixed: int  # findings not fixed: non-zero exit status
    grace_s: float
    plan: RepairPlan  # what fixing the findings does (does, or did with ``fix``)

    @property
    def ok(self) -> bool:
        return self.unfixed == 0


def verify(path: str | os.PathLike[str] | None = None, *, fix: bool = False,
           grace_s: float = DEFAULT_GRACE_S,
           progress: VerifyProgress | None = None,
           namespace: str | None = None) -> VerifyResult:
    """Check the whole store, read-only: the index against the segment files (missing or
    cut-off segments, segment headers listing each block at its recorded offset, orphan and
    temp files older than ``grace_s``, side-index consistency), the checksum of every block,
    read back in full, and blocks that no lookup can reach. The result's ``plan`` says what
    fixing the findings does; ``fix`` carries it out at once (:func:`repair`): damaged blocks
    and unreachable ones are dropped, intact blocks of a damaged segment header are rewritten
    into a fresh segment, orphans are unlinked and side indexes rebuilt.

    ``namespace`` (an id, a unique id prefix of >= 4 hex digits, or a model id naming one
    namespace) checks only that namespace's blocks: its findings, none of the store-wide ones
    (orphan and temp files, side indexes), so a fix never touches another tenant's data."""
    from kvstore.admin.common import check_store
    from kvstore.tiers.disk import require_intact

    check_grace(grace_s)
    if fix:  # before the long read, not after it
        refuse_if_served(path, "fixing it")
    # every page of the index, whatever its size (opening walks only small indexes in full)
    require_intact(os.path.join(check_store(path), "index"))
    with open_disk(path, readonly=True) as ro, quiet_disk_log():
        segdir = os.path.join(ro.path, "segments")
        snapshot = list(ro.records())
        only = _namespace_id(ro, namespace)
        # 1. structure (no data read): missing/short segments, orphans, temps, indexes
        findings, recs = _check_structure(ro, snapshot, segdir, grace_s)
        if only is not None:
            findings = [f for f in findings if f.namespace_id == only.hex()]
            recs = [r for r in recs if r.namespace_id == only]
        # 2. every remaining block: checksum, and header agreement
        findings += _read_back(ro, recs, segdir, progress)
        # 3. blocks below a missing block, or below one that fixing drops
        findings, young = _add_unreachable(findings, snapshot, segdir,
                                           unreachable_grace(ro.path, grace_s))
        if only is not None:
            findings = [f for f in findings if f.namespace_id == only.hex()]
        else:  # 4. files and directories more open than the store promises (store-wide)
            findings += mode_findings(ro.path)
        store = ro.path
    unfixed = sum(1 for f in findings if not f.fixed)
    res = VerifyResult(store, False, len(recs), sum(r.raw_nbytes for r in recs),
                       len({r.segment for r in recs}), tuple(findings), unfixed, float(grace_s),
                       plan_repair(findings, young))
    return repair(res) if fix else res


def mode_findings(store: str) -> list[FindingEntry]:
    """``loose_mode``: every path of the store that users it is not shared with can read
    (or write: a store whose gates others can write is refused before this), as
    :mod:`kvstore.filemodes` promises (0700/0600, or 2750/0640 shared with a group)."""
    from kvstore.filemodes import loose_paths, modes_of

    modes = modes_of(store)
    out = []
    for x in loose_paths(store):
        out.append(FindingEntry(
            "loose_mode", x.path, None,
            f"{x.why}: mode {x.mode:04o}, the store promises {x.want:04o} (it is "
            f"{modes.describe()}); --fix sets it ({x.fix(modes)})", False, 0, "chmod"))
    return out


def _namespace_id(ro: DiskTier, namespace: str | None) -> bytes | None:
    """The id of the registered namespace ``namespace`` names (None: the whole store)."""
    if namespace is None:
        return None
    from kvstore.admin.nsmatch import resolve_namespace

    return resolve_namespace(namespace, ro.namespaces()).namespace_id


def _check_structure(ro: DiskTier, snapshot: list[DiskRecord], segdir: str,
                     grace_s: float) -> tuple[list[FindingEntry], list[DiskRecord]]:
    """What a check without reading data finds, and the records it did not flag (in segment
    order: the ones to read back)."""
    sizes = file_sizes(segdir)
    structural = ro.check(fix=False, grace_s=grace_s, verify_data=False)
    flagged = {bytes(f.key) for f in structural if f.key is not None}
    findings = entries(structural, sizes, {r.key: r for r in snapshot if r.key in flagged})
    recs = [r for r in snapshot if r.key not in flagged]
    recs.sort(key=lambda r: (r.segment, r.offset))
    return findings, recs


def _batches(recs: list[DiskRecord]) -> Iterator[list[DiskRecord]]:
    """``recs`` in runs of at most ``_VERIFY_BATCH_BYTES`` raw bytes (a bigger block alone)."""
    i = 0
    while i < len(recs):
        batch = []
        nbytes = 0
        while i < len(recs) and (not batch or nbytes + recs[i].raw_nbytes
                                 <= _VERIFY_BATCH_BYTES):
            batch.append(recs[i])
            nbytes += recs[i].raw_nbytes
            i += 1
        yield batch


def _read_back(ro: DiskTier, recs: list[DiskRecord], segdir: str,
               progress: VerifyProgress | None) -> list[FindingEntry]:
    """Every block of ``recs`` read back and checksummed, batch by batch, into one scratch
    buffer; and its segment header checked against its record."""
    total_blocks = len(recs)
    total_bytes = sum(r.raw_nbytes for r in recs)
    done_blocks = done_bytes = 0
    if progress is not None:
        progress(0, total_blocks, 0, total_bytes)
    import torch  # reading blocks back needs tensors; listing and planning do not

    scratch = torch.empty(max([min(_VERIFY_BATCH_BYTES, total_bytes)]
                              + [r.raw_nbytes for r in recs]), dtype=torch.uint8)
    listings: dict[int, Listing] = {}
    findings: list[FindingEntry] = []
    layouts = {n.namespace_id: n for n in ro.namespaces()}
    for batch in _batches(recs):
        findings += _check_batch(ro, batch, scratch, listings, segdir, layouts)
        done_blocks += len(batch)
        done_bytes += sum(r.raw_nbytes for r in batch)
        if progress is not None:
            progress(done_blocks, total_blocks, done_bytes, total_bytes)
    return findings


def _check_batch(ro: DiskTier, batch: list[DiskRecord], scratch: torch.Tensor,
                 listings: dict[int, Listing], segdir: str,
                 layouts: dict[bytes, NamespaceInfo]) -> list[FindingEntry]:
    """One batch read into ``scratch``; a failed read confirmed as damage, a header that does
    not list a block that verifies (at its offset, with the dtype and shape its record and
    its namespace's layout give: ``layouts``) confirmed as repairable (``listings``: headers
    read so far, by segment id)."""
    from kvstore.tiers.disk import ReadStatus, expected_tensor, listing_problem, segment_listing

    dsts, off = [], 0
    for r in batch:
        dsts.append(scratch[off:off + r.raw_nbytes])
        off += r.raw_nbytes
    # the header does not matter to a read (records hold the offsets): blocks of a damaged
    # header are read too, and kept if their bytes verify
    statuses = _read_batch(ro, batch, dsts)
    out: list[FindingEntry] = []
    for r, status in zip(batch, statuses, strict=True):
        if r.segment not in listings:
            listings[r.segment] = segment_listing(segdir, r.segment)
        bad = listing_problem(listings[r.segment], r.key, r.offset, r.stored_nbytes,
                              expected_tensor(r.codec, r.stored_nbytes,
                                              layouts.get(r.namespace_id)))
        if status is ReadStatus.OK:
            if bad is not None:
                out.extend(_confirm_header_problem(ro, r, bad, segdir))
            continue
        f = _confirm_damage(ro, r, segdir, bad, status)
        if f is not None:
            out.append(f)
    return out


def _add_unreachable(findings: list[FindingEntry], snapshot: list[DiskRecord], segdir: str,
                     grace_s: float) -> tuple[list[FindingEntry], int]:
    """``findings`` plus the blocks no lookup can reach once the damaged ones are dropped,
    and how many such blocks are young enough to leave alone."""
    gone = {entry_block_id(f) for f in findings if f.key is not None and f.action == "drop"}
    unreach, young = find_unreachable(snapshot, gone, segdir, now=time.time(), grace_s=grace_s,
                                      why_gone="dropped by this fix (damaged)")
    # a block that goes because no lookup can reach it is not worth a rewrite
    doomed = {entry_block_id(f) for f in unreach}
    kept = [f for f in findings if not (f.kind == "bad_header" and entry_block_id(f) in doomed)]
    return kept + unreach, young


def _segment_path(segdir: str, sid: int) -> str:
    from kvstore.tiers.disk import segment_name

    return os.path.join(segdir, segment_name(sid))


def _same_place(cur: DiskRecord | None, r: DiskRecord) -> bool:
    return cur is not None and (cur.segment, cur.offset) == (r.segment, r.offset)


def _confirm_header_problem(ro: DiskTier, r: DiskRecord, detail: str,
                            segdir: str) -> list[FindingEntry]:
    """The bytes verify but the header does not describe the block: repairable, unless the
    record moved meanwhile (then its new segment lists it)."""
    if not _same_place(ro.get_record(r.key, namespace_id=r.namespace_id), r):
        return []
    return [FindingEntry("bad_header", _segment_path(segdir, r.segment), r.key.hex(),
                         f"{detail}; the block's bytes verify", False, r.stored_nbytes,
                         "repair", r.namespace_id.hex())]


def _classify(r: DiskRecord, segdir: str) -> tuple[str, str]:
    path = _segment_path(segdir, r.segment)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing_segment", f"segment file {path} is missing"
    if r.offset + r.stored_nbytes > size:
        return "short_segment", (f"segment has {size} bytes; block at {r.offset}+"
                                 f"{r.stored_nbytes} is cut off")
    return "checksum_mismatch", "the block's bytes do not match its checksum"


def _confirm_damage(ro: DiskTier, r: DiskRecord, segdir: str, header: str | None,
                    status: ReadStatus) -> FindingEntry | None:
    """A read failed: was it damage, or did another process remove/move the block, or could
    this process not make the read now?"""
    from kvstore.tiers.disk import ReadStatus

    cur = ro.get_record(r.key, namespace_id=r.namespace_id)
    if cur is None:
        return None  # removed meanwhile
    if not _same_place(cur, r):  # moved (compaction): verify it at its new place
        import torch

        dst = torch.empty(cur.raw_nbytes, dtype=torch.uint8)
        status = ro.read_into(r.key, dst, namespace_id=r.namespace_id)
        if status is ReadStatus.OK:
            return None
        r = cur
        header = None
    kind, detail = _classify(r, segdir)
    if status is ReadStatus.MISSING and kind == "checksum_mismatch":
        # the file is there and whole, and the read says missing, not damaged: the disk tier
        # could not make it now (out of descriptors, no permission); dropping the block on
        # that would lose good data, so it is left unchecked and said so
        log.warning("verify: block %s in %s could not be read now (not damage: out of file "
                    "descriptors or permission?); not checked, not dropped: run verify again",
                    r.key.hex()[:16], _segment_path(segdir, r.segment))
        return None
    if header is not None:
        detail = f"{detail} (and {header})"
    return FindingEntry(kind, _segment_path(segdir, r.segment), r.key.hex(), detail, False,
                        r.stored_nbytes, "drop", r.namespace_id.hex())


def _read_batch(ro: DiskTier, batch: list[DiskRecord],
                dsts: list[torch.Tensor]) -> list[ReadStatus]:
    """``read_many`` of a batch of records, each in its own namespace's key space."""
    out: list = [None] * len(batch)
    by_ns: dict[bytes, list[int]] = {}
    for i, r in enumerate(batch):
        by_ns.setdefault(r.namespace_id, []).append(i)
    for ns, idx in by_ns.items():
        got = ro.read_many([batch[i].key for i in idx], [dsts[i] for i in idx],
                           namespace_id=ns)
        for i, st in zip(idx, got, strict=True):
            out[i] = st
    return out
