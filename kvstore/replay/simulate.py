"""Offline cache simulators over a trace's block references, without bytes.

* :func:`simulate_policy` drives a store eviction policy (:mod:`kvstore.tiers.policy`, the
  same code the store runs; or a published one the store does not offer,
  :mod:`kvstore.replay.baselines`: ARC, S3-FIFO) through exactly the calls a memory-only store makes for a fetch
  then a put of each request's new blocks, with the store's rules: leaf-first removal (what
  is cached stays prefix-closed) and the put's blocks that find no room dropped; with
  ``admission="second-hit"`` it inserts through the tier's doorkeeper
  (:mod:`kvstore.tiers.admission`) as the store's warm tier does.
* :func:`simulate_belady` is the offline farthest-next-use bound: it evicts (or does not
  admit) the block whose next use is farthest away. In a prefix tree a block is never used
  later than its parent, so it evicts leaves first by itself.
* :func:`unbounded` is the cache that never evicts.

Hit ratio = blocks found as a leading run / all block references.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.hints import PutHint
from kvstore.replay.baselines import HINTED, SIM_ONLY, make_baseline
from kvstore.tiers.admission import DEFAULT_ADMISSION, HintAdmission, place, tier_admission
from kvstore.tiers.policy import EvictionPolicy, make_policy

#: simulators a report can show beside the store's policies
BOUNDS = ("belady", "unbounded")


def variant(policy: str, admission: str = DEFAULT_ADMISSION, hints: bool = False) -> str:
    """A report's name for an eviction policy under an admission: ``"reuse"`` under
    ``"always"``, ``"reuse+second-hit"`` otherwise; ``+hints`` when puts carry sessions."""
    name = policy if admission == DEFAULT_ADMISSION else f"{policy}+{admission}"
    return f"{name}+hints" if hints else name


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated cache size under one policy."""

    policy: str
    capacity_blocks: int
    hits: int
    references: int
    evictions: int
    dropped: int  # blocks a put could not keep (no victim left)
    admission: str = DEFAULT_ADMISSION  # the memory tier's (kvstore.tiers.admission)
    hints: bool = False  # puts carried their request's session (kvstore.hints.PutHint)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.references if self.references else 0.0

    @property
    def label(self) -> str:
        return variant(self.policy, self.admission, self.hints)


Progress = Callable[[int], None]


def _leading(held: dict[Hashable, Hashable | None] | set[Hashable], blocks: Sequence[Hashable]) -> int:
    n = 0
    for b in blocks:
        if b not in held:
            break
        n += 1
    return n


def simulate_policy(requests: Sequence[Sequence[Hashable]], capacity_blocks: int, policy: str, *,
                    admission: str = DEFAULT_ADMISSION,
                    hints: Sequence[PutHint | None] | None = None,
                    progress: Progress | None = None) -> SimResult:
    """Hit ratio of the store's eviction policy ``policy`` with ``capacity_blocks`` slots,
    new blocks admitted by ``admission`` (the tier's, as ``MemoryTier`` applies it) and
    placed by each request's put hint (``hints``, one per request, as the store's
    :class:`~kvstore.tiers.admission.HintAdmission` applies them). The published baselines
    run under ``"always"`` and without hints, but for those in
    :data:`~kvstore.replay.baselines.HINTED`, which take the hint's verdict as they like."""
    door = tier_admission(admission, capacity_blocks)
    placer = HintAdmission() if hints is not None else None
    pol: EvictionPolicy
    if policy in SIM_ONLY:
        if door is not None or (placer is not None and policy not in HINTED):
            raise ConfigError(f"{policy!r} is simulated under admission 'always' and "
                              "without hints only")
        pol = make_baseline(policy, capacity_blocks)
    else:
        pol = make_policy(policy, capacity_blocks, probation=True)
    parent: dict[Hashable, Hashable | None] = {}
    children: dict[Hashable, int] = {}
    hits = refs = evictions = dropped = 0

    def evict_one() -> bool:
        first = pol.peek()
        if first is None or first in children:  # (children holds counts > 0 only)
            for first in pol.victims():  # the first leaf; a plain loop: this scan is hot
                if first not in children:
                    break
            else:  # leaf-first: what is cached stays prefix-closed
                return False
        pol.remove(first, for_room=True)
        if door is not None:
            door.evicted(first)
        unlink(first)
        return True

    def unlink(k: Hashable) -> None:
        p = parent.pop(k)
        if p is not None:
            left = children[p] - 1
            if left:
                children[p] = left
            else:
                del children[p]

    for i, blocks in enumerate(requests):
        refs += len(blocks)
        n = _leading(parent, blocks)
        hits += n
        if n:
            pol.touch(blocks[n - 1::-1])  # the fetch touches its run, leaf first
        new = list(blocks[n:])
        if new:
            # the store places a put before it touches or links anything
            start = (placer.start(hints[i], new, blocks[n - 1] if n else None,  # type: ignore[index]
                                  parent.__contains__) if placer is not None else 0)
            rev = new[::-1]
            pol.touch(rev)  # the put touches its chain before and after inserting
            prev = blocks[n - 1] if n else None
            for k in new:  # linked first: an ancestor of the put is not a leaf
                parent[k] = prev
                if prev is not None:
                    children[prev] = children.get(prev, 0) + 1
                prev = k
            free = capacity_blocks - (len(parent) - len(new))
            while free < len(new) and evict_one():
                free += 1
                evictions += 1
            keep = max(0, min(len(new), free))
            for k in reversed(new[keep:]):
                unlink(k)
            dropped += len(new) - keep
            for k in new[:keep]:
                place(pol, door, k, start)  # as MemoryTier.insert places it
            pol.touch(rev)
        if progress is not None and i % 256 == 255:
            progress(256)
    if progress is not None:
        progress(len(requests) % 256)
    return SimResult(policy, capacity_blocks, hits, refs, evictions, dropped, admission,
                     placer is not None)


def _next_uses(requests: Sequence[Sequence[Hashable]]) -> list[list[int]]:
    """For every reference, the request index of the next reference to the same block."""
    never = len(requests)
    last: dict[Hashable, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        blocks = requests[i]
        out[i] = [last.get(b, never) for b in blocks]
        for b in blocks:
            last[b] = i
    return out


def simulate_belady(requests: Sequence[Sequence[Hashable]], capacity_blocks: int, *,
                    progress: Progress | None = None) -> SimResult:
    """The offline farthest-next-use bound (with bypass: a block used later than every
    cached one, or never, is not admitted)."""
    nxt = _next_uses(requests)
    never = len(requests)
    when: dict[Hashable, int] = {}  # cached block -> its next use
    children: dict[Hashable, int] = {}
    parent: dict[Hashable, Hashable | None] = {}
    heap: list[tuple[int, Hashable]] = []  # (-next use, block), stale entries skipped
    hits = refs = evictions = 0

    def top() -> tuple[int, Hashable] | None:
        while heap:
            neg, b = heap[0]
            if when.get(b) == -neg and not children.get(b):
                return -neg, b
            heapq.heappop(heap)
        return None

    def drop(b: Hashable) -> None:
        del when[b]
        p = parent.pop(b)
        if p is not None:
            children[p] -= 1
            if not children[p]:
                del children[p]
                heapq.heappush(heap, (-when[p], p))

    for i, blocks in enumerate(requests):
        refs += len(blocks)
        n = _leading(parent, blocks)
        hits += n
        for j in range(n):
            b = blocks[j]
            when[b] = nxt[i][j]
            if not children.get(b):
                heapq.heappush(heap, (-when[b], b))
        anchor = blocks[n - 1] if n else None
        if anchor is not None:  # while making room, the block the chain hangs off is no leaf
            children[anchor] = children.get(anchor, 0) + 1
        linked = False
        for j in range(n, len(blocks)):
            use = nxt[i][j]
            if use >= never:
                break  # never used again, nor is anything below it
            if len(when) >= capacity_blocks:
                t = top()
                if t is None or t[0] <= use:
                    break
                heapq.heappop(heap)
                drop(t[1])
                evictions += 1
            b = blocks[j]
            p = blocks[j - 1] if j else None
            parent[b] = p
            when[b] = use
            if j == n:
                linked = True  # the anchor's guard becomes this link
            elif p is not None:
                children[p] = children.get(p, 0) + 1
            heapq.heappush(heap, (-use, b))
        if anchor is not None and not linked:
            children[anchor] -= 1
            if not children[anchor]:
                del children[anchor]
                heapq.heappush(heap, (-when[anchor], anchor))
        if progress is not None and i % 256 == 255:
            progress(256)
    if progress is not None:
        progress(len(requests) % 256)
    return SimResult("belady", capacity_blocks, hits, refs, evictions, 0)


def unbounded(requests: Sequence[Sequence[Hashable]]) -> SimResult:
    """A cache that never evicts: every block after its first reference hits."""
    seen: set[Hashable] = set()
    hits = refs = 0
    for blocks in requests:
        refs += len(blocks)
        for b in blocks:  # a block seen before has its whole prefix seen before
            if b not in seen:
                break
            hits += 1
        seen.update(blocks)
    return SimResult("unbounded", len(seen), hits, refs, 0, 0)
