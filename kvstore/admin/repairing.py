"""The repair plan of a ``verify`` (:class:`RepairPlan`: what fixing its findings does) and
:func:`repair`, which carries it out, judging each item again first so that nothing changes
for a problem that is gone meanwhile."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.admin.common import open_disk, quiet_disk_log, refuse_if_served
from kvstore.admin.findings import FindingEntry, entry_block_id
from kvstore.admin.reachability import late_entries, remove_unreachable

if TYPE_CHECKING:
    from kvstore.admin.verification import VerifyResult
    from kvstore.tiers.disk import DiskTier

__all__ = ["RepairPlan", "plan_repair", "repair"]


@dataclass(frozen=True, slots=True)
class RepairPlan:
    """What fixing a :func:`~kvstore.admin.verification.verify`'s findings does;
    ``kvstore verify --fix`` shows it and asks before :func:`repair` carries it out."""

    drop_blocks: int  # damaged blocks whose records go (they become misses)
    drop_bytes: int
    unreachable_blocks: int  # blocks no lookup can reach (below a missing or dropped block)
    unreachable_bytes: int
    repair_blocks: int  # intact blocks whose segment header is damaged: rewritten elsewhere
    repair_bytes: int
    repair_segments: int  # segments with a damaged header
    remove_files: int  # orphan segments and temp files
    remove_file_bytes: int
    rebuild_index: bool  # side indexes are rebuilt from the block records
    young_unreachable: int  # unreachable blocks written less than grace ago: left alone
    chmod_paths: int = 0  # files and directories more open than the store promises

    @property
    def empty(self) -> bool:
        return not (self.drop_blocks or self.unreachable_blocks or self.repair_blocks
                    or self.remove_files or self.rebuild_index or self.chmod_paths)


def plan_repair(findings: Iterable[FindingEntry], young: int) -> RepairPlan:
    """The plan for the findings not fixed yet; ``young``: unreachable blocks left alone."""
    todo = [f for f in findings if not f.fixed and f.action != "none"]
    drop = [f for f in todo if f.action == "drop" and f.kind != "unreachable"]
    unreach = [f for f in todo if f.kind == "unreachable"]
    rep = [f for f in todo if f.action == "repair"]
    files = [f for f in todo if f.action == "remove"]
    return RepairPlan(len(drop), sum(f.nbytes for f in drop), len(unreach),
                      sum(f.nbytes for f in unreach), len(rep), sum(f.nbytes for f in rep),
                      len({f.path for f in rep}), len(files), sum(f.nbytes for f in files),
                      any(f.action == "rebuild" for f in todo), young,
                      sum(1 for f in todo if f.action == "chmod"))


@dataclass(frozen=True, slots=True)
class _Todo:
    """A plan's findings, sorted by what fixing each takes."""

    drops: tuple[FindingEntry, ...]  # damaged records to drop
    files: frozenset[str]  # files to remove
    rebuild: bool  # side indexes to rebuild
    rewrite: tuple[bytes, ...]  # blocks of damaged headers to rewrite (block ids)
    unreachable: tuple[bytes, ...]  # blocks no lookup can reach (block ids)
    chmod: tuple[str, ...] = ()  # paths more open than the store promises

    @classmethod
    def of(cls, todo: list[FindingEntry]) -> _Todo:
        return cls(
            drops=tuple(f for f in todo if f.action == "drop" and f.kind != "unreachable"
                        and f.key is not None),
            files=frozenset(f.path for f in todo if f.action == "remove"),
            rebuild=any(f.action == "rebuild" for f in todo),
            rewrite=tuple(entry_block_id(f) for f in todo
                          if f.action == "repair" and f.key is not None),
            unreachable=tuple(entry_block_id(f) for f in todo if f.kind == "unreachable"),
            chmod=tuple(f.path for f in todo if f.action == "chmod"),
        )


@dataclass(slots=True)
class _Fixes:
    """What this repair did so far."""

    keys: set[bytes] = dataclasses.field(default_factory=set)  # block ids whose finding is settled
    dropped: set[bytes] = dataclasses.field(default_factory=set)  # records removed by this pass
    notes: dict[bytes, str] = dataclasses.field(default_factory=dict)  # why a block was kept
    files: set[str] = dataclasses.field(default_factory=set)  # files removed
    modes: set[str] = dataclasses.field(default_factory=set)  # paths now as promised
    index_left: bool = False  # side indexes still inconsistent
    late: list[FindingEntry] = dataclasses.field(default_factory=list)  # blocks beyond the plan


def repair(result: VerifyResult) -> VerifyResult:
    """Carry out ``result.plan`` (the findings of a read-only
    :func:`~kvstore.admin.verification.verify`) and return the result with ``fixed`` set.
    Each item is judged again first, so that nothing changes for a problem that is gone
    meanwhile: a record is dropped only if it is still damaged (a block that a concurrent
    compaction moved is verified at its new place), a block of a damaged header is rewritten
    only if its header still does not list it and its bytes verify (if they do not, it is
    dropped), an unreachable block is removed only if still no lookup can reach it (with any
    block written below it meanwhile). Nothing outside the plan is touched."""
    todo = [f for f in result.findings if not f.fixed and f.action != "none"]
    if not todo:
        return dataclasses.replace(result, fix=True)
    refuse_if_served(result.store, "fixing it")
    plan = _Todo.of(todo)
    fixes = _Fixes()
    with open_disk(result.store, readonly=False) as rw, quiet_disk_log():
        recheck = _fix_structure(rw, plan, result.grace_s, fixes)
        _recheck_damaged(rw, recheck, fixes)
        _rewrite_headers(rw, plan.rewrite, fixes)
        _remove_unreachable(rw, plan.unreachable, fixes)
        _set_modes(rw.path, plan.chmod, fixes)
    findings = [_settled(f, fixes) for f in result.findings] + fixes.late
    unfixed = sum(1 for f in findings if not f.fixed)
    return dataclasses.replace(result, fix=True, findings=tuple(findings), unfixed=unfixed)


def _fix_structure(rw: DiskTier, plan: _Todo, grace_s: float, fixes: _Fixes) -> set[bytes]:
    """Step 1, structure as planned: records without payload, undecodable records, files,
    side indexes (check finds each again first and fixes it only if still there; it names
    blocks by key, so the planned ones are matched by key). Returns the planned drops that
    check did not find: damaged blocks, to read again."""
    from kvstore.tiers.disk import FixScope

    planned = {bytes.fromhex(f.key): entry_block_id(f) for f in plan.drops}
    found = rw.check(fix=True, grace_s=grace_s, verify_data=False,
                     scope=FixScope(frozenset(planned), plan.files, plan.rebuild))
    recheck = {entry_block_id(f) for f in plan.drops}
    for f in found:
        bk = planned.get(bytes(f.key)) if f.key is not None else None
        if bk is not None:
            recheck.discard(bk)
            if f.fixed:
                fixes.keys.add(bk)
                fixes.dropped.add(bk)
        elif f.path in plan.files and f.fixed:
            fixes.files.add(f.path)
        elif f.kind == "bad_index" and not f.fixed:
            fixes.index_left = True
    return recheck


def _recheck_damaged(rw: DiskTier, recheck: set[bytes], fixes: _Fixes) -> None:
    """Step 2, damaged blocks: a read through a writable tier drops the record if (and only
    if) it is still the damaged one; a block rewritten or moved meanwhile reads OK."""
    from kvstore.tiers.disk import ReadStatus

    for k in sorted(recheck):
        key, ns = (k[32:], k[:32]) if len(k) == 64 else (k, None)
        if len(key) != 32:
            continue  # a malformed index key: only check drops it (step 1)
        r = rw.get_record(key, namespace_id=ns)
        if r is None:
            fixes.keys.add(k)
            continue
        import torch

        dst = torch.empty(r.raw_nbytes, dtype=torch.uint8)
        if rw.read_into(key, dst, namespace_id=ns) is ReadStatus.OK:
            fixes.keys.add(k)
            fixes.notes[k] = "reads OK now (rewritten or moved meanwhile): kept"
        elif rw.get_record(key, namespace_id=ns) is None:
            fixes.keys.add(k)
            fixes.dropped.add(k)


def _rewrite_headers(rw: DiskTier, rewrite: tuple[bytes, ...], fixes: _Fixes) -> None:
    """Step 3, intact blocks of damaged headers: into fresh segments."""
    if not rewrite:
        return
    res = rw.rewrite_unlisted(list(rewrite))
    fixes.keys.update(res.rewritten, res.unchanged, res.dropped)
    fixes.dropped.update(res.dropped)
    for k in res.dropped:
        fixes.notes[k] = "its bytes failed the checksum when rewritten: dropped"


def _remove_unreachable(rw: DiskTier, unreachable: tuple[bytes, ...], fixes: _Fixes) -> None:
    """Step 4, blocks no lookup can reach, and any block orphaned by this pass."""
    gone, late, again = remove_unreachable(rw, unreachable, fixes.dropped)
    fixes.keys.update(gone, again)
    for k in again:
        fixes.notes[k] = "a lookup can reach it again (its parent was written meanwhile): kept"
    fixes.late = late_entries(late, os.path.join(rw.path, "segments"))


def _set_modes(store: str, paths: tuple[str, ...], fixes: _Fixes) -> None:
    """Step 5, loose modes: each path set to the store's (opening the store writable has
    set its directories' already); paths of other users are left as they are."""
    from kvstore.filemodes import modes_of, tighten

    modes = modes_of(store)
    for p in paths:
        try:
            if tighten(p, modes):
                fixes.modes.add(p)
        except OSError:
            continue


def _settled(f: FindingEntry, fixes: _Fixes) -> FindingEntry:
    """``f`` with ``fixed`` (and a note on why a block was kept or dropped) as repaired."""
    if f.fixed or f.action == "none":
        return f
    if f.action == "remove":
        ok = f.path in fixes.files
    elif f.action == "chmod":
        ok = f.path in fixes.modes
    elif f.action == "rebuild":
        ok = not fixes.index_left
    else:
        ok = f.key is not None and entry_block_id(f) in fixes.keys
    note = fixes.notes.get(entry_block_id(f)) if f.key is not None else None
    return dataclasses.replace(f, fixed=ok, detail=f"{f.detail}; {note}" if note else f.detail)
