"""The store's memory tier as the planner sees it, and the simulation of a plan on it.

:func:`simulate` replays an execution order on a cold, memory-only model of the store (LRU,
leaf-first eviction, pins, a budget in blocks) and returns the blocks each step reuses. Blocks
already cached or served by a disk tier only lower the real count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.integrations.batch.plan import SharedPrefix

__all__ = ["CacheModel", "simulate", "usable_blocks"]


class CacheModel:
    """The store's memory tier as the planner sees it: LRU, leaf-first, pins, a slot budget.

    Mirrors :class:`kvstore.store.Store` with one memory tier: a fetch touches the loaded chain
    leaf-first (so roots stay newest), a put links its first block to its parent before making
    room, evicts the oldest unpinned leaf per slot, admits fewer blocks when nothing can go and
    drops blocks whose parent is gone.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.parent: dict[bytes, bytes | None] = {}
        self.children: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}

    def held(self, k: bytes) -> bool:
        return k in self.lru

    def lookup(self, chain: Sequence[bytes]) -> int:
        n = 0
        for k in chain:
            if k not in self.lru:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[bytes]) -> None:
        for k in reversed(keys):
            if k in self.lru:
                self.lru.move_to_end(k)

    def _link(self, k: bytes, parent: bytes | None) -> None:
        self.parent[k] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def _unlink(self, k: bytes) -> None:
        p = self.parent.pop(k)
        if p is not None:
            c = self.children[p] - 1
            if c:
                self.children[p] = c
            else:
                del self.children[p]

    def _evict_one(self) -> bool:
        for k in self.lru:
            if self.pins.get(k) or self.children.get(k):
                continue
            del self.lru[k]
            self._unlink(k)
            return True
        return False

    def _room(self, n: int) -> int:
        if self.capacity is None:
            return n
        free = self.capacity - len(self.lru)
        while free < n and self._evict_one():
            free += 1
        return min(n, free)

    def put(self, chain: Sequence[bytes], first: int) -> int:
        """Put ``chain[first:]`` (the parent of ``chain[first]`` is ``chain[first-1]``)."""
        ks = chain[first:]
        prev = chain[first - 1] if first else None
        new: list[tuple[bytes, bytes | None]] = []
        for k in ks:
            if k in self.lru:
                pass
            elif prev is None or prev in self.lru or (new and new[-1][0] == prev):
                new.append((k, prev))
            else:
                break  # its prefix is gone: lookup could never reach it
            prev = k
        take = 0
        if new:
            k0, p0 = new[0]
            self._link(k0, p0)  # the parent now has a child: not a leaf while room is made
            take = self._room(len(new))
            self._unlink(k0)
            for k, p in new[:take]:
                self.lru[k] = None
                self._link(k, p)
        self.touch(ks)
        return take

    def pin(self, keys: Sequence[bytes]) -> list[bytes]:
        pinned = []
        for k in keys:
            if k not in self.lru:
                break
            self.pins[k] = self.pins.get(k, 0) + 1
            pinned.append(k)
        return pinned

    def unpin(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            c = self.pins.get(k, 0) - 1
            if c > 0:
                self.pins[k] = c
            else:
                self.pins.pop(k, None)


def usable_blocks(length: int, block_tokens: int) -> int:
    """Blocks a prompt may load: never the last token, whose logits must be computed."""
    return max(0, (length - 1) // block_tokens)


def simulate(
    chains: Sequence[Sequence[bytes]],
    lengths: Sequence[int],
    order: Sequence[int],
    *,
    block_tokens: int,
    budget_blocks: int | None,
    pins: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    groups: Sequence[SharedPrefix] = (),
    answers: Sequence[Sequence[bytes]] | None = None,
) -> list[int]:
    """Blocks reused by each step of ``order`` on a cold LRU cache of ``budget_blocks``.

    ``pins[j] = (groups pinned after step j, groups released after step j)``; a group's prefix
    is the first ``blocks`` keys of its first prompt's chain. ``answers[i]``: the keys of the
    blocks a generation puts after prompt ``i``'s (prompt + answer, from block
    ``lengths[i] // block_tokens`` on), put right after the prompt's own.
    """
    cache = CacheModel(budget_blocks)
    held: dict[int, list[bytes]] = {}
    reused: list[int] = []
    for j, i in enumerate(order):
        chain = chains[i]
        limit = min(len(chain), usable_blocks(lengths[i], block_tokens))
        n = cache.lookup(chain[:limit])
        cache.touch(chain[:n])
        cache.put(chain, n)
        if answers is not None and answers[i]:
            first = lengths[i] // block_tokens
            cache.put(list(chain[:first]) + list(answers[i]), first)
        reused.append(n)
        if pins is not None:
            pin_now, release_now = pins[j]
            for g in pin_now:
                held[g] = cache.pin(chains[groups[g].first][: groups[g].blocks])
            for g in release_now:
                cache.unpin(held.pop(g, []))
    return reused
