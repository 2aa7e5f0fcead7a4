"""Eviction policies of the memory tiers: in which order a tier offers its blocks for eviction.

A policy only orders; the store decides. It walks :meth:`EvictionPolicy.victims` and skips
what may not go (pinned blocks, blocks with cached children, blocks the disk writer has not
reached), so every policy keeps the store's guarantees: prefix-closed, pins, byte budgets
(one slot per block), no dirty block lost.

* ``"lru"``: least recently used first. The store touches a chain leaf first, so the oldest
  entries are leaves and a victim is found in a step or two.
* ``"reuse"`` (:class:`ReusePolicy`, the default): recency plus reuse. Each use of a block
  buys it ``scale`` more tier-turnovers of retention (up to three uses count): the victim is
  the block whose ``last use + min(uses, 3) x scale x slots`` (time counted in blocks
  inserted) is smallest. Uses survive eviction in a ghost list of the keys last evicted (3-6x
  the tier's slots, keys only), so a block asked for again soon after it left comes back
  with its uses. In a prefix cache uses accumulate where chains meet: a block many chains
  pass through (a shared system prompt, a document many questions hang off, the turns of a
  long conversation) is used by each of them. ``scale`` is not a constant fitted to a trace:
  :class:`~kvstore.tiers.tuning.ScaleTuner` picks it (0 = LRU ... 4) from shadow caches
  over a sample of the keys. A tuned tier starts as LRU and leaves it only once its shadows
  show reuse paying, so where uses do not predict the next use (the next turn of a chat
  wants the blocks just written) the tier stays LRU; tiers too small to tune rank at scale
  1 (the smaller the cache, the more a use is worth keeping). A block is ranked at least as
  high as any block below it in the chain (a hit on the child needs the parent), which
  keeps leaves first in the order.

A block can be inserted *on probation* (second-hit admission, :mod:`kvstore.tiers.admission`):
at the victim end of the order instead of where a new block goes, so it is the first to go
unless it is touched again. The touch that follows its insert (the put's own, or the fetch's
that promoted it) leaves it there; the next one lifts it as any touch moves a block. A policy
never pays for probation while it has none: one truthiness test per touch.

Not thread-safe: the store serialises access under its lock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from functools import partial
from itertools import chain
from typing import Protocol

from kvstore.errors import ConfigError
from kvstore.tiers.tuning import (
    ADAPTIVE_GUARD,
    ADAPTIVE_MIN_SLOTS,
    MIN_SLOTS,
    ScaleTuner,
    adaptive_mask,
    make_shadow,
)

#: eviction policy names accepted by ``open_store(eviction=...)``
EVICTIONS = ("lru", "reuse", "adaptive")
#: the default eviction policy of the memory tiers
DEFAULT_EVICTION = "adaptive"
#: use classes of :class:`ReusePolicy` (0, 1, 2, 3+ uses)
USE_CLASSES = 4
MAX_CLASS = USE_CLASSES - 1
#: retention per use of a tuned tier before its shadows have shown reuse pays: LRU
TUNED_START = 0.0
#: retention per use of a tier too small to tune (small caches gain most from reuse)
UNTUNED_SCALE = 1.0
#: ghost entries (evicted keys and their uses) per slot of the tier
GHOSTS_PER_SLOT = 6
#: rank resolution of :class:`ReusePolicy`: buckets per tier turnover
BUCKETS_PER_TURNOVER = 64


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


class ReusePolicy:
    """Recency plus reuse with a ghost list (see the module docstring).

    A use is a touch; touches of a block in consecutive touch calls (a fetch and then the
    put of the same request) count as one use. The order is a timing wheel: a block's rank
    ``last use + class x scale x slots`` falls in a bucket of ``slots / 64`` ticks, each
    bucket an LRU list; the victim is the oldest block of the lowest bucket, so a touch, an
    insert and an eviction each cost a few dict operations.
    """

    name = "reuse"
    __slots__ = ("_buckets", "_low", "_info", "_ghost", "_ghost_old", "_ghost_cap", "_slots",
                 "_width", "_clock", "_call", "_tuner", "_scale", "_step", "_mask", "_fresh",
                 "_prob_bucket")

    def __init__(self, slots: int, *, ghosts: int = GHOSTS_PER_SLOT, scale: float | None = None,
                 tune: bool = True) -> None:
        self._buckets: dict[int, OrderedDict[Hashable, None]] = {}
        self._low = 0  # no bucket below this one holds a key
        # per key held: [bucket, use class (uses, at most USE_CLASSES - 1), last touch call]
        self._info: dict[Hashable, list[int]] = {}
        # evicted key -> its uses, in two generations of ghosts/2 x slots keys each: when the
        # new one is full the old one is dropped whole (a FIFO at O(1) and no OrderedDict)
        self._ghost: dict[Hashable, int] = {}
        self._ghost_old: dict[Hashable, int] = {}
        self._slots = max(1, slots)
        self._width = max(1, self._slots // BUCKETS_PER_TURNOVER)
        self._ghost_cap = max(1, ghosts * self._slots // 2)  # per generation
        self._clock = 0  # blocks inserted: the tier's turnover
        self._call = 0  # touch calls
        tuned = tune and slots >= MIN_SLOTS
        start = scale if scale is not None else (TUNED_START if tuned else UNTUNED_SCALE)
        self._scale = start  # retention per use, in tier turnovers (the tuner's, when tuned)
        self._step = start * self._slots  # ticks of retention per use
        self._tuner = (ScaleTuner(slots, start, partial(make_shadow, classes=USE_CLASSES,
                                                        ghosts=ghosts))
                       if tuned else None)
        self._mask = self._tuner.mask if self._tuner is not None else 0
        # keys inserted on probation since the last touch call, in insertion order
        self._fresh: dict[Hashable, None] = {}
        self._prob_bucket: int | None = None  # the bucket of the blocks on probation

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._info

    @property
    def scale(self) -> float:
        """Retention a use buys, in tier turnovers (the tuner's current choice)."""
        return self._scale

    def _sample(self, key: Hashable) -> None:
        """A use or a miss of a sampled key: the tuner's shadows see it."""
        tuner = self._tuner
        assert tuner is not None
        tuner.reference(key)
        if tuner.scale != self._scale:
            self._scale = tuner.scale
            self._step = tuner.scale * self._slots

    def _put(self, key: Hashable, b: int) -> None:
        q = self._buckets.get(b)
        if q is None:
            q = self._buckets[b] = OrderedDict()
            if b < self._low or len(self._buckets) == 1:
                self._low = b
        q[key] = None

    def _drop_bucket(self, b: int) -> None:
        buckets = self._buckets
        del buckets[b]
        if b == self._low and buckets:
            low = b + 1
            while low not in buckets:
                low += 1
            self._low = low

    def _probation_bucket(self) -> int:
        """Where a block on probation goes: the bucket of the blocks already on probation
        while it is the lowest (first in first out among them), else a new one below every
        bucket held and below every rank a touch or an insert can give from now on (those
        are at least the clock's bucket): the first to go."""
        b = self._prob_bucket
        if b is not None and b == self._low and b in self._buckets:
            return b
        b = (self._clock - self._slots) // self._width
        if self._buckets and self._low <= b:
            b = self._low - 1
        self._prob_bucket = b
        return b

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        self._clock = clock = self._clock + 1
        info = self._info
        e = info.get(key)
        if e is not None:  # republished under another slot
            e[2] = self._call
            self._buckets[e[0]].move_to_end(key)
            return
        back = self._ghost.pop(key, None)
        if back is None and self._ghost_old:
            back = self._ghost_old.pop(key, None)
        if back is None and not uses:
            b = clock // self._width
            if probation:
                b = self._probation_bucket()
                self._fresh[key] = None
        else:  # seen before (its uses came back from the ghost list) or hinted: no probation
            c = max(uses, back + 1 if back is not None else 0)
            uses = c if c < MAX_CLASS else MAX_CLASS
            b = int(clock + uses * self._step) // self._width
        # seen by this call: the touch right after an insert is not a use
        info[key] = [b, uses, self._call]
        q = self._buckets.get(b)
        if q is None:
            self._put(key, b)
        else:
            q[key] = None
        # sampled by the key's last byte (a SHA-256 digest: uniform, and the same in every
        # process, unlike hash() of bytes); other keys (tests, simulators) by hash()
        if self._tuner is not None and not (
                key[-1] if type(key) is bytes else hash(key)) & self._mask:  # type: ignore[index]
            self._sample(key)  # a miss of the tier

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        if self._fresh:
            self._fresh.pop(key, None)
        e = self._info.pop(key)
        b = e[0]
        q = self._buckets[b]
        del q[key]
        if not q:
            self._drop_bucket(b)
        if for_room:
            ghost = self._ghost
            ghost[key] = e[1]
            if len(ghost) >= self._ghost_cap:
                self._ghost_old, self._ghost = ghost, {}

    def touch(self, keys: Iterable[Hashable]) -> None:
        info = self._info
        if not info:
            return
        self._call = call = self._call + 1
        last = call - 1
        tuner, mask = self._tuner, self._mask
        step, base, width = self._step, self._clock, self._width
        ranks = [(base + int(c * step)) // width for c in range(USE_CLASSES)]
        buckets = self._buckets
        floor = -1  # the bucket of the block below: a parent ranks at least as high
        qb, q = -1, None  # the bucket last moved into (a chain mostly shares one)
        for k in keys:  # leaf first
            e = info.get(k)
            if e is None:
                continue
            if e[2] < last:
                if e[1] < MAX_CLASS:
                    e[1] += 1
                if tuner is not None and not (
                        k[-1] if type(k) is bytes else hash(k)) & mask:  # type: ignore[index]
                    self._sample(k)  # a hit of the tier
                    step = self._step
                    ranks = [(base + int(c * step)) // width for c in range(USE_CLASSES)]
            e[2] = call
            b = ranks[e[1]]
            if b < floor:
                b = floor
            floor = b
            old = e[0]
            if b == old:
                if b != qb:
                    q, qb = buckets[b], b
                q.move_to_end(k)  # type: ignore[union-attr]
                continue
            src = buckets[old]
            del src[k]
            if not src:
                if old == qb:
                    qb = -1
                self._drop_bucket(old)
            if b != qb:
                q = buckets.get(b)
                if q is None:
                    q = buckets[b] = OrderedDict()
                    if b < self._low or len(buckets) == 1:
                        self._low = b
                qb = b
            q[k] = None  # type: ignore[index]
            e[0] = b
        if self._fresh:
            self._settle()

    def _settle(self) -> None:
        """The insert's own touch is over: its probation keys back to the probation bucket,
        a chain leaf first (they were inserted root first), behind earlier probation keys."""
        info, buckets = self._info, self._buckets
        b = self._probation_bucket()
        for k in reversed(self._fresh):
            e = info.get(k)
            if e is None:
                continue
            old = e[0]
            src = buckets[old]
            del src[k]
            if not src:
                self._drop_bucket(old)
            self._put(k, b)
            e[0] = b
        self._fresh = {}

    def victims(self) -> Iterator[Hashable]:
        buckets = self._buckets
        if len(buckets) <= 1:
            return iter(buckets[self._low]) if buckets else iter(())
        return self._walk(self._low)

    def peek(self) -> Hashable | None:
        return next(iter(self._buckets[self._low])) if self._buckets else None

    def _walk(self, low: int) -> Iterator[Hashable]:
        buckets = self._buckets
        yield from buckets[low]  # most evictions stop here
        for b in sorted(buckets):
            if b > low:
                yield from buckets[b]

    def order(self) -> list[Hashable]:
        return list(self.victims())

    def uses(self, key: Hashable) -> int:
        """Uses of a held key (ghost uses included), counted up to ``USE_CLASSES - 1``."""
        return self._info[key][1]


class AdaptivePolicy:
    """Recency plus reuse whose weight is chosen online and switches at once (``"adaptive"``,
    the default; see the module docstring).

    A block's rank is ``last use + class x scale x slots`` as under :class:`ReusePolicy`,
    but the order is one LRU list per use class (0, 1, 2, 3+ uses) and the rank is computed
    only at eviction time, from the lists' oldest entries: a new ``scale`` applies to every
    block at once, with no ranks given under the old one left to age out. The
    :class:`~kvstore.tiers.tuning.ScaleTuner`'s shadows are this very structure in
    miniature, so what they measure is what the tier would do; its scale 0 is LRU (the
    victim is the oldest head), so a tier whose shadows show reuse not paying evicts exactly
    as LRU does from the next eviction on. A parent joins at least its child's class on a
    touch (every use of a child is a use of its parent), so a parent never ranks below a
    child touched with it and leaves stay first. Blocks on probation wait in a FIFO before
    all others.
    """

    name = "adaptive"
    __slots__ = ("_lists", "_info", "_ghost", "_ghost_old", "_ghost_cap", "_slots", "_clock",
                 "_call", "_tuner", "_scale", "_off", "_mask", "_prob", "_fresh")

    def __init__(self, slots: int, *, ghosts: int = GHOSTS_PER_SLOT, scale: float | None = None,
                 tune: bool = True, probation: bool = False) -> None:
        # one LRU list per use class, oldest use first
        self._lists: list[OrderedDict[Hashable, None]] = [OrderedDict()
                                                          for _ in range(USE_CLASSES)]
        # per key held: [use class, last touch call, clock at its last use]
        self._info: dict[Hashable, list[int]] = {}
        self._ghost: dict[Hashable, int] = {}
        self._ghost_old: dict[Hashable, int] = {}
        self._slots = max(1, slots)
        self._ghost_cap = max(1, ghosts * self._slots // 2)
        self._clock = 0  # blocks inserted: the tier's turnover
        self._call = 0  # touch calls
        tuned = tune and slots >= ADAPTIVE_MIN_SLOTS
        start = scale if scale is not None else (TUNED_START if tuned else UNTUNED_SCALE)
        self._scale = start
        self._off = [int(c * start * self._slots) for c in range(USE_CLASSES)]
        self._tuner = (ScaleTuner(slots, start, partial(make_shadow, classes=USE_CLASSES,
                                                        ghosts=ghosts),
                                  mask=adaptive_mask(slots), guard=ADAPTIVE_GUARD)
                       if tuned else None)
        self._mask = self._tuner.mask if self._tuner is not None else 0
        # blocks on probation (a tier with second-hit admission): first in first out, before
        # every class list; None without probation
        self._prob: OrderedDict[Hashable, None] | None = OrderedDict() if probation else None
        self._fresh: dict[Hashable, None] = {}

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._info

    @property
    def scale(self) -> float:
        """Retention a use buys, in tier turnovers (the tuner's current choice)."""
        return self._scale

    def _sample(self, key: Hashable) -> None:
        tuner = self._tuner
        assert tuner is not None
        tuner.reference(key)
        if tuner.scale != self._scale:
            self._scale = s = tuner.scale
            self._off = [int(c * s * self._slots) for c in range(USE_CLASSES)]

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        self._clock = clock = self._clock + 1
        info = self._info
        e = info.get(key)
        if e is not None:  # republished under another slot
            e[1] = self._call
            prob = self._prob
            if not (prob and key in prob):
                e[2] = clock
                self._lists[e[0]].move_to_end(key)
            return
        back = self._ghost.pop(key, None)
        if back is None and self._ghost_old:
            back = self._ghost_old.pop(key, None)
        if back is None:
            c = uses if uses < MAX_CLASS else MAX_CLASS
            if probation and not c:
                if self._prob is None:
                    raise TypeError("this AdaptivePolicy has no probation: "
                                    "make_policy(..., probation=True)")
                info[key] = [0, self._call, clock]
                self._prob[key] = None
                self._fresh[key] = None
                self._after_insert(key)
                return
        else:  # its uses came back from the ghost list: seen before, no probation
            c = max(uses, back + 1 if back < MAX_CLASS else MAX_CLASS)
        info[key] = [c, self._call, clock]  # seen by this call: its next touch is no use
        self._lists[c][key] = None
        self._after_insert(key)

    def _after_insert(self, key: Hashable) -> None:
        if self._tuner is not None and not (
                key[-1] if type(key) is bytes else hash(key)) & self._mask:  # type: ignore[index]
            self._sample(key)  # a miss of the tier

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        e = self._info.pop(key)
        prob = self._prob
        if prob and key in prob:
            del prob[key]
            self._fresh.pop(key, None)
        else:
            del self._lists[e[0]][key]
        if for_room:
            ghost = self._ghost
            ghost[key] = e[0]
            if len(ghost) >= self._ghost_cap:
                self._ghost_old, self._ghost = ghost, {}

    def touch(self, keys: Iterable[Hashable]) -> None:
        info = self._info
        if not info:
            return
        self._call = call = self._call + 1
        last = call - 1
        clock = self._clock
        tuner, mask, lists, prob = self._tuner, self._mask, self._lists, self._prob
        floor = 0  # the class of the block below: a parent is used whenever its child is
        for k in keys:  # leaf first
            e = info.get(k)
            if e is None:
                continue
            c = old = e[0]
            if e[1] < last:
                if c < MAX_CLASS:
                    c += 1
                if tuner is not None and not (
                        k[-1] if type(k) is bytes else hash(k)) & mask:  # type: ignore[index]
                    self._sample(k)  # a hit of the tier
            e[1] = call
            if c < floor:
                c = floor
            floor = c
            e[2] = clock
            if prob and k in prob:
                if k in self._fresh:
                    continue  # the insert's own touch: stays on probation
                del prob[k]
                e[0] = c
                lists[c][k] = None
            elif c == old:
                lists[c].move_to_end(k)
            else:
                del lists[old][k]
                lists[c][k] = None
                e[0] = c
        if self._fresh:
            # behind the earlier probation blocks, a chain's leaf first (inserted root first)
            assert prob is not None
            for k in reversed(self._fresh):
                if k in prob:
                    prob.move_to_end(k)
            self._fresh = {}

    def peek(self) -> Hashable | None:
        prob = self._prob
        if prob:
            return next(iter(prob))
        info, off = self._info, self._off
        best = None
        rank = 0
        for c, d in enumerate(self._lists):
            if d:
                k = next(iter(d))
                r = info[k][2] + off[c]
                if best is None or r < rank:
                    best, rank = k, r
        return best

    def _ranked(self, c: int) -> Iterator[tuple[int, int, Hashable]]:
        info, o = self._info, self._off[c]
        return ((info[k][2] + o, c, k) for k in self._lists[c])

    def victims(self) -> Iterator[Hashable]:
        lists = self._lists
        live = [c for c in range(USE_CLASSES) if lists[c]]
        if len(live) <= 1:
            out: Iterator[Hashable] = iter(lists[live[0]]) if live else iter(())
        else:
            out = (k for _, _, k in heapq.merge(*(self._ranked(c) for c in live)))
        return chain(self._prob, out) if self._prob else out

    def order(self) -> list[Hashable]:
        return list(self.victims())

    def uses(self, key: Hashable) -> int:
        """Uses of a held key (ghost uses included), counted up to ``USE_CLASSES - 1``."""
        return self._info[key][0]


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
