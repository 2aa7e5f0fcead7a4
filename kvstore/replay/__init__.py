"""Replaying request traces (Mooncake format) through a real store and through offline
simulators: ``kvstore replay`` (docs/cli.md) and the ``replay`` benchmark section.

* :mod:`~kvstore.replay.trace`: loading a trace, the blocks and tokens a store sees;
* :mod:`~kvstore.replay.simulate`: the store's eviction policies without bytes, the
  farthest-next-use (Belady) bound, the unbounded cache;
* :mod:`~kvstore.replay.driver`: the replay through a store (real tiers, eviction, disk);
* :mod:`~kvstore.replay.report`: both, per capacity; :mod:`~kvstore.replay.plot` draws it;
* :mod:`~kvstore.replay.workloads`: a synthetic second workload (multi-turn chat).
"""

from kvstore.replay.driver import ReplayResult, StoreSpec, TierFigures, replay
from kvstore.replay.report import (
    Capacity,
    CapacityRow,
    ReplayPlan,
    ReplayReport,
    parse_capacity,
    run_report,
)
from kvstore.replay.simulate import SimResult, simulate_belady, simulate_policy, unbounded
from kvstore.replay.trace import Request, Trace, TraceError, load_trace

__all__ = [
    "Capacity", "CapacityRow", "ReplayPlan", "ReplayReport", "ReplayResult", "Request",
    "SimResult", "StoreSpec", "TierFigures", "Trace", "TraceError", "load_trace",
    "parse_capacity", "replay", "run_report", "simulate_belady", "simulate_policy",
    "unbounded",
]
