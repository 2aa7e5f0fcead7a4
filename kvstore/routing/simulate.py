"""The routing policies on a request trace: N engines, each an LRU prefix cache.

Each simulated engine keeps its blocks the way the store does (LRU, touched leaf first and
root last, only leaves leave, so what it holds stays prefix-closed) and reports its changes
through the same path a store's publisher uses (a :class:`~kvstore.events.mirror.Mirror`
turning tier changes into events, optionally encoded and decoded as on the wire) into a
:class:`PrefixIndex`; the router sees only that index. Hit ratio = blocks found as a leading
run on the engine a request went to / all block references; load = input tokens each engine
had to compute.

    python -m kvstore.routing.simulate ../shared/traces/mooncake_conversation.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError
from kvstore.events.codec import decode_batch, encode_batch
from kvstore.events.mirror import Mirror
from kvstore.events.types import EventBatch
from kvstore.routing.index import PrefixIndex
from kvstore.routing.policies import DEFAULT_IMBALANCE, make_policy
from kvstore.routing.router import Router


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_s: float
    input_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path) -> list[TraceRequest]:
    """A Mooncake-style JSONL trace: ``timestamp`` (ms), ``input_length``, ``hash_ids``."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:  # bytes decoded here: a line that is not UTF-8 names its line too
                r = json.loads(raw.decode("utf-8"))
                ids = tuple(int(h) for h in r["hash_ids"])
                out.append(TraceRequest(float(r["timestamp"]) / 1000, int(r["input_length"]), ids))
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
                raise ConfigError(f"{path}:{n}: not a trace request ({type(e).__name__}: "
                                  f"{str(e)[:120]}); each line needs timestamp, input_length "
                                  "and hash_ids") from None
    return out


class LruEngine:
    """An engine's prefix cache of ``capacity`` blocks, reporting to ``index`` as ``name``."""

    def __init__(self, name: str, capacity: int, index: PrefixIndex, *, wire: bool = False) -> None:
        self.name = name
        self.capacity = capacity
        self.index = index
        self.wire = wire
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._kids: dict[int, int] = {}  # cached children per cached block
        self._parent: dict[int, int | None] = {}
        self._mirror = Mirror(block_size=1)
        index.add_engine(name)

    def _report(self, events) -> None:
        if not events:
            return
        if self.wire:
            events = decode_batch(encode_batch(EventBatch(0.0, tuple(events)))).events
        self.index.apply(self.name, events)

    def serve(self, keys: Sequence[int]) -> int:
        """Look the request up (its leading cached run), then cache all of it."""
        lru = self._lru
        hit = 0
        while hit < len(keys) and keys[hit] in lru:
            hit += 1
        for k in reversed(keys[:hit]):  # the lookup's touch: the hit is kept while making room
            lru.move_to_end(k)
        new, parents, gone = [], [], []
        prev = keys[hit - 1] if hit else None
        for k in keys[hit:]:
            if len(lru) >= self.capacity and not self._evict(gone, protect=prev):
                break  # no room: the rest is dropped, like a put that finds none
            lru[k] = None
            self._parent[k] = prev
            self._kids[k] = 0
            if prev is not None:
                self._kids[prev] += 1
            new.append(k)
            parents.append(prev)
            prev = k
        for k in reversed(keys[:hit + len(new)]):  # leaf first, root last: roots stay newest
            lru.move_to_end(k)
        self._report(self._mirror.removed("warm", gone) + self._mirror.stored("warm", new, parents))
        return hit

    def _evict(self, gone: list[int], protect: int | None) -> bool:
        for k in self._lru:
            if self._kids[k] or k == protect:
                continue
            del self._lru[k]
            del self._kids[k]
            p = self._parent.pop(k)
            if p is not None and p in self._kids:
                self._kids[p] -= 1
            gone.append(k)
            return True
        return False


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    engines: int
    capacity_blocks: int  # per engine
    requests: int
    hit_ratio: float
    loads: tuple[int, ...]  # input tokens computed per engine
    max_over_mean: float
    exploit: int  # requests the prefix policy sent to a cached prefix (0 for the others)
    mispredicted: int  # requests whose hit differed from what the index told the router


def simulate(trace: Sequence[TraceRequest], policy: str, *, engines: int = 4,
             capacity_share: float = 0.02, block_tokens: int = 512, hash_blocks: int = 4,
             imbalance: float = DEFAULT_IMBALANCE, load_window_s: float = 180.0,
             wire: bool = False) -> SimResult:
    """Route ``trace`` with ``policy`` over ``engines`` LRU engines, each holding
    ``capacity_share`` of the trace's unique blocks."""
    unique = len({h for r in trace for h in r.hash_ids})
    cap = max(1, int(unique * capacity_share))
    index = PrefixIndex()
    names = [f"engine-{i}" for i in range(engines)]
    lrus = {n: LruEngine(n, cap, index, wire=wire) for n in names}
    router = Router(names, index, make_policy(policy, block_tokens=block_tokens,
                                              hash_blocks=hash_blocks, imbalance=imbalance),
                    block_tokens=block_tokens, load_window_s=load_window_s)
    hits = refs = exploit = wrong = 0
    loads = dict.fromkeys(names, 0)
    for req in trace:
        r = router.route_keys(req.hash_ids, now=req.timestamp_s)
        told = (r.cached_blocks if router.policy.uses_index
                else index.match(req.hash_ids, [r.engine]).blocks[0])
        hit = lrus[r.engine].serve(req.hash_ids)
        wrong += hit != told
        hits += hit
        refs += len(req.hash_ids)
        exploit += r.mode == "exploit"
        loads[r.engine] += max(0, req.input_length - hit * block_tokens)
    total = tuple(loads[n] for n in names)
    mean = sum(total) / len(total)
    return SimResult(policy, engines, cap, len(trace), hits / max(refs, 1), total,
                     max(total) / mean if mean else 1.0, exploit, wrong)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.routing.simulate",
                                description="Routing policies on a request trace.")
    p.add_argument("trace")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--share", type=float, action="append",
                   help="engine capacity as a share of the unique blocks (repeatable; "
                        "default 0.02 and 0.05)")
    p.add_argument("--block-tokens", type=int, default=512)
    p.add_argument("--format", choices=["table", "json"], default="table")
    args = p.parse_args(argv)
    trace = load_trace(args.trace)
    shares = args.share or [0.02, 0.05]
    rows = [(share, simulate(trace, pol, engines=args.engines, capacity_share=share,
                             block_tokens=args.block_tokens))
            for share in shares for pol in ("round-robin", "hash", "prefix")]
    if args.format == "json":
        print(json.dumps([{"share": sh, **dataclasses.asdict(r)} for sh, r in rows]))
        return 0
    print(f"{args.engines} engines, {len(trace)} requests")
    print(f"{'share':>6} {'blocks':>7} {'policy':<12} {'hit ratio':>9} {'vs rr':>6} "
          f"{'max/mean load':>13}")
    base: dict[float, float] = {}
    for share, r in rows:
        if r.policy == "round-robin":
            base[share] = r.hit_ratio
        print(f"{share:>6.1%} {r.capacity_blocks:>7} {r.policy:<12} {r.hit_ratio:>9.3f} "
              f"{r.hit_ratio / base[share]:>5.2f}x {r.max_over_mean:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
