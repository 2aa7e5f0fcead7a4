"""A trace through N real stores with a router in front (``kvstore replay --engines N``).

The engines are N stores in this process, each a full store (its own tiers, eviction, disk
tier under its own directory) built as the single-store replay builds one. Each store reports
its tier changes as KV events (:class:`~kvstore.events.local.LocalSink`: vLLM-schema batches,
encoded and decoded as on the wire) straight into the router's
:class:`~kvstore.routing.index.PrefixIndex`, synchronously, so the router sees exactly what
the stores hold when it decides and a run is deterministic. (Across processes the same index
is fed by :class:`~kvstore.routing.subscriber.Subscriber` from ``kvstore serve --kv-events``.)

Per request, in timestamp order: the router picks an engine from the request's keys and
each engine's recent load (tokens it was sent in the last ``load_window_s`` of trace time);
the engine ``fetch``es the chain and ``put``s what it lacked. Hit ratio = blocks found as a
leading run on the engine a request went to / all block references; an engine's load =
input tokens it had to compute.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.events.codec import decode_batch
from kvstore.events.local import LocalSink
from kvstore.keys import BlockKey
from kvstore.replay.driver import (
    StoreSpec,
    TierFigures,
    open_replay_store,
    pace,
    serve,
    tier_figures,
)
from kvstore.replay.trace import Trace
from kvstore.routing.index import PrefixIndex
from kvstore.routing.policies import DEFAULT_IMBALANCE, make_policy
from kvstore.routing.router import Router
from kvstore.store import Store

#: routing policies a fleet replay accepts (kvstore.routing.policies)
ROUTERS = ("round-robin", "hash", "prefix")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """N engines, each a store built from ``store``, behind ``router``."""

    engines: int
    router: str
    store: StoreSpec
    imbalance: float = DEFAULT_IMBALANCE  # the prefix policy's load band
    hash_blocks: int = 4  # the hash policy's leading blocks
    load_window_s: float = 180.0  # trace seconds of sent work the router weighs

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ConfigError(f"a fleet needs at least one engine, got {self.engines}")
        if self.router not in ROUTERS:
            raise ConfigError(f"unknown router {self.router!r}; choose from {', '.join(ROUTERS)}")


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """One engine after a fleet replay."""

    name: str
    requests: int
    references: int
    hit_blocks: int
    tokens_computed: int  # input tokens it had to compute (its load)
    tiers: tuple[TierFigures, ...]


@dataclass(frozen=True, slots=True)
class FleetResult:
    """A trace replayed through one fleet."""

    router: str
    eviction: str
    engines: int
    requests: int
    references: int
    hits: int
    wrong_blocks: int  # blocks whose bytes were not the ones put (must be 0)
    mispredicted: int  # requests whose hit differed from the leading run the index told
    exploit: int  # requests the prefix policy sent to a cached prefix
    hit_ratio: float  # hits / references
    max_over_mean: float  # the busiest engine's load over the mean load (1.0 = even)
    seconds: float
    per_engine: tuple[EngineFigures, ...]


def _max_over_mean(loads: Sequence[int]) -> float:
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean else 1.0


def replay_fleet(trace: Trace, spec: FleetSpec, keys: Sequence[list[BlockKey]], *,
                 speed: float | None = None,
                 progress: Callable[[int], None] | None = None) -> FleetResult:
    """Replay ``trace`` (its requests' store keys ``keys``) through ``spec.engines`` fresh
    stores behind a ``spec.router`` router."""
    names = [f"engine-{i}" for i in range(spec.engines)]
    index = PrefixIndex()
    policy = make_policy(spec.router, block_tokens=spec.store.block_tokens,
                         hash_blocks=spec.hash_blocks, imbalance=spec.imbalance)
    router = Router(names, index, policy, block_tokens=spec.store.block_tokens,
                    load_window_s=spec.load_window_s)
    with ExitStack() as stack:
        stores = {}
        for name in names:
            index.add_engine(name)
            tmp = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="kvstore-fleet-", dir=spec.store.path))
            sink = LocalSink(_applier(index, name), block_size=spec.store.block_tokens,
                             batched=True)
            store = stack.enter_context(open_replay_store(spec.store, tmp, events=sink))
            stores[name] = _Engine(store, sink)
        return _run(trace, keys, spec, router, stores, speed, progress)


@dataclass(frozen=True, slots=True)
class _Engine:
    store: Store
    events: LocalSink


def _applier(index: PrefixIndex, name: str) -> Callable[[bytes], None]:
    def apply(payload: bytes) -> None:
        index.apply(name, decode_batch(payload).events)

    return apply


def _run(trace: Trace, chains: Sequence[list[BlockKey]], spec: FleetSpec, router: Router,
         engines: dict[str, _Engine], speed: float | None, progress: Callable[[int], None] | None,
         ) -> FleetResult:
    bt = spec.store.block_tokens
    count = {n: [0, 0, 0, 0] for n in engines}  # requests, references, hits, tokens computed
    wrong = mispredicted = exploit = 0
    t0 = time.perf_counter()
    first_ms = trace.requests[0].timestamp_ms if trace.requests else 0
    for req, chain in zip(trace.requests, chains, strict=True):
        pace(t0, first_ms, req.timestamp_ms, speed)
        route = router.route_keys(chain, now=req.timestamp_ms / 1000.0)
        engine = engines[route.engine]
        got = serve(engine.store, chain)
        engine.events.flush()  # the router sees the request's changes before the next one
        c = count[route.engine]
        c[0] += 1
        c[1] += len(chain)
        c[2] += got.hit_blocks
        c[3] += max(0, req.input_length - got.hit_blocks * bt)
        wrong += got.wrong_blocks
        exploit += route.mode == "exploit"
        if router.policy.uses_index:
            mispredicted += got.hit_blocks != route.cached_blocks
        if progress is not None:
            progress(1)
    for e in engines.values():
        e.store.flush()
    seconds = time.perf_counter() - t0
    per = tuple(EngineFigures(n, c[0], c[1], c[2], c[3], tier_figures(engines[n].store, c[1]))
                for n, c in count.items())
    refs, hits = sum(e.references for e in per), sum(e.hit_blocks for e in per)
    return FleetResult(spec.router, spec.store.eviction, spec.engines, len(trace.requests),
                       refs, hits, wrong, mispredicted, exploit, hits / refs if refs else 0.0,
                       _max_over_mean([e.tokens_computed for e in per]), seconds, per)
