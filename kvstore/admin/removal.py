"""``kvstore rm``: namespaces and blocks, with their descendants, resolved from hex targets
(full ids or unique prefixes) into a :class:`RemovalPlan`, then removed in one write
transaction, or through the ``kvstore serve`` daemon that serves the store (its warm tier
drops the blocks too)."""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.admin.common import AdminError, open_disk

if TYPE_CHECKING:
    from kvstore.tiers.disk import DiskRecord, NamespaceInfo

__all__ = [
    "MIN_PREFIX",
    "NamespaceTarget",
    "RemovalPlan",
    "RemovalResult",
    "TargetError",
    "execute_removal",
    "plan_removal",
    "preview_removal",
    "remove",
]

#: a target shorter than this many hex digits is refused (too easy to hit by accident)
MIN_PREFIX = 4


class TargetError(AdminError):
    """An ``rm`` target is malformed or ambiguous."""


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


# -- resolving targets -------------------------------------------------------------------------

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


@dataclass(frozen=True, slots=True)
class _Inventory:
    """The store's namespaces and block records, by hex id, with the links a plan follows."""

    store: str
    infos: dict[str, NamespaceInfo]  # by namespace id (hex)
    by_key: dict[str, DiskRecord]  # by block key (hex)
    children: dict[str, list[str]]  # block key (hex) -> its children's keys
    by_ns: dict[str, list[str]]  # namespace id (hex) -> its blocks' keys

    @classmethod
    def read(cls, path: str | os.PathLike[str] | None) -> _Inventory:
        with open_disk(path, readonly=True) as t:
            infos = {i.namespace_id.hex(): i for i in t.namespaces()}
            recs = list(t.records())
            store = t.path
        by_key = {r.key.hex(): r for r in recs}
        children: dict[str, list[str]] = {}
        by_ns: dict[str, list[str]] = {}
        for k, r in by_key.items():
            if r.parent is not None:
                children.setdefault(r.parent.hex(), []).append(k)
            by_ns.setdefault(r.namespace_id.hex(), []).append(k)
        return cls(store, infos, by_key, children, by_ns)


def _resolve(inv: _Inventory, given: tuple[str, ...],
             norm: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(namespaces named, blocks named, targets that match nothing), each in the order given;
    raises :class:`TargetError` for a target that matches more than one id."""
    ns_ids = sorted(set(inv.infos) | {r.namespace_id.hex() for r in inv.by_key.values()})
    keys_sorted = sorted(inv.by_key)
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
    return named_ns, named_blocks, not_found


def _closure(inv: _Inventory, named_ns: list[str], named_blocks: list[str]) -> tuple[tuple[str, ...], int]:
    """Every block that goes, leaves first, and how many go only because an ancestor goes."""
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
            stack.extend(inv.children.get(k, ()))

    in_ns: set[str] = set()
    for nid in named_ns:
        for k in inv.by_ns.get(nid, ()):
            in_ns.add(k)
            walk(k)
    for k in named_blocks:
        walk(k)
    return tuple(reversed(order)), len(going - in_ns - set(named_blocks))


def plan_removal(path: str | os.PathLike[str] | None, targets: Iterable[str]) -> RemovalPlan:
    """Resolve ``targets`` — namespace ids or block keys, in full or as a unique hex prefix
    (at least 4 digits) — into the blocks to remove, descendants included. Raises
    :class:`TargetError` for a malformed or ambiguous target; targets that match nothing are
    listed in ``not_found``."""
    given = tuple(targets)
    norm = [_norm_target(t) for t in given]
    inv = _Inventory.read(path)
    named_ns, named_blocks, not_found = _resolve(inv, given, norm)
    keys, descendants = _closure(inv, named_ns, named_blocks)
    by_key = inv.by_key
    ns_targets = []
    for nid in named_ns:
        ks = inv.by_ns.get(nid, [])
        info = inv.infos.get(nid)
        ns_targets.append(NamespaceTarget(nid, info.model_id if info else "", len(ks),
                                          sum(by_key[k].stored_nbytes for k in ks)))
    return RemovalPlan(
        store=inv.store, targets=given, namespaces=tuple(ns_targets), blocks=tuple(named_blocks),
        not_found=tuple(not_found), descendants=descendants, keys=keys,
        stored_bytes=sum(by_key[k].stored_nbytes for k in keys),
        raw_bytes=sum(by_key[k].raw_nbytes for k in keys),
    )


# -- removing ----------------------------------------------------------------------------------

def _segment_files(segdir: str, sids: Iterable[int]) -> dict[int, int]:
    from kvstore.tiers.disk import segment_name

    out = {}
    for sid in set(sids):
        with contextlib.suppress(FileNotFoundError):
            out[sid] = os.stat(os.path.join(segdir, segment_name(sid))).st_size
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
