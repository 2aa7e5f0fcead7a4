"""Changing a store while engines use it: ``rm`` (namespaces and blocks, with their
descendants), ``prune`` (orphan files, temp files, records without payload, blocks no lookup
can reach), ``verify`` (checksums of every block, index/segment agreement, unreachable blocks;
its result carries a repair plan that :func:`repair` carries out) and ``compact``.

Every change goes through :class:`~kvstore.tiers.disk.DiskTier`, which takes LMDB's write
lock like every engine and unlinks a payload file only after the transaction that removed its
last record has committed; readers in other processes that find a file gone re-read the
record (compaction) or see a miss (removal) — never wrong bytes. A store that a
``kvstore serve`` daemon serves is changed through the daemon (``rm``) or not at all
(``prune``, ``repair``, ``compact`` raise :class:`~kvstore.admin.common.StoreServedError`):
its warm tier would keep serving what the disk no longer holds.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore.admin.common import AdminError, open_disk, quiet_disk_log, refuse_if_served

__all__ = [
    "CompactReport",
    "FindingEntry",
    "NamespaceTarget",
    "PruneResult",
    "RemovalPlan",
    "RepairPlan",
    "RemovalResult",
    "TargetError",
    "VerifyResult",
    "compact",
    "execute_removal",
    "plan_removal",
    "preview_removal",
    "prune",
    "remove",
    "repair",
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
    daemon: str | None = None  # socket of the daemon the removal went through (it serves
    #                            the store: its memory tier dropped the blocks too)


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
    from kvstore.tiers.disk import segments as seg

    out = {}
    for sid in set(sids):
        with contextlib.suppress(FileNotFoundError):
            out[sid] = os.stat(os.path.join(segdir, seg.segment_name(sid))).st_size
    return out


def execute_removal(plan: RemovalPlan) -> RemovalResult:
    """Remove the plan's blocks in one write transaction, then any child another process
    wrote under a removed block meanwhile (so the store stays prefix-closed).

    When a ``kvstore serve`` daemon serves the store, the removal goes through it instead:
    its warm tier would otherwise keep serving the blocks (and write dirty ones back)."""
    from kvstore.admin.common import serving_socket

    sock = serving_socket(plan.store)
    if sock is not None:
        return _remove_through_daemon(plan, sock)
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


def _remove_through_daemon(plan: RemovalPlan, sock: str) -> RemovalResult:
    """The plan, carried out by the daemon at ``sock``: whole namespaces by id (blocks only
    in its memory go too), other blocks by key, per namespace, leaves first (its store drops
    them from memory and disk, with their cached descendants). Blocks a client holds pinned
    at that moment stay."""
    from kvstore.admin.live import daemon_remove

    with open_disk(plan.store, readonly=True) as t:
        recs = {k: t.get_record(bytes.fromhex(k)) for k in plan.keys}
        recs = {k: r for k, r in recs.items() if r is not None}
        segdir = os.path.join(t.path, "segments")
        before = _segment_files(segdir, (r.segment for r in recs.values()))
    whole = {n.namespace_id for n in plan.namespaces}
    by_ns: dict[str, list[str]] = {}
    for k in plan.keys:  # leaves first, as planned
        r = recs.get(k)
        if r is not None and r.namespace_id.hex() not in whole:
            by_ns.setdefault(r.namespace_id.hex(), []).append(k)
    removed = 0
    for nid in sorted(whole):
        removed += daemon_remove(sock, nid, None)
    for nid, keys in by_ns.items():
        removed += daemon_remove(sock, nid, keys)
    with open_disk(plan.store, readonly=True) as t:
        left = {k for k in recs if t.get_record(bytes.fromhex(k)) is not None}
        after = _segment_files(segdir, before)
        dead = t.stats().dead_bytes
    freed = sum(r.stored_nbytes for k, r in recs.items() if k not in left)
    released = sum(size for sid, size in before.items() if sid not in after)
    return RemovalResult(plan, False, removed, 0, (), freed, released, dead, sock)


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

#: what fixing a finding does: ``drop`` its record (the block becomes a miss), ``repair`` it
#: (rewrite the block into a fresh segment), ``remove`` the file, ``rebuild`` the side indexes,
#: or ``none`` (files that are not the store's are never touched)
_ACTIONS = {"orphan_segment": "remove", "temp_file": "remove", "unknown_file": "none",
            "bad_index": "rebuild", "bad_header": "repair"}
_FILE_KINDS = ("orphan_segment", "temp_file", "unknown_file")


@dataclass(frozen=True, slots=True)
class FindingEntry:
    """One problem found (``kind`` as in :class:`kvstore.tiers.disk.Finding`, plus
    ``unreachable``) and what fixing it does (``action``)."""

    kind: str  # orphan_segment | temp_file | missing_segment | short_segment |
    #            checksum_mismatch | bad_record | bad_header | unreachable | bad_index |
    #            unknown_file
    path: str
    key: str | None  # the block (hex), for record findings
    detail: str
    fixed: bool
    nbytes: int  # file bytes (orphan_segment, temp_file, unknown_file), the block's stored
    #              bytes (record findings), 0 when not known (bad_index)
    action: str = "none"  # drop | repair | remove | rebuild | none
    namespace_id: str | None = None  # the block's namespace (hex), for record findings


def _bk(namespace_id: bytes, key: bytes) -> bytes:
    """A block's identity: namespace id ‖ key (every namespace has a key space of its own;
    this is also the disk index's LMDB key, ``kvstore.tiers.disk.index.dbkey``)."""
    return namespace_id + key


def _entry_bk(f: FindingEntry) -> bytes:
    """A record finding's block identity (:func:`_bk`), or its bare key when the namespace is
    not known (an undecodable record)."""
    assert f.key is not None
    key = bytes.fromhex(f.key)
    return key if f.namespace_id is None else bytes.fromhex(f.namespace_id) + key


def _finding(f, nbytes: int = 0, namespace_id: bytes | None = None) -> FindingEntry:  # a disk Finding
    key = None if f.key is None else bytes(f.key).hex()
    return FindingEntry(f.kind, f.path, key, f.detail, bool(f.fixed), nbytes,
                        _ACTIONS.get(f.kind, "drop"),
                        None if namespace_id is None else namespace_id.hex())


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


def _entries(findings, sizes: dict[str, int], recs: dict[bytes, object]) -> list[FindingEntry]:
    """Findings of ``DiskTier.check`` as entries; ``recs``: block key -> its record (for the
    stored bytes and the namespace)."""
    out = []
    for f in findings:
        r = recs.get(bytes(f.key)) if f.key is not None else None
        if f.kind in _FILE_KINDS:
            out.append(_finding(f, sizes.get(f.path, 0)))
        elif r is not None:
            out.append(_finding(f, r.stored_nbytes, r.namespace_id))
        else:
            out.append(_finding(f))
    return out


def _check_grace(grace_s: float) -> None:
    if not grace_s >= 0:  # also refuses NaN
        raise AdminError(f"grace must be a number of seconds >= 0, got {grace_s}")


# -- unreachable blocks ------------------------------------------------------------------------

def _unreachable(recs: Iterable, gone: set[bytes], segdir: str, *, now: float,
                 grace_s: float, why_gone: str) -> tuple[list[FindingEntry], int]:
    """Blocks that no lookup can reach, because their parent is not in the index (or is in
    ``gone``: dropped by this pass), with their whole subtrees, as findings (action ``drop``);
    and how many were left alone because the block whose parent is missing was written less
    than ``grace_s`` ago (its parent may be a write in flight in another process). Blocks in
    ``gone`` are not listed."""
    from kvstore.tiers.disk import segments as seg

    present = {_bk(r.namespace_id, r.key): r for r in recs}
    present = {k: r for k, r in present.items() if k not in gone}
    children: dict[bytes, list[bytes]] = {}
    for k, r in present.items():
        if r.parent is not None:  # a chain never leaves its namespace
            children.setdefault(_bk(r.namespace_id, r.parent), []).append(k)
    out: list[FindingEntry] = []
    young = 0
    seen: set[bytes] = set()
    for root in sorted(present):
        r = present[root]
        if r.parent is None:
            continue
        p = _bk(r.namespace_id, r.parent)
        if p in present:
            continue
        if p in gone or r.parent in gone:
            head = f"its parent {r.parent.hex()[:16]} is {why_gone}"
        elif now - r.created < grace_s:
            if root not in seen:
                seen.add(root)
                young += 1 + _subtree_size(root, children, seen)
            continue
        else:
            head = f"its parent {r.parent.hex()[:16]} is not in the store"
        stack = [root]
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            b = present[k]
            detail = (f"{head}: no lookup can reach this block" if k == root else
                      f"below block {r.key.hex()[:16]}, whose parent is missing: no lookup "
                      "can reach this block")
            out.append(FindingEntry("unreachable", os.path.join(segdir, seg.segment_name(b.segment)),
                                    b.key.hex(), detail, False, b.stored_nbytes, "drop",
                                    b.namespace_id.hex()))
            stack.extend(children.get(k, ()))
    return out, young


def _subtree_size(root: bytes, children: dict[bytes, list[bytes]], seen: set[bytes]) -> int:
    n = 0
    stack = list(children.get(root, ()))
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        n += 1
        stack.extend(children.get(k, ()))
    return n


def _remove_unreachable(t, planned: Iterable[bytes], removed: set[bytes]) -> tuple[set[bytes], list, set[bytes]]:
    """Delete the ``planned`` blocks that still no lookup can reach, and every block now below
    one of them or below a block in ``removed`` (written meanwhile, or orphaned by this pass).
    Returns (keys gone now, records of the removed blocks that were not planned, planned keys
    that a lookup can reach again: their parent was written meanwhile)."""
    planned = set(planned)
    gone: set[bytes] = set()
    late: list = []
    reachable: set[bytes] = set()
    roots = planned | removed
    for round_ in range(8):  # children committed by another process while we worked
        recs = {_bk(r.namespace_id, r.key): r for r in t.records()}
        children: dict[bytes, list[bytes]] = {}
        for k, r in recs.items():
            if r.parent is not None:
                children.setdefault(_bk(r.namespace_id, r.parent), []).append(k)
        cut: dict[bytes, bool] = {}

        def unreachable(k: bytes, recs=recs, cut=cut) -> bool:
            path = []
            while k not in cut:
                r = recs.get(k)
                if r is None:
                    cut[k] = True
                    break
                if r.parent is None:
                    cut[k] = False
                    break
                path.append(k)
                k = _bk(r.namespace_id, r.parent)
                if len(path) > len(recs):  # a cycle of corrupt records: reachable from nowhere
                    cut[k] = True
                    break
            val = cut[k]
            for x in path:
                cut[x] = val
            return val

        cands: set[bytes] = set()
        stack = [k for k in roots if k in recs] + [c for k in roots for c in children.get(k, ())]
        while stack:
            k = stack.pop()
            if k in cands:
                continue
            cands.add(k)
            stack.extend(children.get(k, ()))
        doomed = [k for k in cands if k not in gone and unreachable(k)]
        if round_ == 0:
            reachable = {k for k in planned if k in recs and not unreachable(k)}
        if not doomed:
            break
        by_ns: dict[bytes, list[bytes]] = {}
        for k in doomed:
            by_ns.setdefault(k[:32], []).append(k[32:])
        for ns, keys in by_ns.items():  # DiskTier.delete keeps the children/LRU dbs right
            t.delete(keys, namespace_id=ns)
        gone.update(k for k in doomed if t.get_record(k[32:], namespace_id=k[:32]) is None)
        late.extend(recs[k] for k in doomed if k not in planned)
        roots = set(doomed)
    return gone, late, reachable


# -- prune -------------------------------------------------------------------------------------

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
    is read — use :func:`verify` for checksums). ``dry_run`` only reports."""
    _check_grace(grace_s)
    if not dry_run:
        refuse_if_served(path, "pruning")
    with open_disk(path, readonly=dry_run) as t, quiet_disk_log():
        segdir = os.path.join(t.path, "segments")
        sizes = _file_sizes(segdir)
        before = {r.key: r for r in t.records()}
        found = t.check(fix=not dry_run, grace_s=grace_s, verify_data=False)
        entries = _entries(found, sizes, before)
        gone = {_entry_bk(e) for e in entries
                if e.key is not None and e.action == "drop" and (dry_run or e.fixed)}
        unreach, young = _unreachable(t.records(), gone, segdir, now=time.time(),
                                      grace_s=grace_s, why_gone="dropped by this prune")
        if not dry_run and unreach:
            done, late, _ = _remove_unreachable(t, (_entry_bk(e) for e in unreach), gone)
            unreach = [dataclasses.replace(e, fixed=_entry_bk(e) in done)
                       for e in unreach] + _late_entries(late, segdir)
        store = t.path
    entries += unreach
    fixed = [e for e in entries if e.fixed]
    freed = sum(e.nbytes for e in fixed if e.kind in ("orphan_segment", "temp_file"))
    counted = [e for e in unreach if e.fixed or dry_run]
    return PruneResult(store, dry_run, float(grace_s), tuple(entries), len(fixed), freed,
                       len(counted), sum(e.nbytes for e in counted), young)


def _late_entries(late: Iterable, segdir: str) -> list[FindingEntry]:
    """Findings for blocks removed with the planned ones although not in the plan: written
    meanwhile below one of them, or orphaned by this pass."""
    from kvstore.tiers.disk import segments as seg

    return [FindingEntry("unreachable", os.path.join(segdir, seg.segment_name(r.segment)),
                         r.key.hex(), "below a block removed by this pass (written meanwhile, "
                         "or its parent was dropped now): no lookup can reach this block", True,
                         r.stored_nbytes, "drop", r.namespace_id.hex()) for r in late]


# -- verify ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RepairPlan:
    """What fixing a :func:`verify`'s findings does; ``kvstore verify --fix`` shows it and
    asks before :func:`repair` carries it out."""

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

    @property
    def empty(self) -> bool:
        return not (self.drop_blocks or self.unreachable_blocks or self.repair_blocks
                    or self.remove_files or self.rebuild_index)


def _plan(findings: Iterable[FindingEntry], young: int) -> RepairPlan:
    todo = [f for f in findings if not f.fixed and f.action != "none"]
    drop = [f for f in todo if f.action == "drop" and f.kind != "unreachable"]
    unreach = [f for f in todo if f.kind == "unreachable"]
    rep = [f for f in todo if f.action == "repair"]
    files = [f for f in todo if f.action == "remove"]
    return RepairPlan(len(drop), sum(f.nbytes for f in drop), len(unreach),
                      sum(f.nbytes for f in unreach), len(rep), sum(f.nbytes for f in rep),
                      len({f.path for f in rep}), len(files), sum(f.nbytes for f in files),
                      any(f.action == "rebuild" for f in todo), young)


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


#: ``progress(blocks_done, blocks_total, bytes_done, bytes_total)``
VerifyProgress = Callable[[int, int, int, int], None]


def verify(path: str | os.PathLike[str] | None = None, *, fix: bool = False,
           grace_s: float = DEFAULT_GRACE_S,
           progress: VerifyProgress | None = None) -> VerifyResult:
    """Check the whole store, read-only: the index against the segment files (missing or
    cut-off segments, segment headers listing each block at its recorded offset, orphan and
    temp files older than ``grace_s``, side-index consistency), the checksum of every block,
    read back in full, and blocks that no lookup can reach. The result's ``plan`` says what
    fixing the findings does; ``fix`` carries it out at once (:func:`repair`): damaged blocks
    and unreachable ones are dropped, intact blocks of a damaged segment header are rewritten
    into a fresh segment, orphans are unlinked and side indexes rebuilt."""
    from kvstore.admin.common import check_store
    from kvstore.tiers.disk import ReadStatus
    from kvstore.tiers.disk import segments as seg
    from kvstore.tiers.disk.check import Listing, listing_problem, segment_listing
    from kvstore.tiers.disk.guard import require_intact

    _check_grace(grace_s)
    if fix:  # before the long read, not after it
        refuse_if_served(path, "fixing it")
    # every page of the index, whatever its size (opening walks only small indexes in full)
    require_intact(os.path.join(check_store(path), "index"))
    with open_disk(path, readonly=True) as ro, quiet_disk_log():
        segdir = os.path.join(ro.path, "segments")
        sizes = _file_sizes(segdir)
        snapshot = list(ro.records())
        # 1. structure (no data read): missing/short segments, orphans, temps, indexes
        structural = ro.check(fix=False, grace_s=grace_s, verify_data=False)
        flagged = {bytes(f.key) for f in structural if f.key is not None}
        findings = _entries(structural, sizes, {r.key: r for r in snapshot if r.key in flagged})
        # 2. every remaining block: checksum, and header agreement
        recs = [r for r in snapshot if r.key not in flagged]
        recs.sort(key=lambda r: (r.segment, r.offset))
        total_blocks = len(recs)
        total_bytes = sum(r.raw_nbytes for r in recs)
        done_blocks = done_bytes = 0
        if progress is not None:
            progress(0, total_blocks, 0, total_bytes)
        listings: dict[int, Listing] = {}
        import torch  # reading blocks back needs tensors; listing and planning do not

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
            dsts, off = [], 0
            for r in batch:
                dsts.append(scratch[off:off + r.raw_nbytes])
                off += r.raw_nbytes
            # the header does not matter to a read (records hold the offsets): blocks of a
            # damaged header are read too, and kept if their bytes verify
            statuses = _read_batch(ro, batch, dsts)
            for r, status in zip(batch, statuses, strict=True):
                if r.segment not in listings:
                    listings[r.segment] = segment_listing(segdir, r.segment)
                bad = listing_problem(listings[r.segment], r.key, r.offset, r.stored_nbytes)
                if status is ReadStatus.OK:
                    if bad is not None:
                        findings.extend(_confirm_header_problem(ro, r, bad, segdir, seg))
                    continue
                f = _confirm_damage(ro, r, segdir, seg, bad)
                if f is not None:
                    findings.append(f)
            done_blocks += len(batch)
            done_bytes += nbytes
            if progress is not None:
                progress(done_blocks, total_blocks, done_bytes, total_bytes)
        # 3. blocks below a missing block, or below one that fixing drops
        gone = {_entry_bk(f) for f in findings if f.key is not None and f.action == "drop"}
        unreach, young = _unreachable(snapshot, gone, segdir, now=time.time(), grace_s=grace_s,
                                      why_gone="dropped by this fix (damaged)")
        # a block that goes because no lookup can reach it is not worth a rewrite
        doomed = {_entry_bk(f) for f in unreach}
        findings = [f for f in findings
                    if not (f.kind == "bad_header" and _entry_bk(f) in doomed)] + unreach
        store = ro.path
    unfixed = sum(1 for f in findings if not f.fixed)
    res = VerifyResult(store, False, total_blocks, total_bytes, len({r.segment for r in recs}),
                       tuple(findings), unfixed, float(grace_s), _plan(findings, young))
    return repair(res) if fix else res


def repair(result: VerifyResult) -> VerifyResult:
    """Carry out ``result.plan`` (the findings of a read-only :func:`verify`) and return the
    result with ``fixed`` set. Each item is judged again first, so that nothing changes for a
    problem that is gone meanwhile: a record is dropped only if it is still damaged (a block
    that a concurrent compaction moved is verified at its new place), a block of a damaged
    header is rewritten only if its header still does not list it and its bytes verify (if
    they do not, it is dropped), an unreachable block is removed only if still no lookup can
    reach it (with any block written below it meanwhile). Nothing outside the plan is touched."""
    from kvstore.tiers.disk import ReadStatus
    from kvstore.tiers.disk.check import FixScope, check_scoped, rewrite_unlisted

    todo = [f for f in result.findings if not f.fixed and f.action != "none"]
    if not todo:
        return dataclasses.replace(result, fix=True)
    refuse_if_served(result.store, "fixing it")
    drops = [f for f in todo if f.action == "drop" and f.kind != "unreachable" and f.key is not None]
    drop = {_entry_bk(f) for f in drops}
    files = frozenset(f.path for f in todo if f.action == "remove")
    rebuild = any(f.action == "rebuild" for f in todo)
    rewrite = [_entry_bk(f) for f in todo if f.action == "repair" and f.key is not None]
    unreachable = [_entry_bk(f) for f in todo if f.kind == "unreachable"]
    fixed_keys: set[bytes] = set()
    dropped: set[bytes] = set()  # records removed by this pass
    notes: dict[bytes, str] = {}
    with open_disk(result.store, readonly=False) as rw, quiet_disk_log():
        # 1. structure, as planned: records without payload, undecodable records, files,
        #    side indexes (check finds each again first and fixes it only if still there;
        #    it names blocks by key, so the planned ones are matched by key)
        planned = {bytes.fromhex(f.key): _entry_bk(f) for f in drops}
        found = check_scoped(rw, grace_s=result.grace_s,
                             scope=FixScope(frozenset(planned), files, rebuild))
        recheck = set(drop)
        files_fixed = set()
        index_left = False
        for f in found:
            bk = planned.get(bytes(f.key)) if f.key is not None else None
            if bk is not None:
                recheck.discard(bk)
                if f.fixed:
                    fixed_keys.add(bk)
                    dropped.add(bk)
            elif f.path in files and f.fixed:
                files_fixed.add(f.path)
            elif f.kind == "bad_index" and not f.fixed:
                index_left = True
        # 2. damaged blocks: a read through a writable tier drops the record if (and only if)
        #    it is still the damaged one; a block rewritten or moved meanwhile reads OK
        for k in sorted(recheck):
            key, ns = (k[32:], k[:32]) if len(k) == 64 else (k, None)
            if len(key) != 32:
                continue  # a malformed index key: only check drops it (step 1)
            r = rw.get_record(key, namespace_id=ns)
            if r is None:
                fixed_keys.add(k)
                continue
            import torch

            dst = torch.empty(r.raw_nbytes, dtype=torch.uint8)
            if rw.read_into(key, dst, namespace_id=ns) is ReadStatus.OK:
                fixed_keys.add(k)
                notes[k] = "reads OK now (rewritten or moved meanwhile): kept"
            elif rw.get_record(key, namespace_id=ns) is None:
                fixed_keys.add(k)
                dropped.add(k)
        # 3. intact blocks of damaged headers: into fresh segments
        rw_res = rewrite_unlisted(rw, rewrite) if rewrite else None
        if rw_res is not None:
            fixed_keys.update(rw_res.rewritten, rw_res.unchanged, rw_res.dropped)
            dropped.update(rw_res.dropped)
            for k in rw_res.dropped:
                notes[k] = "its bytes failed the checksum when rewritten: dropped"
        # 4. blocks no lookup can reach, and any block orphaned by this pass
        gone, late, again = _remove_unreachable(rw, unreachable, dropped)
        fixed_keys.update(gone, again)
        for k in again:
            notes[k] = "a lookup can reach it again (its parent was written meanwhile): kept"
        late_entries = _late_entries(late, os.path.join(rw.path, "segments"))
    findings = []
    for f in result.findings:
        if f.fixed or f.action == "none":
            findings.append(f)
            continue
        if f.action == "remove":
            ok = f.path in files_fixed
        elif f.action == "rebuild":
            ok = not index_left
        else:
            ok = f.key is not None and _entry_bk(f) in fixed_keys
        note = notes.get(_entry_bk(f)) if f.key is not None else None
        findings.append(dataclasses.replace(f, fixed=ok,
                                            detail=f"{f.detail}; {note}" if note else f.detail))
    findings.extend(late_entries)
    unfixed = sum(1 for f in findings if not f.fixed)
    return dataclasses.replace(result, fix=True, findings=tuple(findings), unfixed=unfixed)


def _same_place(cur, r) -> bool:
    return cur is not None and (cur.segment, cur.offset) == (r.segment, r.offset)


def _confirm_header_problem(ro, r, detail: str, segdir: str, seg) -> list[FindingEntry]:
    """The bytes verify but the header does not describe the block: repairable, unless the
    record moved meanwhile (then its new segment lists it)."""
    if not _same_place(ro.get_record(r.key, namespace_id=r.namespace_id), r):
        return []
    path = os.path.join(segdir, seg.segment_name(r.segment))
    return [FindingEntry("bad_header", path, r.key.hex(),
                         f"{detail}; the block's bytes verify", False, r.stored_nbytes,
                         "repair",
                         r.namespace_id.hex())]


def _classify(r, segdir: str, seg) -> tuple[str, str]:
    path = os.path.join(segdir, seg.segment_name(r.segment))
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return "missing_segment", f"segment file {path} is missing"
    if r.offset + r.stored_nbytes > size:
        return "short_segment", (f"segment has {size} bytes; block at {r.offset}+"
                                 f"{r.stored_nbytes} is cut off")
    return "checksum_mismatch", "the block's bytes do not match its checksum"


def _confirm_damage(ro, r, segdir: str, seg, header: str | None) -> FindingEntry | None:
    """A read failed: was it damage, or did another process remove/move the block?"""
    from kvstore.tiers.disk import ReadStatus

    cur = ro.get_record(r.key, namespace_id=r.namespace_id)
    if cur is None:
        return None  # removed meanwhile
    if not _same_place(cur, r):  # moved (compaction): verify it at its new place
        import torch

        dst = torch.empty(cur.raw_nbytes, dtype=torch.uint8)
        if ro.read_into(r.key, dst, namespace_id=r.namespace_id) is ReadStatus.OK:
            return None
        r = cur
        header = None
    kind, detail = _classify(r, segdir, seg)
    if header is not None:
        detail = f"{detail} (and {header})"
    path = os.path.join(segdir, seg.segment_name(r.segment))
    return FindingEntry(kind, path, r.key.hex(), detail, False, r.stored_nbytes, "drop",
                        r.namespace_id.hex())


def _read_batch(ro, batch: list, dsts: list) -> list:
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
