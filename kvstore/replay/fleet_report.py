"""A fleet replay report: per engine capacity and eviction policy, each router's fleet."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.replay.driver import StoreSpec
from kvstore.replay.fleet import ROUTERS, FleetResult, FleetSpec, replay_fleet
from kvstore.replay.report import Capacity, prepare, ticker
from kvstore.replay.trace import Trace
from kvstore.routing.policies import DEFAULT_IMBALANCE
from kvstore.tiers.policy import DEFAULT_EVICTION


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """What to run: engines, routers, per-engine capacities (the warm tier) and policies."""

    engines: int
    capacities: tuple[Capacity, ...]
    routers: tuple[str, ...] = ROUTERS
    policies: tuple[str, ...] = (DEFAULT_EVICTION,)
    block_tokens: int = 512
    hot: Capacity | None = None
    disk: Capacity | None = None
    speed: float | None = None
    path: str | None = None
    imbalance: float = DEFAULT_IMBALANCE
    hash_blocks: int = 4


@dataclass(frozen=True, slots=True)
class FleetRow:
    """One per-engine capacity under one eviction policy: every router's fleet."""

    capacity: str
    share: float  # of the trace's unique blocks, per engine
    blocks: int  # per engine
    eviction: str
    results: tuple[FleetResult, ...]

    def of(self, router: str) -> FleetResult | None:
        return next((r for r in self.results if r.router == router), None)


@dataclass(frozen=True, slots=True)
class FleetReport:
    trace: str
    requests: int
    references: int
    unique_blocks: int
    block_tokens: int
    block_nbytes: int
    engines: int
    routers: tuple[str, ...]
    rows: tuple[FleetRow, ...]


def run_fleet_report(trace: Trace, plan: FleetPlan, *,
                     progress: Callable[[str, int, int], None] | None = None) -> FleetReport:
    """Every capacity x policy x router of ``plan`` through fresh fleets of real stores."""
    for r in plan.routers:
        if r not in ROUTERS:
            raise ConfigError(f"unknown router {r!r}; choose from {', '.join(ROUTERS)}")
    if not plan.routers:
        raise ConfigError("give at least one router (--router prefix,round-robin,hash)")
    keys, fx, bn = prepare(trace, plan.policies, plan.block_tokens)
    hot = plan.hot.blocks(fx, bn) * bn if plan.hot is not None else 0
    disk = plan.disk.blocks(fx, bn) * bn if plan.disk is not None else 0
    rows = []
    for cap in plan.capacities:
        n = cap.blocks(fx, bn)
        for pol in plan.policies:
            store = StoreSpec(pol, n * bn, hot_bytes=hot, disk_bytes=disk,
                              block_tokens=plan.block_tokens, path=plan.path)
            results = tuple(
                replay_fleet(trace, FleetSpec(plan.engines, r, store, imbalance=plan.imbalance,
                                              hash_blocks=plan.hash_blocks),
                             keys, speed=plan.speed,
                             progress=ticker(progress, f"{cap.text} {pol} {r}",
                                             len(trace.requests)))
                for r in plan.routers)
            rows.append(FleetRow(cap.text, n / fx.unique_blocks, n, pol, results))
    return FleetReport(trace.source, fx.requests, fx.references, fx.unique_blocks,
                       plan.block_tokens, bn, plan.engines, plan.routers, tuple(rows))
