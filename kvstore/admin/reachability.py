"""Blocks that no lookup can reach: their parent is not in the index (a lookup walks a chain
from its first block, so everything below a missing block is dead weight). Finding them, for
``prune`` and ``verify``, and removing them, with whatever another process wrote below them
meanwhile."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvstore.admin.findings import FindingEntry, block_id
from kvstore.tiers.disk import Detail, Reason

if TYPE_CHECKING:
    from kvstore.tiers.disk import DiskRecord, DiskTier

__all__ = ["find_unreachable", "late_entries", "remove_unreachable", "unreachable_grace"]

#: rounds of "remove, then look for children committed meanwhile" before giving up
_ROUNDS = 8


def unreachable_grace(store: str, grace_s: float) -> float:
    """The grace period for blocks whose parent is missing: ``grace_s``, but never under the
    default while another process has the store open.

    An engine whose put overflows its memory commits the overflowing tail of a chain before
    the head it still holds dirty, and its ``flush`` vouches for the whole chain once the head
    follows. ``prune --grace 0`` (or ``verify --fix --grace 0``) in between dropped that tail
    as unreachable: chains a flush had vouched for came back cut after their first blocks.
    Unlike a segment file, a parent still in another process's memory has no lock to see, so
    only a store nobody else has open gets the grace asked for."""
    from kvstore.admin.findings import DEFAULT_GRACE_S

    if grace_s >= DEFAULT_GRACE_S or not _open_elsewhere(os.path.join(store, "index")):
        return grace_s
    return DEFAULT_GRACE_S


def _open_elsewhere(index_dir: str) -> bool:
    """Whether another process has the LMDB environment of ``index_dir`` open: each holds a
    POSIX lock on ``lock.mdb``, listed in ``/proc/locks``. (Not asked with fcntl: closing an
    fd of a file drops every lock this process holds on it, LMDB's own included when this
    process has the store open, as prune and verify do.) True when that cannot be told."""
    try:
        ino = os.stat(os.path.join(index_dir, "lock.mdb")).st_ino
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return True
    me = os.getpid()
    for line in lines:
        # "1: POSIX  ADVISORY  READ 4242 fd:01:1234 0 0" ("->" before a waiter's fields)
        parts = line.replace("->", "").split()
        if len(parts) < 6 or parts[1] != "POSIX":
            continue
        try:
            pid, lock_ino = int(parts[4]), int(parts[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        if lock_ino == ino and pid != me:  # the inode alone: st_dev differs under overlayfs
            return True
    return False


def find_unreachable(recs: Iterable[DiskRecord], gone: set[bytes], segdir: str, *, now: float,
                     grace_s: float, why_gone: str) -> tuple[list[FindingEntry], int]:
    """Blocks that no lookup can reach, because their parent is not in the index (or is in
    ``gone``: dropped by this pass), with their whole subtrees, as findings (action ``drop``);
    and how many were left alone because the block whose parent is missing was written less
    than ``grace_s`` ago (its parent may be a write in flight in another process). Blocks in
    ``gone`` are not listed."""
    from kvstore.tiers.disk import segment_name

    present = {block_id(r.namespace_id, r.key): r for r in recs}
    present = {k: r for k, r in present.items() if k not in gone}
    children = _children(present)
    out: list[FindingEntry] = []
    young = 0
    seen: set[bytes] = set()
    for root in sorted(present):
        r = present[root]
        if r.parent is None:
            continue
        p = block_id(r.namespace_id, r.parent)
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
            out.append(FindingEntry("unreachable", os.path.join(segdir, segment_name(b.segment)),
                                    b.key.hex(), detail, False, b.stored_nbytes, "drop",
                                    b.namespace_id.hex()))
            stack.extend(children.get(k, ()))
    return out, young


def _children(recs: dict[bytes, DiskRecord]) -> dict[bytes, list[bytes]]:
    """Block id -> the ids of its children (a chain never leaves its namespace)."""
    children: dict[bytes, list[bytes]] = {}
    for k, r in recs.items():
        if r.parent is not None:
            children.setdefault(block_id(r.namespace_id, r.parent), []).append(k)
    return children


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


class _Cut:
    """Whether a block is cut off from every chain's first block, memoised along each walk."""

    __slots__ = ("_recs", "_cut")

    def __init__(self, recs: dict[bytes, DiskRecord]) -> None:
        self._recs = recs
        self._cut: dict[bytes, bool] = {}

    def __call__(self, k: bytes) -> bool:
        recs, cut = self._recs, self._cut
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
            k = block_id(r.namespace_id, r.parent)
            if len(path) > len(recs):  # a cycle of corrupt records: reachable from nowhere
                cut[k] = True
                break
        val = cut[k]
        for x in path:
            cut[x] = val
        return val


def _below(roots: set[bytes], recs: dict[bytes, DiskRecord],
           children: dict[bytes, list[bytes]]) -> set[bytes]:
    """``roots`` still in the index and every block below one of them."""
    out: set[bytes] = set()
    stack = [k for k in roots if k in recs] + [c for k in roots for c in children.get(k, ())]
    while stack:
        k = stack.pop()
        if k in out:
            continue
        out.add(k)
        stack.extend(children.get(k, ()))
    return out


def remove_unreachable(t: DiskTier, planned: Iterable[bytes],
                       removed: set[bytes]) -> tuple[set[bytes], list[DiskRecord], set[bytes]]:
    """Delete the ``planned`` blocks that still no lookup can reach, and every block now below
    one of them or below a block in ``removed`` (written meanwhile, or orphaned by this pass).
    Returns (keys gone now, records of the removed blocks that were not planned, planned keys
    that a lookup can reach again: their parent was written meanwhile)."""
    planned = set(planned)
    gone: set[bytes] = set()
    late: list[DiskRecord] = []
    reachable: set[bytes] = set()
    roots = planned | removed
    for round_ in range(_ROUNDS):  # children committed by another process while we worked
        recs = {block_id(r.namespace_id, r.key): r for r in t.records()}
        unreachable = _Cut(recs)
        cands = _below(roots, recs, _children(recs))
        doomed = [k for k in cands if k not in gone and unreachable(k)]
        if round_ == 0:
            reachable = {k for k in planned if k in recs and not unreachable(k)}
        if not doomed:
            break
        by_ns: dict[bytes, list[bytes]] = {}
        for k in doomed:
            by_ns.setdefault(k[:32], []).append(k[32:])
        for ns, keys in by_ns.items():  # DiskTier.delete keeps the children/LRU dbs right
            t.delete(keys, namespace_id=ns, reason=Reason.PRUNED, detail=Detail.UNREACHABLE)
        gone.update(k for k in doomed if t.get_record(k[32:], namespace_id=k[:32]) is None)
        late.extend(recs[k] for k in doomed if k not in planned)
        roots = set(doomed)
    return gone, late, reachable


def late_entries(late: Iterable[DiskRecord], segdir: str) -> list[FindingEntry]:
    """Findings for blocks removed with the planned ones although not in the plan: written
    meanwhile below one of them, or orphaned by this pass."""
    from kvstore.tiers.disk import segment_name

    return [FindingEntry("unreachable", os.path.join(segdir, segment_name(r.segment)),
                         r.key.hex(), "below a block removed by this pass (written meanwhile, "
                         "or its parent was dropped now): no lookup can reach this block", True,
                         r.stored_nbytes, "drop", r.namespace_id.hex()) for r in late]
