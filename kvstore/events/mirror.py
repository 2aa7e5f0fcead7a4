"""A publisher's picture of one namespace's blocks: which tiers hold each, and its parent.

Built from the same sink calls the events are made of, in the publisher's thread, so it is
exactly the state a consumer reaches by applying every batch published so far. It keeps the
namespace **prefix-closed**, as the store keeps itself and as consumers keep their index
(:mod:`kvstore.routing.index`): a block whose parent is held nowhere is not announced, and a
block that leaves its last tier takes its descendants with it (each announced removed). It
drops repeated announcements, turns a per-tier ``cleared`` into removals of what that tier
held, and yields the snapshot a consumer resyncs from. About 250 bytes per block held.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvstore.events.types import TIER_MEDIUM, BlockRemoved, BlockStored, Event
from kvstore.keys import BlockKey

_TIERS = tuple(TIER_MEDIUM)  # hot, warm, disk
_BIT = {t: 1 << i for i, t in enumerate(_TIERS)}


def _tier_bits(tier: str | None) -> list[tuple[str, int]]:
    if tier is None:
        return list(_BIT.items())
    if tier not in _BIT:
        raise ValueError(f"tier must be one of {', '.join(_TIERS)} or None, got {tier!r}")
    return [(tier, _BIT[tier])]


class Mirror:
    """One namespace's blocks per tier. Not thread-safe: the publisher's thread owns it."""

    def __init__(self, block_size: int, max_run: int = 4096) -> None:
        self.block_size = block_size
        self.max_run = max_run
        self.dropped = 0  # blocks stored under a parent held nowhere (never announced)
        self._bits: dict[BlockKey, int] = {}
        self._parent: dict[BlockKey, BlockKey | None] = {}
        self._children: dict[BlockKey, set[BlockKey]] = {}

    def __len__(self) -> int:
        return len(self._bits)

    def tiers_of(self, key: BlockKey) -> tuple[str, ...]:
        b = self._bits.get(key, 0)
        return tuple(t for t in _TIERS if b & _BIT[t])

    def _run_event(self, tier: str, run: list[BlockKey]) -> BlockStored:
        return BlockStored(tuple(run), self._parent[run[0]], (), self.block_size,
                           TIER_MEDIUM[tier])

    def stored(self, tier: str, keys: Sequence[BlockKey],
               parents: Sequence[BlockKey | None]) -> list[Event]:
        ((_, bit),) = _tier_bits(tier)
        out: list[Event] = []
        run: list[BlockKey] = []
        bits, parent_of, children = self._bits, self._parent, self._children
        for k, p in zip(keys, parents, strict=True):
            b = bits.get(k, 0)
            if b & bit:
                continue  # announced already
            if not b:
                if p is not None and p not in bits:
                    self.dropped += 1  # nobody could reach it from a prompt's first block
                    continue
                parent_of[k] = p
                if p is not None:
                    children.setdefault(p, set()).add(k)
            bits[k] = b | bit
            if run and (parent_of[k] != run[-1] or len(run) >= self.max_run):
                out.append(self._run_event(tier, run))
                run = []
            run.append(k)
        if run:
            out.append(self._run_event(tier, run))
        return out

    def removed(self, tier: str | None, keys: Sequence[BlockKey]) -> list[Event]:
        gone: dict[str, list[BlockKey]] = {t: [] for t in _TIERS}
        bits = self._bits
        for t, bit in _tier_bits(tier):
            for k in keys:
                b = bits.get(k, 0)
                if not b & bit:
                    continue
                if b != bit:
                    bits[k] = b & ~bit
                    gone[t].append(k)
                else:
                    self._drop(k, gone)
        out: list[Event] = []
        for t, ks in gone.items():
            for i in range(0, len(ks), self.max_run):
                out.append(BlockRemoved(tuple(ks[i:i + self.max_run]), TIER_MEDIUM[t]))
        return out

    def _drop(self, root: BlockKey, gone: dict[str, list[BlockKey]]) -> None:
        """``root`` and its descendants leave every tier."""
        bits, children = self._bits, self._children
        stack = [root]
        while stack:
            k = stack.pop()
            b = bits.pop(k, 0)
            if not b:
                continue
            for t in _TIERS:
                if b & _BIT[t]:
                    gone[t].append(k)
            stack.extend(children.pop(k, ()))
            p = self._parent.pop(k)
            if p is not None and p in children:
                sib = children[p]
                sib.discard(k)
                if not sib:
                    del children[p]

    def cleared(self, tier: str | None) -> list[Event]:
        mask = sum(bit for _, bit in _tier_bits(tier))
        return self.removed(tier, [k for k, b in self._bits.items() if b & mask])

    def snapshot(self) -> Iterator[BlockStored]:
        """``BlockStored`` events that rebuild this state, parents always announced before
        their children (a consumer keeps only blocks whose parent it knows)."""
        bits, children = self._bits, self._children
        # depth-first, preorder: a run follows a chain while its blocks sit in the same tiers;
        # a run is complete before the next starts, so every run's parent came out before it
        run: list[BlockKey] = []
        stack = [k for k, p in self._parent.items() if p is None][::-1]
        while stack:
            k = stack.pop()
            if run and (self._parent[k] != run[-1] or bits[k] != bits[run[0]]
                        or len(run) >= self.max_run):
                yield from self._emit_run(run)
                run = []
            run.append(k)
            stack.extend(children.get(k, ()))
        if run:
            yield from self._emit_run(run)

    def _emit_run(self, run: list[BlockKey]) -> Iterator[BlockStored]:
        b = self._bits[run[0]]
        for t in _TIERS:
            if b & _BIT[t]:
                yield self._run_event(t, run)
