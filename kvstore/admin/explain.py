"""``kvstore explain``: for each block of a prompt, where it is (hot, warm, disk, remote) or
why it misses — never stored; evicted (when, by which tier); removed; damaged and dropped;
stored under another namespace (naming the differing field) or another salt; or a namespace
nobody has opened (a typo'd ``model_id``).

Offline on a store path (the disk tier opened read-only: nothing changes, not even access
times) and, with ``socket``, live through the daemon serving it (:mod:`.explain_live`).
Evictions are known from the index's tombstones (:mod:`kvstore.tiers.disk.tombstones`);
a store without them says so instead of guessing.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.admin import explain_find as _find
from kvstore.admin.common import open_disk, quiet_disk_log
from kvstore.admin.nsmatch import (
    NamespaceFields,
    NamespaceMatch,
    closest,
    match_of,
    resolve_namespace,
)
from kvstore.keys import block_keys
from kvstore.tiers import disk as _tomb  # its tombstone names: NOT_KEPT, Reason, Detail, Tombstone

__all__ = ["BlockExplanation", "Explanation", "Run", "Status", "explain"]


class Status(enum.Enum):
    """What became of one block of the prompt."""

    HIT = "hit"  # a lookup reaches it; ``tier`` says where it is
    UNREACHABLE = "unreachable"  # held (``tier``), but an earlier block misses
    DAMAGED = "damaged"  # its record is there, its bytes are not usable
    EVICTED = "evicted"  # ``tier`` made room (when: ``when``)
    REMOVED = "removed"  # asked for: kvstore rm, Store.evict, a daemon removal
    DROPPED = "dropped"  # a read found it damaged and dropped it
    PRUNED = "pruned"  # kvstore prune / verify --fix dropped it
    OTHER_NAMESPACE = "other_namespace"  # stored under ``namespace_id``: see ``differs``
    OTHER_SALT = "other_salt"  # stored in this namespace under another salt (``salt``)
    NEVER_STORED = "never_stored"


MISSES = frozenset(Status) - {Status.HIT}


@dataclass(frozen=True, slots=True)
class BlockExplanation:
    """One block of the prompt (tokens ``[first_token, end_token)``)."""

    index: int
    key: str  # 64 hex digits, in the namespace asked about
    first_token: int
    end_token: int
    status: Status
    tier: str | None  # where it is (hit, unreachable, damaged) or which tier let it go
    when: float | None  # when it was evicted / removed / dropped (seconds since the epoch)
    stored: float | None  # when it was written (on disk, or as its tombstone says)
    why: str  # damage kind, or the tombstone's detail ("" when none)
    namespace_id: str | None  # other_namespace: the namespace holding it
    salt: str | None  # other_salt: the salt it is stored under (None: no salt)
    differs: tuple[str, ...]  # other_namespace: the differing fields (model, layout, ...)


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive blocks with the same explanation (what the table prints, one per line)."""

    first: int
    last: int
    status: Status
    tier: str | None
    text: str  # the explanation in words


@dataclass(frozen=True, slots=True)
class Explanation:
    """Result of :func:`explain`."""

    store: str
    socket: str | None  # the daemon asked (None: offline)
    live_note: str  # why the daemon was not asked, or what it said ("" when nothing)
    namespace_id: str
    namespace: NamespaceFields
    namespace_registered: bool  # False: nobody opened this namespace in the store
    closest: tuple[NamespaceMatch, ...]  # registered namespaces nearest to it
    holders: tuple[NamespaceMatch, ...]  # the other namespaces holding blocks of the prompt
    salt: str | None
    tokens: int
    block_tokens: int
    blocks: int  # full blocks (only they are cached)
    lookup_blocks: int  # the leading blocks a lookup finds
    tombstones_kept: bool  # False: the store keeps no trace of evictions
    verified: bool  # payloads were read and checked (--verify)
    runs: tuple[Run, ...]
    per_block: tuple[BlockExplanation, ...]
    seconds: float

    @property
    def reused_tokens(self) -> int:
        return self.lookup_blocks * self.block_tokens


def explain(store: str | os.PathLike[str] | None, tokens: Sequence[int], *,
            namespace: NamespaceFields | str, salt: str | None = None,
            try_salts: Sequence[str | None] = (), socket: str | None = None,
            salt_policy: str = "shared", verify: bool = False,
            now: float | None = None) -> Explanation:
    """Explain every full block of ``tokens`` in the store at ``store``.

    ``namespace``: the fields an engine opens the store with (see
    :class:`~kvstore.admin.nsmatch.NamespaceFields`), or a registered namespace's id
    (prefix) or model id. ``salt``: the prompt's salt (cache salt). ``try_salts``: other
    salts to look under (no salt is always tried when ``salt`` is given). ``socket``: also
    ask the daemon serving the store. ``verify``: read each held block and check its
    checksum (reads the payloads; otherwise only the segment files' sizes are checked).
    """
    t0 = time.perf_counter()
    tokens = list(tokens)
    with open_disk(store, readonly=True) as t, quiet_disk_log():
        infos = t.namespaces()
        if isinstance(namespace, str):
            fields = NamespaceFields.from_info(resolve_namespace(namespace, infos))
        else:
            fields = namespace
        nid = fields.id
        registered = any(i.namespace_id == nid for i in infos)
        live, note = None, ""
        if socket is not None:
            live, note = _ask_daemon(socket, fields, tokens, salt, salt_policy, registered, t)
            if live is not None and live.namespace_id != nid:
                nid = live.namespace_id
                note = (f"the daemon derived namespace {nid.hex()[:12]} (its salt policy); "
                        "explained in that one")
                registered = any(i.namespace_id == nid for i in infos)
        keys = list(block_keys(nid, tokens, fields.block_tokens, salt=salt))
        ctx = _Context(t, infos, fields, nid, keys, tokens, salt, try_salts, verify, live)
        blocks = _classify(ctx)
        store_path = t.path
        kept = ctx.tombstones_kept
    from kvstore.admin.explain_text import runs_of

    hits = next((b.index for b in blocks if b.status is not Status.HIT), len(blocks))
    by_id = {i.namespace_id.hex(): i for i in infos}
    holders = tuple(match_of(fields, by_id[h]) for h in dict.fromkeys(
        b.namespace_id for b in blocks if b.namespace_id is not None))
    when = time.time() if now is None else now
    return Explanation(
        store=store_path, socket=None if live is None else live.socket, live_note=note,
        namespace_id=nid.hex(), namespace=fields, namespace_registered=registered,
        closest=() if registered else closest(fields, infos), holders=holders, salt=salt,
        tokens=len(tokens), block_tokens=fields.block_tokens, blocks=len(keys),
        lookup_blocks=hits, tombstones_kept=kept, verified=verify,
        runs=tuple(runs_of(blocks, holders, registered=registered, tombstones_kept=kept,
                           now=when, salt_hint=salt is None)),
        per_block=tuple(blocks), seconds=time.perf_counter() - t0)


def _ask_daemon(socket, fields, tokens, salt, salt_policy, registered, t):
    """The daemon's view, or (None, why it was not asked)."""
    from kvstore.admin.explain_live import probe_daemon

    if not registered and t.namespaces():
        return None, ("the daemon was not asked: this namespace is not registered in the "
                      "store, and a hello would open it in the daemon")
    live = probe_daemon(socket, fields, lambda nid: list(block_keys(
        nid, tokens, fields.block_tokens, salt=salt)), salt_policy=salt_policy)
    note = "" if live.directory else ("this daemon has no key directory: warm blocks are "
                                      "reported by the tier below them")
    return live, note


@dataclass(slots=True)
class _Context:
    t: object  # DiskTier
    infos: list
    fields: NamespaceFields
    nid: bytes
    keys: list[bytes]
    tokens: list[int]
    salt: str | None
    try_salts: Sequence[str | None]
    verify: bool
    live: object | None  # LiveView
    tombstones_kept: bool = True


def _held(ctx: _Context) -> tuple[list[str | None], list[str]]:
    """Per block: the tier holding it (None: none) and why its bytes are unusable ("")."""
    recs = _find.chain_records(ctx.t, ctx.keys, ctx.nid)
    segs = _find.segments_of(ctx.t)
    tiers: list[str | None] = []
    damage: list[str] = []
    live = ctx.live
    for i, (k, rec) in enumerate(zip(ctx.keys, recs, strict=True)):
        bad = "" if rec is None else _find.damage_of(ctx.t, k, rec, segs, verify=ctx.verify)
        if live is not None and live.warm[i]:
            tier = "warm"
        elif rec is not None:
            tier = "disk"
        elif live is not None and i < live.held:
            tier = "remote"
        else:
            tier = None
        tiers.append(tier)
        damage.append(bad if tier == "disk" else "")
    return tiers, damage


def _classify(ctx: _Context) -> list[BlockExplanation]:
    tiers, damage = _held(ctx)
    n = len(ctx.keys)
    reach = 0
    while reach < n and tiers[reach] is not None and not damage[reach]:
        reach += 1
    if ctx.live is not None:  # the daemon's answer is what its clients get
        reach = min(reach, ctx.live.held)
    gone = [i for i in range(n) if tiers[i] is None]
    tombs = _find.tombstones_of(ctx.t, ctx.nid, [ctx.keys[i] for i in gone])
    ctx.tombstones_kept = tombs is not _tomb.NOT_KEPT
    tomb_of = {} if tombs is _tomb.NOT_KEPT else dict(zip(gone, tombs, strict=True))
    found = _find_elsewhere(ctx) if gone else []
    bt = ctx.fields.block_tokens
    out = []
    for i in range(n):
        base = dict(index=i, key=ctx.keys[i].hex(), first_token=i * bt, end_token=(i + 1) * bt,
                    tier=tiers[i], when=None, stored=None, why=damage[i], namespace_id=None,
                    salt=None, differs=())
        if tiers[i] is not None:
            st = Status.DAMAGED if damage[i] else (Status.HIT if i < reach else Status.UNREACHABLE)
            out.append(BlockExplanation(status=st, **base))
            continue
        tomb = tomb_of.get(i)
        if tomb is not None:
            out.append(_from_tombstone(base, tomb))
            continue
        out.append(_from_elsewhere(base, ctx, found, (i + 1) * bt))
    return out


_REASONS = {_tomb.Reason.EVICTED: Status.EVICTED, _tomb.Reason.REMOVED: Status.REMOVED,
            _tomb.Reason.DAMAGED: Status.DROPPED, _tomb.Reason.PRUNED: Status.PRUNED}


def _from_tombstone(base: dict, tomb: _tomb.Tombstone) -> BlockExplanation:
    why = "" if tomb.detail is _tomb.Detail.NONE else tomb.detail.name.lower()
    return BlockExplanation(**{**base, "status": _REASONS[tomb.reason],
                               "tier": tomb.tier.name.lower(), "when": tomb.removed,
                               "stored": tomb.stored, "why": why})


def _find_elsewhere(ctx: _Context) -> list[_find.Elsewhere]:
    """Other namespaces and salts holding the prompt's leading tokens, best first."""
    found = _find.elsewhere(ctx.t, ctx.tokens, ctx.salt, ctx.infos, ctx.nid)
    mine = next((i for i in ctx.infos if i.namespace_id == ctx.nid), None)
    if mine is not None:
        salts = ([None] if ctx.salt is not None else []) + [
            s for s in ctx.try_salts if s != ctx.salt]
        found += _find.other_salts(ctx.t, ctx.tokens, mine, list(dict.fromkeys(salts)))
    # same namespace (a salt) first, then fewest differing fields
    found.sort(key=lambda e: (e.namespace.namespace_id != ctx.nid,
                              len(match_of(ctx.fields, e.namespace).differs), -e.tokens))
    return found


def _from_elsewhere(base: dict, ctx: _Context, found: list[_find.Elsewhere],
                    end: int) -> BlockExplanation:
    for e in found:
        if e.tokens < end:
            continue
        if e.namespace.namespace_id == ctx.nid:
            return BlockExplanation(**{**base, "status": Status.OTHER_SALT, "salt": e.salt})
        m = match_of(ctx.fields, e.namespace)
        return BlockExplanation(**{**base, "status": Status.OTHER_NAMESPACE,
                                   "namespace_id": m.namespace_id,
                                   "differs": tuple(d.field for d in m.differs)})
    return BlockExplanation(**{**base, "status": Status.NEVER_STORED})
