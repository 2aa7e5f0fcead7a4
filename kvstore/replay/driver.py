"""Replaying a trace through a real store: real tiers, real eviction, real disk writes.

Each request is one ``fetch`` of its whole key chain (the leading held run comes back) and
one ``put`` of the blocks after that run, in timestamp order (optionally paced in scaled
real time). Tokens are synthesized per trace block id, so the store's chained keys follow
the trace's prefix tree; every block's bytes are derived from its identity, and every block
a fetch returns is checked against them (``wrong_blocks`` must stay 0).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.events.sink import EventSink
from kvstore.hints import PutHint
from kvstore.keys import BlockKey, KeyChain
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.replay.simulate import variant
from kvstore.replay.trace import Request, Trace, store_keys

if TYPE_CHECKING:
    import torch

    from kvstore.store import Store

#: the replay's block layout: one layer, one KV head of 4 fp16 values per token, so a
#: 512-token block is 8 KiB and the whole conversation trace's blocks fit this machine
REPLAY_LAYERS, REPLAY_HEADS, REPLAY_HEAD_DIM = 1, 1, 4
REPLAY_MODEL = "kvstore-replay"
_MARK = 2039  # block contents: a number below 2048 (float16 holds it exactly) from the key


def replay_layout(block_tokens: int) -> KVLayout:
    return KVLayout(num_layers=REPLAY_LAYERS, num_kv_heads=REPLAY_HEADS,
                    head_dim=REPLAY_HEAD_DIM, dtype="float16", block_tokens=block_tokens)


def replay_namespace(block_tokens: int) -> Namespace:
    """The namespace the replay's stores open (so keys can be computed before)."""
    return Namespace.create(REPLAY_MODEL, replay_layout(block_tokens))


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """The store a replay runs through (capacities in bytes; 0 disables a tier)."""

    eviction: str
    warm_bytes: int
    hot_bytes: int = 0
    disk_bytes: int = 0
    block_tokens: int = 512
    path: str | None = None  # a directory for the disk tier's fresh temporary store
    disk_codec: str = "none"
    admission: str = "always"  # the warm tier's (kvstore.tiers.admission)
    hints: bool = False  # each put carries its request's session (kvstore.hints.PutHint)


@dataclass(frozen=True, slots=True)
class TierFigures:
    """One tier after a replay."""

    name: str
    capacity_bytes: int
    hit_blocks: int  # blocks fetches were served from this tier
    hit_ratio: float  # their share of all block (= prefix token) references
    bytes_read: int
    bytes_written: int  # blocks that entered the tier (it started empty), in bytes
    evictions: int


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """A trace replayed through one store."""

    eviction: str
    requests: int
    references: int  # store blocks asked for
    hits: int  # blocks found as a leading run
    wrong_blocks: int  # blocks whose bytes were not the ones put (must be 0)
    put_dropped: int
    seconds: float
    tiers: tuple[TierFigures, ...]
    admission: str = "always"  # the warm tier's
    hints: bool = False  # puts carried their request's session

    @property
    def hit_ratio(self) -> float:
        """Prefix-token hit ratio: tokens found as a leading run / tokens asked for."""
        return self.hits / self.references if self.references else 0.0

    @property
    def label(self) -> str:
        """The report's name of this run: the eviction policy, and the admission unless
        ``"always"`` (``"reuse+second-hit"``), ``+hints`` when puts carried sessions."""
        return variant(self.eviction, self.admission, self.hints)


def _marks(keys: list[BlockKey]) -> torch.Tensor:
    import torch  # only replays need it: --simulate-only never loads torch

    return torch.tensor([int.from_bytes(k[:4], "little") % _MARK for k in keys],
                        dtype=torch.float16)


def _contents(keys: list[BlockKey], layout: KVLayout) -> torch.Tensor:
    return _marks(keys).view(-1, 1, 1, 1, 1, 1).expand(layout.batch_shape(len(keys))).contiguous()


def _wrong(got: torch.Tensor, keys: list[BlockKey]) -> int:
    if not keys:
        return 0
    want = _marks(keys)
    flat = got.reshape(got.shape[0], -1)
    ok = (flat == want[:, None]).all(dim=1)
    return int((~ok).sum())


def replay(trace: Trace, spec: StoreSpec, *, speed: float | None = None,
           keys: Sequence[list[BlockKey]] | None = None,
           progress: Callable[[int], None] | None = None) -> ReplayResult:
    """Replay ``trace`` through a store built from ``spec``. ``speed``: pace requests at
    their timestamps divided by ``speed`` (None: as fast as the store goes). ``keys``: the
    requests' keys, when already computed (:func:`~kvstore.replay.trace.store_keys` of
    :func:`replay_namespace`)."""
    if keys is None:
        keys = store_keys(trace, replay_namespace(spec.block_tokens).id, spec.block_tokens)
    # a fresh store every replay (under spec.path when given), removed afterwards
    with (tempfile.TemporaryDirectory(prefix="kvstore-replay-", dir=spec.path) as tmp,
          open_replay_store(spec, tmp) as store):
        return _run(store, trace, keys, spec, speed, progress)


def open_replay_store(spec: StoreSpec, tmp: str, *, events: EventSink | None = None) -> Store:
    """A fresh store for ``spec`` (its disk tier, if any, under the empty directory ``tmp``)."""
    from kvstore.store import open_store

    return open_store(tmp if spec.disk_bytes else None, layout=replay_layout(spec.block_tokens),
                      model_id=REPLAY_MODEL, device="cpu", gpu_capacity=spec.hot_bytes,
                      cpu_capacity=spec.warm_bytes, disk_capacity=spec.disk_bytes,
                      eviction=spec.eviction, admission={"warm": spec.admission},
                      disk_codec=spec.disk_codec, events=events)


@dataclass(frozen=True, slots=True)
class Served:
    """One request through one store."""

    hit_blocks: int  # the leading run the fetch returned
    wrong_blocks: int  # of them, blocks without the bytes put under their key (must be 0)


def session_hint(req: Request) -> PutHint | None:
    """What an engine that knows the request's session tells the store (None without one)."""
    return None if req.session is None else PutHint(session=str(req.session))


def serve(store: Store, chain: list[BlockKey], hint: PutHint | None = None) -> Served:
    """One request: ``fetch`` its whole chain, check what came back, ``put`` the rest (with
    ``hint``)."""
    if not chain:
        return Served(0, 0)
    keys = KeyChain(chain, store.namespace_id)
    got = store.fetch(keys).wait()
    n = int(got.shape[0])
    wrong = _wrong(got, chain[:n])
    if n < len(keys):
        # waited for: a put still copying keeps its blocks pinned, and how many are in
        # flight would depend on the machine's load; the replay must be deterministic
        store.put(keys[n:], _contents(chain[n:], store.layout), hint).wait()
    return Served(n, wrong)


def pace(t0: float, first_ms: int, timestamp_ms: int, speed: float | None) -> None:
    """Sleep until the request at ``timestamp_ms`` is due (``speed`` x real time)."""
    if speed:
        wait = t0 + (timestamp_ms - first_ms) / 1000.0 / speed - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


def tier_figures(store: Store, references: int) -> tuple[TierFigures, ...]:
    """Each tier of ``store`` after a replay of ``references`` block references."""
    st = store.stats()
    bn = st.block_nbytes
    return tuple(
        TierFigures(t.name, t.capacity_bytes, t.hits, t.hits / references if references else 0.0,
                    t.hit_bytes, (t.evictions + t.blocks) * bn, t.evictions)
        for t in st.tiers)


def _run(store: Store, trace: Trace, chains: Sequence[list[BlockKey]], spec: StoreSpec,
         speed: float | None, progress: Callable[[int], None] | None) -> ReplayResult:
    refs = hits = wrong = 0
    t0 = time.perf_counter()
    first_ms = trace.requests[0].timestamp_ms if trace.requests else 0
    for req, chain in zip(trace.requests, chains, strict=True):
        pace(t0, first_ms, req.timestamp_ms, speed)
        got = serve(store, chain, session_hint(req) if spec.hints else None)
        refs += len(chain)
        hits += got.hit_blocks
        wrong += got.wrong_blocks
        if progress is not None:
            progress(1)
    store.flush()
    seconds = time.perf_counter() - t0
    return ReplayResult(spec.eviction, len(trace.requests), refs, hits, wrong,
                        store.stats().put_dropped, seconds, tier_figures(store, refs),
                        spec.admission, spec.hints)
