"""A replay report: per capacity, the store's policies replayed through a real store beside
the simulators (the same policies, LRU, the published baselines ARC and S3-FIFO, the
farthest-next-use bound, the unbounded cache)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError, SizeError
from kvstore.hints import PutHint
from kvstore.keys import BlockKey
from kvstore.replay.baselines import DEFAULT_BASELINES, HINTED, SIM_ONLY
from kvstore.replay.driver import (
    ReplayResult,
    StoreSpec,
    replay,
    replay_layout,
    replay_namespace,
    session_hint,
)
from kvstore.replay.simulate import (
    SimResult,
    simulate_belady,
    simulate_policy,
    unbounded,
    variant,
)
from kvstore.replay.trace import Trace, TraceFacts, facts, store_keys
from kvstore.sizes import parse_size
from kvstore.tiers.admission import ADMISSIONS, DEFAULT_ADMISSION
from kvstore.tiers.policy import EVICTIONS


@dataclass(frozen=True, slots=True)
class Capacity:
    """A memory capacity given as a share of the trace's unique blocks, or as bytes."""

    text: str
    share: float | None = None
    nbytes: int | None = None

    def blocks(self, fx: TraceFacts, block_nbytes: int) -> int:
        if self.share is not None:
            return max(1, round(self.share * fx.unique_blocks))
        assert self.nbytes is not None
        if self.nbytes < block_nbytes:
            raise ConfigError(f"capacity {self.text!r} is smaller than one block "
                              f"({block_nbytes} B in the replay's layout); give more, or a "
                              "share like 5%")
        return self.nbytes // block_nbytes


def parse_capacity(text: str) -> Capacity:
    """``"5%"`` (of the trace's unique blocks) or a size (``"64MiB"``, ``"1000000"``)."""
    t = text.strip()
    if t.endswith("%"):
        try:
            share = float(t[:-1]) / 100.0
        except ValueError:
            share = -1.0
        if not 0 < share <= 10:
            raise ConfigError(f"capacity {text!r}: a share must be a number of percent in "
                              "(0, 1000], like 5%")
        return Capacity(t, share=share)
    try:
        return Capacity(t, nbytes=parse_size(t, what="capacity"))
    except SizeError as e:
        raise SizeError(f"{e}; or a share of the trace's unique blocks like 5%") from None


@dataclass(frozen=True, slots=True)
class CapacityRow:
    """One memory capacity: simulated and replayed hit ratios."""

    capacity: str
    share: float  # of the trace's unique blocks
    blocks: int
    nbytes: int
    simulated: tuple[SimResult, ...]  # the store's policies, the baselines, belady, unbounded
    replayed: tuple[ReplayResult, ...]  # the store's policies through a real store

    def sim(self, policy: str) -> SimResult | None:
        """By label: ``"lru"``, ``"reuse+second-hit"``, ``"belady"``, ..."""
        return next((r for r in self.simulated if r.label == policy), None)

    def store(self, policy: str) -> ReplayResult | None:
        return next((r for r in self.replayed if r.label == policy), None)


@dataclass(frozen=True, slots=True)
class ReplayReport:
    trace: str
    requests: int
    references: int
    unique_blocks: int
    block_tokens: int
    block_nbytes: int
    policies: tuple[str, ...]  # labels: each eviction policy under each admission
    rows: tuple[CapacityRow, ...]


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What to run: memory capacities (the warm tier), policies, the other tiers."""

    capacities: tuple[Capacity, ...]
    policies: tuple[str, ...] = EVICTIONS
    admissions: tuple[str, ...] = (DEFAULT_ADMISSION,)  # the warm tier's, each with each policy
    block_tokens: int = 512
    hot: Capacity | None = None
    disk: Capacity | None = None
    store: bool = True  # False: the simulators only
    speed: float | None = None
    path: str | None = None
    baselines: tuple[str, ...] = DEFAULT_BASELINES  # simulated beside them (kvstore.replay.baselines)
    hints: tuple[bool, ...] = (False,)  # without, and/or with each request's session hint

    @property
    def variants(self) -> tuple[tuple[str, str, bool], ...]:
        """(eviction, admission, hints) of every run, policy-major."""
        return tuple((p, a, h) for p in self.policies for a in self.admissions
                     for h in self.hints)


def prepare(trace: Trace, policies: Sequence[str], block_tokens: int,
            ) -> tuple[list[list[BlockKey]], TraceFacts, int]:
    """Check the policies; the trace's store keys, its facts and the replay's block size."""
    for p in policies:
        if p not in EVICTIONS:
            raise ConfigError(f"unknown eviction policy {p!r}; choose from {', '.join(EVICTIONS)}")
    keys = store_keys(trace, replay_namespace(block_tokens).id, block_tokens)
    fx = facts(keys, block_tokens)
    if not fx.references:
        raise ConfigError(f"the trace has no full {block_tokens}-token block; lower "
                          "--block-tokens")
    return keys, fx, replay_layout(block_tokens).block_nbytes


def run_report(trace: Trace, plan: ReplayPlan, *,
               progress: Callable[[str, int, int], None] | None = None) -> ReplayReport:
    """Every capacity of ``plan``: simulators, then (``plan.store``) replays through a store.
    ``progress(what, done, total)`` is called as requests go by."""
    # the simulators run on the store's own keys: what they count is what the store sees
    blocks, fx, bn = prepare(trace, plan.policies, plan.block_tokens)
    for a in plan.admissions:
        if a not in ADMISSIONS:
            raise ConfigError(f"unknown admission {a!r}; choose from {', '.join(ADMISSIONS)}")
    for b in plan.baselines:
        if b not in SIM_ONLY:
            raise ConfigError(f"unknown baseline {b!r}; choose from {', '.join(SIM_ONLY)}")
    # a baseline that takes hints (HINTED) runs in each hint mode asked for, the others without
    variants = plan.variants + tuple(
        (b, DEFAULT_ADMISSION, h) for b in plan.baselines
        for h in (plan.hints if b in HINTED else (False,))
        if (b, DEFAULT_ADMISSION, h) not in plan.variants)
    hints = [session_hint(r) for r in trace.requests] if any(plan.hints) else None
    top = unbounded(blocks)
    rows = []
    for cap in plan.capacities:
        n = cap.blocks(fx, bn)
        sims = _simulate(blocks, n, variants, hints, progress, cap.text)
        sims.append(top)
        runs = (_replays(trace, blocks, plan, fx, n * bn, bn, progress, cap.text)
                if plan.store else ())
        rows.append(CapacityRow(cap.text, n / fx.unique_blocks, n, n * bn, tuple(sims),
                                tuple(runs)))
    return ReplayReport(trace.source, fx.requests, fx.references, fx.unique_blocks,
                        plan.block_tokens, bn, tuple(variant(*v) for v in plan.variants),
                        tuple(rows))


def ticker(progress: Callable[[str, int, int], None] | None, what: str, total: int,
            ) -> Callable[[int], None] | None:
    if progress is None:
        return None
    done = 0

    def tick(k: int) -> None:
        nonlocal done
        done += k
        progress(what, done, total)

    return tick


def _simulate(blocks: Sequence[Sequence[BlockKey]], n: int,
              variants: Sequence[tuple[str, str, bool]], hints: Sequence[PutHint | None] | None,
              progress: Callable[[str, int, int], None] | None, label: str) -> list[SimResult]:
    total = len(blocks)
    out = [simulate_policy(blocks, n, p, admission=a, hints=hints if h else None,
                           progress=ticker(progress, f"{label} simulate {variant(p, a, h)}",
                                           total))
           for p, a, h in variants]
    out.append(simulate_belady(blocks, n, progress=ticker(progress, f"{label} simulate belady",
                                                           total)))
    return out


def _replays(trace: Trace, blocks: Sequence[list[BlockKey]], plan: ReplayPlan, fx: TraceFacts,
             warm_bytes: int, bn: int,
             progress: Callable[[str, int, int], None] | None, label: str,
             ) -> list[ReplayResult]:
    hot = plan.hot.blocks(fx, bn) * bn if plan.hot is not None else 0
    disk = plan.disk.blocks(fx, bn) * bn if plan.disk is not None else 0
    out = []
    for p, a, h in plan.variants:
        spec = StoreSpec(p, warm_bytes, hot_bytes=hot, disk_bytes=disk,
                         block_tokens=plan.block_tokens, path=plan.path, admission=a, hints=h)
        out.append(replay(trace, spec, speed=plan.speed, keys=blocks, progress=ticker(
            progress, f"{label} store {variant(p, a, h)}", len(trace.requests))))
    return out
