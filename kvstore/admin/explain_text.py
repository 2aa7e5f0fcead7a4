"""``kvstore explain`` in words: consecutive blocks with the same explanation become one
:class:`~kvstore.admin.explain.Run` with a sentence that says what happened and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.admin.common import format_age
from kvstore.admin.explain import BlockExplanation, Run, Status
from kvstore.admin.nsmatch import NamespaceMatch

__all__ = ["runs_of", "sentence"]

_WHY = {
    "missing_segment": "its segment file is missing",
    "short_segment": "its segment file is cut short",
    "checksum_mismatch": "its bytes do not match their checksum",
    "bad_record": "its index record is malformed",
    "unreachable": "its parent was gone, so no lookup could reach it",
    "read_error": "its segment file cannot be read",
}
_TIER_ROLE = {"hot": "the GPU tier", "warm": "the CPU (warm) tier", "disk": "the disk tier",
              "remote": "the remote tier"}


def _key(b: BlockExplanation) -> tuple:
    return (b.status, b.tier, b.why, b.namespace_id, b.salt)


#: said of a prompt that misses from its first block when no salt was given: explain cannot
#: find salted blocks without the salt (it is hashed into every key of the chain), so it
#: names the way to look under one
SALT_HINT = ("; a prompt the engine keys with a cache salt (vLLM's cache_salt, a tenant's "
             "salt) is stored under other keys, which cannot be found without that salt: "
             "pass --salt SALT (or --try-salt SALT) to look under it")


def runs_of(blocks: Sequence[BlockExplanation], holders: Sequence[NamespaceMatch], *,
            registered: bool, tombstones_kept: bool, now: float,
            salt_hint: bool = False) -> list[Run]:
    """Group ``blocks`` into runs and word each one; ``salt_hint``: no salt was given (a
    miss from the first block says how to look under one)."""
    by_id = {m.namespace_id: m for m in holders}
    out: list[Run] = []
    i = 0
    first_miss = next((b.index for b in blocks if b.status is not Status.HIT), None)
    while i < len(blocks):
        j = i
        while j + 1 < len(blocks) and _key(blocks[j + 1]) == _key(blocks[i]):
            j += 1
        run = blocks[i : j + 1]
        text = sentence(run, by_id, registered=registered, tombstones_kept=tombstones_kept,
                        now=now, first_miss=first_miss)
        if salt_hint and i == 0 and blocks[0].status is Status.NEVER_STORED and registered:
            text += SALT_HINT
        out.append(Run(i, j, blocks[i].status, blocks[i].tier, text))
        i = j + 1
    return out


def _ages(values: Sequence[float | None], now: float) -> str:
    vs = [v for v in values if v is not None]
    if not vs:
        return "at an unknown time"
    lo, hi = format_age(max(vs), now), format_age(min(vs), now)
    return lo if lo == hi else f"{hi} to {lo}"


def sentence(run: Sequence[BlockExplanation], holders: dict[str, NamespaceMatch], *,
             registered: bool, tombstones_kept: bool, now: float,
             first_miss: int | None) -> str:
    """What happened to the blocks of ``run`` (they share status, tier and detail)."""
    b = run[0]
    st = b.status
    if st is Status.HIT:
        return f"held in {_TIER_ROLE.get(b.tier or '', b.tier)}"
    if st is Status.UNREACHABLE:
        return (f"held in {_TIER_ROLE.get(b.tier or '', b.tier)}, but unreachable: a lookup "
                f"stops at block {first_miss}, which misses")
    if st is Status.DAMAGED:
        return (f"on disk, but {_WHY.get(b.why, b.why)}: the next read drops it "
                "('kvstore verify --fix' drops it now)")
    if st is Status.EVICTED:
        stored = [x.stored for x in run if x.stored is not None]
        return (f"evicted by {_TIER_ROLE.get(b.tier or '', b.tier)} to make room "
                f"{_ages([x.when for x in run], now)}"
                + (f" (stored {_ages(stored, now)})" if stored else "")
                + "; a larger capacity of that tier keeps more")
    if st is Status.REMOVED:
        return (f"removed from {_TIER_ROLE.get(b.tier or '', b.tier)} "
                f"{_ages([x.when for x in run], now)} (kvstore rm, Store.evict or a daemon "
                "removal)")
    if st is Status.DROPPED:
        return (f"damaged ({_WHY.get(b.why, b.why or 'unreadable')}) and dropped "
                f"{_ages([x.when for x in run], now)} by a read")
    if st is Status.PRUNED:
        return (f"dropped by 'kvstore prune' / 'verify --fix' {_ages([x.when for x in run], now)}"
                + (f" ({_WHY.get(b.why, b.why)})" if b.why else ""))
    if st is Status.OTHER_SALT:
        where = "without a salt" if b.salt is None else f"under salt {b.salt!r}"
        return (f"stored in this namespace {where}: the salt differs (the engine keys this "
                "prompt with another cache salt)")
    if st is Status.OTHER_NAMESPACE:
        m = holders.get(b.namespace_id or "")
        if m is None:
            return f"stored under namespace {(b.namespace_id or '?')[:12]}"
        diffs = "; ".join(f"{d.field} {d.stored!r} there, {d.wanted!r} here" for d in m.differs)
        return f"stored under namespace {m.namespace_id[:12]} ({m.model_id}, {m.layout}): {diffs}"
    if not registered:
        return ("never stored: no engine has opened this namespace in this store (a typo'd "
                "model_id or another layout? see the closest namespaces above)")
    if not tombstones_kept:
        return ("never stored here, as far as this store can tell: it keeps no record of "
                "evictions, so one cannot be ruled out")
    return "never stored (no trace of it: never put, or put and dropped before reaching disk)"
