"""Counters over the wire: the :class:`Stats` request and its :class:`StatsReply` (the
namespace's :class:`~kvstore.stats.StoreStats` and the daemon's :class:`ServerStats`), and
the :class:`LookupReport` a client sends for lookups it answered from the key directory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from kvstore.stats import StoreStats, TierStats
from kvstore.wire.errors import BadRequest
from kvstore.wire.fields import check_args, check_int, check_str

__all__ = [
    "LookupReport",
    "ServerStats",
    "Stats",
    "StatsReply",
    "store_stats_from_wire",
    "store_stats_to_wire",
]


@dataclass(frozen=True, slots=True)
class Stats:
    """The namespace's store counters and the daemon's -> :class:`StatsReply`."""

    OP: ClassVar[str] = "stats"

    def to_wire(self) -> list:
        return []

    @classmethod
    def from_wire(cls, args: object) -> Stats:
        check_args(args, 0, cls.OP)
        return cls()


@dataclass(frozen=True, slots=True)
class LookupReport:
    """Lookups the client answered itself from the key directory, for the daemon's counters;
    no reply unless it fails (see :data:`kvstore.wire.messages.SILENT_OPS`)."""

    OP: ClassVar[str] = "lookup_report"
    lookups: int
    hits: int
    misses: int

    def to_wire(self) -> list:
        return [self.lookups, self.hits, self.misses]

    @classmethod
    def from_wire(cls, args: object) -> LookupReport:
        a = check_args(args, 3, cls.OP)
        return cls(*(check_int(v, f"{cls.OP}: {name}", 0, 2**40)
                     for v, name in zip(a, ("lookups", "hits", "misses"), strict=True)))


@dataclass(frozen=True, slots=True)
class ServerStats:
    """The daemon's own counters; the lease/grant/pin/slot figures are for the namespace."""

    connections: int = 0  # open connections (all namespaces)
    namespaces: int = 0  # open namespaces
    requests: int = 0  # requests answered (all connections)
    errors: int = 0  # error replies sent
    leases: int = 0  # leases outstanding in this namespace
    leased_blocks: int = 0
    grants: int = 0  # granted puts neither committed nor aborted
    granted_blocks: int = 0
    pinned_blocks: int = 0  # pins held by connections through pin()
    warm_slots: int = 0
    free_warm_slots: int = 0  # slots neither holding a block nor granted

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, body: object) -> ServerStats:
        if not isinstance(body, dict):
            raise BadRequest("server stats must be a map")
        return cls(**{f.name: check_int(body.get(f.name, 0), f.name)
                      for f in dataclasses.fields(cls)})


_TIER_FIELDS = ("name", "device", "capacity_bytes", "used_bytes", "blocks", "evictions",
                "demotions_in", "promotions_in", "hits", "hit_bytes")
_TIER_FIELDS_V1 = 8  # a daemon before per-tier hits sends the first 8


def store_stats_to_wire(s: StoreStats) -> dict:
    """Every int counter of :class:`StoreStats` by name, and ``tiers`` as arrays."""
    out: dict = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
                 if f.name != "tiers"}
    out["tiers"] = [[getattr(t, n) for n in _TIER_FIELDS] for t in s.tiers]
    # a map an older client ignores (it reads the counters by name): tier -> its policy
    out["tier_policies"] = {t.name: t.policy for t in s.tiers if t.policy}
    out["tier_policy_states"] = {t.name: t.policy_state for t in s.tiers if t.policy_state}
    return out


def store_stats_from_wire(body: object) -> StoreStats:
    """Counters missing from the map (an older daemon) read as 0; unknown ones are ignored."""
    if not isinstance(body, dict) or not isinstance(body.get("tiers"), list):
        raise BadRequest("store stats must be a map with a tiers array")
    tiers = []
    for t in body["tiers"]:
        if not isinstance(t, list) or len(t) not in (_TIER_FIELDS_V1, len(_TIER_FIELDS)):
            raise BadRequest(f"store stats: each tier is an array of {len(_TIER_FIELDS)} fields")
        tiers.append(TierStats(check_str(t[0], "tier name"), check_str(t[1], "tier device", 4096),
                               *(check_int(x, "tier counter") for x in t[2:])))
    pol = body.get("tier_policies") or {}  # absent from an older daemon
    if not isinstance(pol, dict):
        raise BadRequest("store stats: tier_policies must be a map")
    tiers = [dataclasses.replace(t, policy=check_str(pol[t.name], "tier policy"))
             if t.name in pol else t for t in tiers]
    ps = body.get("tier_policy_states") or {}  # absent from an older daemon
    if not isinstance(ps, dict):
        raise BadRequest("store stats: tier_policy_states must be a map")
    tiers = [dataclasses.replace(t, policy_state=check_str(ps[t.name], "tier policy state"))
             if t.name in ps else t for t in tiers]
    kw = {f.name: check_int(body.get(f.name, 0), f.name)
          for f in dataclasses.fields(StoreStats) if f.name != "tiers"}
    return StoreStats(**kw, tiers=tuple(tiers))


@dataclass(frozen=True, slots=True)
class StatsReply:
    store: StoreStats
    server: ServerStats

    def to_wire(self) -> list:
        return [store_stats_to_wire(self.store), self.server.to_wire()]

    @classmethod
    def from_wire(cls, body: object) -> StatsReply:
        a = check_args(body, 2, "stats reply")
        return cls(store_stats_from_wire(a[0]), ServerStats.from_wire(a[1]))
