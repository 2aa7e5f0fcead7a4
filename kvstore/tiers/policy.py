"""Eviction policies of the memory tiers: in which order a tier offers its blocks for eviction.

A policy only orders; the store decides. It walks :meth:`EvictionPolicy.victims` and skips
what may not go (pinned blocks, blocks with cached children, blocks the disk writer has not
reached), so every policy keeps the store's guarantees: prefix-closed, pins, byte budgets
(one slot per block), no dirty block lost.

* ``"lru"``: least recently used first. The store touches a chain leaf first, so the oldest
  entries are leaves and a victim is found in a step or two.
* ``"adaptive"`` (:class:`~kvstore.tiers.adaptive_policy.AdaptivePolicy`, the default) and
  ``"reuse"`` (:class:`~kvstore.tiers.reuse_policy.ReusePolicy`): recency plus reuse. Each use
  of a block buys it ``scale`` more tier-turnovers of retention (up to three uses count): the
  victim is the block whose ``last use + min(uses, 3) x scale x slots`` (time counted in blocks
  inserted) is smallest, ``scale`` picked online by
  :class:`~kvstore.tiers.tuning.ScaleTuner`. ``"reuse"`` keeps the ranks in a timing wheel;
  ``"adaptive"`` computes them at eviction time from one LRU list per use class, so a new
  scale applies at once. What both share (use classes, the ghost list, the tuner's sampling):
  :mod:`kvstore.tiers.use_classes`.

A block can be inserted *on probation* (second-hit admission, :mod:`kvstore.tiers.admission`):
at the victim end of the order instead of where a new block goes, so it is the first to go
unless it is touched again. The touch that follows its insert (the put's own, or the fetch's
that promoted it) leaves it there; the next one lifts it as any touch moves a block. A policy
never pays for probation while it has none: one truthiness test per touch.

Not thread-safe: the store serialises access under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from itertools import chain
from typing import Protocol

from kvstore.errors import ConfigError
from kvstore.tiers.adaptive_policy import AdaptivePolicy
from kvstore.tiers.reuse_policy import ReusePolicy

#: eviction policy names accepted by ``open_store(eviction=...)``
EVICTIONS = ("lru", "reuse", "adaptive")
#: the default eviction policy of the memory tiers
DEFAULT_EVICTION = "adaptive"


class EvictionPolicy(Protocol):
    """The order in which a memory tier offers its blocks for eviction."""

    name: str

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        """``key`` joined the tier (or was republished under another slot: ``probation`` and
        ``uses`` ignored). ``probation``: at the victim end, and still there after the next
        touch call (the insert's own touch); lifted by the touch after that (see the module
        docstring). ``uses``: it starts as if used that many times (a put's priority hint;
        policies that do not count uses ignore it)."""

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        """``key`` left the tier: evicted or demoted to make room (``for_room``), or removed
        on request (``evict()``, a failed copy)."""

    def touch(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were used now, leaf first (the last one is the chain's root)."""

    def victims(self) -> Iterator[Hashable]:
        """Every key of the tier, best victim first. Live: the tier must not change before
        the iteration ends (the store stops iterating at the first change)."""

    def peek(self) -> Hashable | None:
        """The best victim (``next(victims())`` without an iterator), None when empty."""

    def order(self) -> list[Hashable]:
        """:meth:`victims` as a list (a snapshot)."""

    def state(self) -> str:
        """What the policy has chosen lately, for ``stats`` (e.g. ``"scale 2, second-hit"``);
        empty when it chooses nothing."""


class LRUPolicy:
    """Least recently used first. Without probation (``make_policy(..., probation=True)``
    gives :class:`ProbationLRU`): the default path pays nothing for admission."""

    name = "lru"
    __slots__ = ("_lru",)

    def __init__(self) -> None:
        self._lru: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        if probation:
            raise TypeError("this LRUPolicy has no probation: make_policy(..., probation=True)")
        self._lru[key] = None
        self._lru.move_to_end(key)

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        del self._lru[key]

    def touch(self, keys: Iterable[Hashable]) -> None:
        lru = self._lru
        if not lru:
            return
        move = lru.move_to_end
        for k in keys:
            if k in lru:
                move(k)

    def victims(self) -> Iterator[Hashable]:
        return iter(self._lru)

    def peek(self) -> Hashable | None:
        return next(iter(self._lru)) if self._lru else None

    def order(self) -> list[Hashable]:
        return list(self._lru)

    def state(self) -> str:
        return ""


class ProbationLRU(LRUPolicy):
    """LRU with blocks on probation before all others, first in first out among them."""

    __slots__ = ("_prob", "_fresh")

    def __init__(self) -> None:
        super().__init__()
        # on probation: the victim end, first in first out
        self._prob: OrderedDict[Hashable, None] = OrderedDict()
        # keys inserted on probation since the last touch call, in insertion order
        self._fresh: dict[Hashable, None] = {}

    def __len__(self) -> int:
        return len(self._lru) + len(self._prob)

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        if key in self._prob:
            return  # republished while on probation: stays there
        if probation and key not in self._lru:
            self._prob[key] = None
            self._fresh[key] = None
            return
        self._lru[key] = None
        self._lru.move_to_end(key)

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        prob = self._prob
        if key in prob:
            del prob[key]
            self._fresh.pop(key, None)
            return
        del self._lru[key]

    def touch(self, keys: Iterable[Hashable]) -> None:
        """A touch lifts a block on probation to the newest end, except the touch right
        after its insert (the insert's own, ``_fresh``)."""
        lru, prob, fresh = self._lru, self._prob, self._fresh
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            elif k in prob and k not in fresh:
                del prob[k]
                lru[k] = None
        if fresh:
            # behind the earlier probation blocks, a chain's leaf first (inserted root first)
            for k in reversed(fresh):
                if k in prob:
                    prob.move_to_end(k)
            self._fresh = {}

    def victims(self) -> Iterator[Hashable]:
        return chain(self._prob, self._lru) if self._prob else iter(self._lru)

    def peek(self) -> Hashable | None:
        if self._prob:
            return next(iter(self._prob))
        return next(iter(self._lru)) if self._lru else None

    def order(self) -> list[Hashable]:
        return list(self.victims())


def make_policy(name: str, slots: int, *, probation: bool = False) -> EvictionPolicy:
    """The eviction policy ``name`` for a tier of ``slots`` blocks; ``probation``: one whose
    ``insert`` takes ``probation=True`` (a tier with second-hit admission)."""
    if name == "lru":
        return ProbationLRU() if probation else LRUPolicy()
    if name == "reuse":
        return ReusePolicy(slots)
    if name == "adaptive":
        return AdaptivePolicy(slots, probation=probation)
    raise ConfigError(f"eviction must be one of {', '.join(map(repr, EVICTIONS))}, got {name!r}")
