"""Changing a store while engines use it: ``rm`` (namespaces and blocks, with their
descendants), ``prune`` (orphan files, temp files, records without payload), ``verify``
(checksums of every block, index/segment agreement; ``fix`` drops what is bad) and ``compact``.

Every change goes through :class:`~kvstore.tiers.disk.DiskTier`, which takes LMDB's write
lock like every engine and unlinks a payload file only after the transaction that removed its
last record has committed; readers in other processes that find a file gone re-read the
record (compaction) or see a miss (removal) — never wrong bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvstore.admin.common import AdminError, open_disk, quiet_disk_log

__all__ = [
    "CompactReport",
    "FindingEntry",
    "NamespaceTarget",
    "PruneResult",
    "RemovalPlan",
    "RemovalResult",
    "TargetError",
    "VerifyResult",
    "compact",
    "execute_removal",
    "plan_removal",
    "preview_removal",
    "prune",
    "remove",
    "verify",
]

#: a target shorter than this many hex digits is refused (too easy to hit by accident)
MIN_PREFIX = 4
#: ``prune``/``verify`` leave unreferenced files younger than this alone (an in-flight writer
#: of another process renames its segment before it commits the records)
DEFAULT_GRACE_S = 60.0
_VERIFY_BATCH_BYTES = 64 << 20


class TargetError(AdminError):
    """An ``rm`` target is malformed or ambiguous."""


# -- rm ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NamespaceTarget:
    namespace_id: str
    model_id: str
    blocks: int
    stored_bytes: int


@dataclass(frozen=True, slots=True)
class RemovalPlan:
    """What :func:`execute_removal` will remove. Removing a block removes its descendants on
    disk too (they could never be found by a lookup again), so the store stays prefix-closed."""

    store: str
    targets: tuple[str, ...]  # as given
    namespaces: tuple[NamespaceTarget, ...]  # namespaces named (all their blocks go)
    blocks: tuple[str, ...]  # block keys named (full hex)
    not_found: tuple[str, ...]  # targets that matched nothing (already gone?)
    descendants: int  # blocks going only because an ancestor goes
    keys: tuple[str, ...]  # every block that goes (hex), leaves first
    stored_bytes: int  # their stored bytes
    raw_bytes: int


@dataclass(frozen=True, slots=True)
class RemovalResult:
    plan: RemovalPlan
    dry_run: bool
    removed_blocks: int  # records removed (blocks already gone are not counted)
    late_descendants: int  # children written meanwhile by another process, removed too
    late_keys: tuple[str, ...]  # those children (hex)
    freed_bytes: int  # stored bytes of the removed blocks (dead space from now on)
    released_bytes: int  # segment files unlinked now (all their blocks gone)
    dead_bytes: int  # dead bytes left in segment files: ``kvstore compact`` reclaims them


def _norm_target(t: str) -> str:
    s = t.strip().lower()
    if not s:
        raise TargetError("an empty target was given")
    if not set(s) <= set("0123456789abcdef"):
        raise TargetError(
            f"target {t!r} is not a namespace id or block key (hex); list ids with "
            "'kvstore ls -q' (namespaces) or 'kvstore ls --blocks -q' (blocks)"
        )
    if len(s) > 64:
        raise TargetError(f"target {t!r} is longer than an id (64 hex digits)")
    if len(s) < MIN_PREFIX:
        raise TargetError(f"target {t!r} is too short: give at least {MIN_PREFIX} hex digits "
                          "of a namespace id or block key")
    return s


def _prefix_matches(sorted_ids: list[str], prefix: str, cap: int = 6) -> list[str]:
    i = bisect.bisect_left(sorted_ids, prefix)
    out = []
    while i < len(sorted_ids) and sorted_ids[i].startswith(prefix) and len(out) < cap:
        out.append(sorted_ids[i])
        i += 1
    return out


def plan_removal(path: str | os.PathLike[str] | None, targets: Iterable[str]) -> RemovalPlan:
    """Resolve ``targets`` — namespace ids or block keys, in full or as a unique hex prefix
    (at least 4 digits) — into the blocks to remove, descendants included. Raises
    :class:`TargetError` for a malformed or ambiguous target; targets that match nothing are
    listed in ``not_found``."""
    given = tuple(targets)
    norm = [_norm_target(t) for t in given]
    with open_disk(path, readonly=True) as t:
        infos = {i.namespace_id.hex(): i for i in t.namespaces()}
        recs = list(t.records())
        store = t.path
    by_key = {r.key.hex(): r for r in recs}
    ns_ids = sorted(set(infos) | {r.namespace_id.hex() for r in recs})
    keys_sorted = sorted(by_key)
    children: dict[str, list[str]] = {}
    by_ns: dict[str, list[str]] = {}
    for k, r in by_key.items():
        if r.parent is not None:
            children.setdefault(r.parent.hex(), []).append(k)
        by_ns.setdefault(r.namespace_id.hex(), []).append(k)

    named_ns: list[str] = []
    named_blocks: list[str] = []
    not_found: list[str] = []
    for raw, s in zip(given, norm, strict=True):
        ns_hit = _prefix_matches(ns_ids, s)
        key_hit = _prefix_matches(keys_sorted, s)
        if len(s) == 64:  # a full id: exact
            ns_hit = [x for x in ns_hit if x == s]
            key_hit = [x for x in key_hit if x == s]
        hits = [("namespace", x) for x in ns_hit] + [("block", x) for x in key_hit]
        if not hits:
            not_found.append(raw)
        elif len(hits) > 1:
            shown = ", ".join(f"{kind} {x[:16]}" for kind, x in hits[:5])
            raise TargetError(f"target {raw!r} is ambiguous: it matches {shown}"
                              f"{' and more' if len(hits) > 5 else ''}; give more hex digits")
        elif hits[0][0] == "namespace":
            if hits[0][1] not in named_ns:
                named_ns.append(hits[0][1])
        elif hits[0][1] not in named_blocks:
            named_blocks.append(hits[0][1])

    going: set[str] = set()
    order: list[str] = []  # parents before children; reversed at the end (leaves first)

    def walk(root: str) -> None:
        stack = [root]
        while stack:
            k = stack.pop()
            if k in going:
                continue
            going.add(k)
            order.append(k)
            stack.extend(children.get(k, ()))

    in_ns: set[str] = set()
    for nid in named_ns:
        for k in by_ns.get(nid, ()):
            in_ns.add(k)
            walk(k)
    for k in named_blocks:
        walk(k)
    descendants = len(going - in_ns - set(named_blocks))
    ns_targets = []
    for nid in named_ns:
        ks = by_ns.get(nid, [])
        info = infos.get(nid)
        ns_targets.append(NamespaceTarget(nid, info.model_id if info else "", len(ks),
                                          sum(by_key[k].stored_nbytes for k in ks)))
    keys = tuple(reversed(order))
    return RemovalPlan(
        store=store, targets=given, namespaces=tuple(ns_targets), blocks=tuple(named_blocks),
        not_found=tuple(not_found), descendants=descendants, keys=keys,
        stored_bytes=sum(by_key[k].stored_nbytes for k in keys),
        raw_bytes=sum(by_key[k].raw_nbytes for k in keys),
    )


def _segment_files(segdir: str, sids: Iterable[int]) -> dict[int, int]:
    from kvstore.tiers import segments as seg

    out = {}
    for sid in set(sids):
        with contextlib.suppress(FileNotFoundError):
            out[sid] = os.stat(os.path.join(segdir, seg.segment_name(sid))).st_size
    return out


def execute_removal(plan: RemovalPlan) -> RemovalResult:
    """Remove the plan's blocks in one write transaction, then any child another process
    wrote under a removed block meanwhile (so the store stays prefix-closed)."""
    with open_disk(plan.store, readonly=False) as t:
        doomed = [bytes.fromhex(k) for k in plan.keys]
        recs = {k: t.get_record(k) for k in doomed}
        recs = {k: r for k, r in recs.items() if r is not None}
        segdir = os.path.join(t.path, "segments")
        before = _segment_files(segdir, (r.segment for r in recs.values()))
        removed = t.delete(list(recs)) if recs else 0
        freed = sum(r.stored_nbytes for r in recs.values())
        gone = set(doomed)
        late: list[bytes] = []
        for _ in range(8):  # children committed by another process while we planned
            extra = [r for r in t.records() if r.parent is not None and r.parent in gone
                     and r.key not in gone]
            if not extra:
                break
            before.update(_segment_files(segdir, (r.segment for r in extra)))
            # leaves first is not needed inside one transaction; descendants of these are
            # picked up by the next round
            n = t.delete([r.key for r in extra])
            late.extend(r.key for r in extra)
            removed += n
            freed += sum(r.stored_nbytes for r in extra)
            gone.update(r.key for r in extra)
        after = _segment_files(segdir, before)
        released = sum(size for sid, size in before.items() if sid not in after)
        dead = t.stats().dead_bytes
    return RemovalResult(plan, False, removed, len(late), tuple(k.hex() for k in late), freed,
                         released, dead)


def preview_removal(plan: RemovalPlan, *, dry_run: bool = True) -> RemovalResult:
    """The result of not executing ``plan`` (a dry run, or nothing to remove)."""
    with open_disk(plan.store, readonly=True) as t:
        dead = t.stats().dead_bytes
    return RemovalResult(plan, dry_run, 0, 0, (), 0, 0, dead)


def remove(path: str | os.PathLike[str] | None, targets: Iterable[str], *,
           dry_run: bool = False) -> RemovalResult:
    """:func:`plan_removal` then (unless ``dry_run``) :func:`execute_removal`."""
    plan = plan_removal(path, targets)
    if dry_run:
        return preview_removal(plan)
    return execute_removal(plan)


# -- findings (prune, verify) ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class FindingEntry:
    """One problem found (``kind`` as in :class:`kvstore.tiers.disk.Finding`)."""

    kind: str  # orphan_segment | temp_file | missing_segment | short_segment |
    #            checksum_mismatch | bad_record | bad_index | unknown_file
    path: str
    key: str | None  # the block (hex), for record findings
    detail: str
    fixed: bool
    nbytes: int  # file bytes (orphan_segment, temp_file, unknown_file), the block's stored
    #              bytes (record findings), 0 when not known (bad_index)


def _finding(f, nbytes: int = 0) -> FindingEntry:  # noqa: ANN001 - a disk Finding
    return FindingEntry(f.kind, f.path, None if f.key is None else f.key.hex(), f.detail,
                        bool(f.fixed), nbytes)


def _file_sizes(segdir: str) -> dict[str, int]:
    out = {}
    try:
        entries = list(os.scandir(segdir))
    except FileNotFoundError:
        return out
    for de in entries:
        with contextlib.suppress(FileNotFoundError):
            out[de.path] = de.stat(follow_symlinks=False).st_size
    return out


_FILE_KINDS = ("orphan_segment", "temp_file", "unknown_file")


def _entries(findings, sizes: dict[str, int], stored: dict[bytes, int]) -> list[FindingEntry]:  # noqa: ANN001
    out = []
    for f in findings:
        if f.kind in _FILE_KINDS:
            n = sizes.get(f.path, 0)
        else:
            n = stored.get(f.key, 0) if f.key is not None else 0
        out.append(_finding(f, n))
    return out


# -- prune -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PruneResult:
    store: str
    dry_run: bool
    grace_s: float
    findings: tuple[FindingEntry, ...]
    removed: int  # findings fixed
    freed_bytes: int  # file bytes removed (orphan segments, temp files)


def prune(path: str | os.PathLike[str] | None = None, *, dry_run: bool = False,
          grace_s: float = DEFAULT_GRACE_S) -> PruneResult:
    """Remove orphan segment files and temp files older than ``grace_s``, records whose
    payload is missing or cut off, undecodable records, and rebuild inconsistent side
    indexes (``DiskTier.check(fix=True, verify_data=False)``; no block data is read — use
    :func:`verify` for checksums). ``dry_run`` only reports."""
    if grace_s < 0:
        raise AdminError(f"grace must be >= 0 seconds, got {grace_s}")
    with open_disk(path, readonly=dry_run) as t, quiet_disk_log():
        segdir = os.path.join(t.path, "segments")
        sizes = _file_sizes(segdir)
        stored = {r.key: r.stored_nbytes for r in t.records()}
        found = t.check(fix=not dry_run, grace_s=grace_s, verify_data=False)
        store = t.path
    entries = _entries(found, sizes, stored)
    fixed = [e for e in entries if e.fixed]
    freed = sum(e.nbytes for e in fixed if e.kind in ("orphan_segment", "temp_file"))
    return PruneResult(store, dry_run, float(grace_s), tuple(entries), len(fixed), freed)


# -- verify ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class VerifyResult:
    store: str
    fix: bool
    blocks_checked: int
    bytes_checked: int  # raw bytes read back and checksummed
    segments_checked: int
    findings: tuple[FindingEntry, ...]
    unfixed: int  # findings not fixed: non-zero exit status

    @property
    def ok(self) -> bool:
        return self.unfixed == 0


#: ``progress(blocks_done, blocks_total, bytes_done, bytes_total)``
VerifyProgress = Callable[[int, int, int, int], None]


def verify(path: str | os.PathLike[str] | None = None, *, fix: bool = False,
           grace_s: float = DEFAULT_GRACE_S,
           progress: VerifyProgress | None = None) -> VerifyResult:
    """Check the whole store: the index against the segment files (missing or cut-off
    segments, segment headers listing each block at its recorded offset, orphan and temp
    files older than ``grace_s``, side-index consistency) and the checksum of every block,
    read back in full. With ``fix``, bad records are dropped (only if they are still the
    ones found bad), orphans unlinked and side indexes rebuilt; a block that a concurrent
    writer moved meanwhile is verified again at its new place, not dropped."""
    from kvstore.tiers import segments as seg
    from kvstore.tiers.disk import ReadStatus

    with open_disk(path, readonly=True) as ro, quiet_disk_log():
        segdir = os.path.join(ro.path, "segments")
        sizes = _file_sizes(segdir)
        rw_cm = open_disk(ro.path, readonly=False) if fix else None
        rw = rw_cm.__enter__() if rw_cm is not None else None
        try:
            snapshot = list(ro.records())
            # 1. structure (no data read): missing/short segments, orphans, temps, indexes
            structural = (rw or ro).check(fix=fix, grace_s=grace_s, verify_data=False)
            flagged = {f.key for f in structural if f.key is not None}
            findings = _entries(structural, sizes,
                                {r.key: r.stored_nbytes for r in snapshot if r.key in flagged})
            # 2. every remaining block: header agreement and checksum
            recs = [r for r in snapshot if r.key not in flagged]
            recs.sort(key=lambda r: (r.segment, r.offset))
            total_blocks = len(recs)
            total_bytes = sum(r.raw_nbytes for r in recs)
            done_blocks = done_bytes = 0
            if progress is not None:
                progress(0, total_blocks, 0, total_bytes)
            headers: dict[int, dict[str, tuple[int, int]] | str | None] = {}
            scratch = torch.empty(max([min(_VERIFY_BATCH_BYTES, total_bytes)]
                                      + [r.raw_nbytes for r in recs]), dtype=torch.uint8)
            i = 0
            while i < len(recs):
                batch = []
                nbytes = 0
                while i < len(recs) and (not batch or nbytes + recs[i].raw_nbytes
                                         <= _VERIFY_BATCH_BYTES):
                    batch.append(recs[i])
                    nbytes += recs[i].raw_nbytes
                    i += 1
                todo = []
                for r in batch:
                    bad = _header_problem(headers, segdir, r, seg)
                    if bad is None:
                        todo.append(r)
                    else:
                        findings.extend(_confirm_header_problem(ro, rw, r, bad, segdir, seg))
                dsts, off = [], 0
                for r in todo:
                    dsts.append(scratch[off:off + r.raw_nbytes])
                    off += r.raw_nbytes
                statuses = ro.read_many([r.key for r in todo], dsts) if todo else []
                for r, status in zip(todo, statuses, strict=True):
                    if status is not ReadStatus.OK:
                        f = _confirm_damage(ro, rw, r, segdir, seg)
                        if f is not None:
                            findings.append(f)
                done_blocks += len(batch)
                done_bytes += nbytes
                if progress is not None:
                    progress(done_blocks, total_blocks, done_bytes, total_bytes)
        finally:
            if rw_cm is not None:
                rw_cm.__exit__(None, None, None)
        store = ro.path
    unfixed = sum(1 for f in findings if not f.fixed)
    return VerifyResult(store, fix, total_blocks, total_bytes,
                        len({r.segment for r in recs}), tuple(findings), unfixed)


def _header_problem(headers: dict, segdir: str, r, seg) -> str | None:  # noqa: ANN001
    h = headers.get(r.segment, False)
    if h is False:
        path = os.path.join(segdir, seg.segment_name(r.segment))
        try:
            obj, start, _ = seg.read_header(path)
            h = seg.header_tensors(obj, start)
        except FileNotFoundError:
            h = None  # moved or removed meanwhile: the read below decides
        except (OSError, seg.SegmentFormatError) as e:
            h = f"segment header unreadable: {e}"
        headers[r.segment] = h
    if h is None:
        return None
    if isinstance(h, str):
        return h
    if h.get(r.key.hex()) != (r.offset, r.stored_nbytes):
        return "segment header does not list this block at the recorded offset"
    return None


def _same_place(cur, r) -> bool:  # noqa: ANN001
    return cur is not None and (cur.segment, cur.offset) == (r.segment, r.offset)


def _confirm_header_problem(ro, rw, r, detail: str, segdir: str, seg) -> list[FindingEntry]:  # noqa: ANN001
    cur = ro.get_record(r.key)
    if not _same_place(cur, r):
        return []  # removed or moved meanwhile
    path = os.path.join(segdir, seg.segment_name(r.segment))
    fixed = False
    if rw is not None:
        rw.delete([r.key])  # a block not listed in its segment cannot be moved by compaction
        fixed = rw.get_record(r.key) is None
    return [FindingEntry("bad_record", path, r.key.hex(), detail, fixed, r.stored_nbytes)]


def _classify(r, segdir: str, seg) -> tuple[str, str]:  # noqa: ANN001
    path = os.path.join(segdir, seg.segment_name(r.segment))
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing_segment", f"segment file {path} is missing"
    if r.offset + r.stored_nbytes > size:
        return "short_segment", (f"segment has {size} bytes; block at {r.offset}+"
                                 f"{r.stored_nbytes} is cut off")
    return "checksum_mismatch", "the block's bytes do not match its checksum"


def _confirm_damage(ro, rw, r, segdir: str, seg) -> FindingEntry | None:  # noqa: ANN001
    """A read failed: was it damage, or did another process remove/move the block?"""
    from kvstore.tiers.disk import ReadStatus

    cur = ro.get_record(r.key)
    if cur is None:
        return None  # removed meanwhile
    if not _same_place(cur, r):  # moved (compaction): verify it at its new place
        dst = torch.empty(cur.raw_nbytes, dtype=torch.uint8)
        if ro.read_into(r.key, dst) is ReadStatus.OK:
            return None
        r = cur
    kind, detail = _classify(r, segdir, seg)
    path = os.path.join(segdir, seg.segment_name(r.segment))
    fixed = False
    if rw is not None:
        # a read through a writable tier drops the entry if (and only if) it is still the
        # damaged record; a block rewritten meanwhile reads OK and stays
        dst = torch.empty(r.raw_nbytes, dtype=torch.uint8)
        if rw.read_into(r.key, dst) is ReadStatus.OK:
            return None
        fixed = not _same_place(rw.get_record(r.key), r)
    return FindingEntry(kind, path, r.key.hex(), detail, fixed, r.stored_nbytes)


# -- compact -----------------------------------------------------------------------------------

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
