"""How much a use is worth: :class:`ScaleTuner` picks the reuse scale of
:class:`~kvstore.tiers.reuse_policy.ReusePolicy` from miniature simulations.

A fixed worth is a guess about the workload: where blocks that were used before come back
(shared system prompts, documents many questions hang off) protecting them wins; where the
next turn of a conversation wants the blocks just written, it loses to plain LRU. So the
tier runs a few shadow caches side by side, each the same policy at another scale, over a
1/32 hash sample of the keys with 1/32 of the slots (spatially sampled miniature caches,
Waldspurger et al., ATC'17; big tiers sample thinner, see :func:`sample_mask`), and the
tier uses the scale whose shadow hit most lately. It starts from the caller's scale (the
policy starts tuned tiers as LRU) and moves only on a clear lead (:data:`MARGIN`), since a
wrong move costs more than a late one.
Shadows rank as the policy does (``last use + min(uses, 3) x scale x slots``, uses kept
across eviction in a ghost list), over keys only and without the timing wheel: one LRU list
per use class, the victim the best of their oldest entries. The scale-0 shadow is plain
LRU. A few dict operations per sampled reference.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

#: reuse scales the shadows try (0 is LRU)
SCALES = (0.0, 1.0, 2.0, 4.0)
SAMPLE_MASK = 31  # a key is sampled when its last byte & the mask == 0: 1 in 32 ...
SHADOW_KEYS = 512  # ... or fewer in big tiers, while the shadows still hold this many keys
MIN_SLOTS = 512  # below this the sample is too small to tell: the scale stays fixed
#: the adaptive policy's shadows hold at least this many keys (its tiers sample more keys);
#: 128 rather than 256 halves a 2,000-slot tier's sample (2.8 -> 2.15 us per block) and moved
#: no family's hit ratio by more than 0.006 at 2/5/10 % (docs/benchmarks.md)
ADAPTIVE_SHADOW_KEYS = 128
#: the adaptive policy tunes tiers of this many slots and more (smaller ones: every key)
ADAPTIVE_MIN_SLOTS = 64
#: the adaptive policy's long memory: each decision period's hits weigh this much less in
#: the next one (~100 periods); a shadow that lost to LRU over it does not replace LRU
ADAPTIVE_GUARD = 0.99
#: the adaptive policy leaves LRU for a shadow that hit this many times as often lately
ADAPTIVE_LEAVE = 1.10
MEMORY = 0.9  # each decision period's hits weigh this much less in the next one
MARGIN = 1.02  # switch when the best shadow hit this many times as often as the current one


class Shadow(Protocol):
    def refer(self, key: Hashable) -> bool:
        """One reference of ``key``; True when the shadow held it."""


def sample_mask(slots: int) -> int:
    """The sampling mask of a tier of ``slots``: 1 key in 32, thinned (down to 1 in 256) in
    tiers so big that the shadows would still hold :data:`SHADOW_KEYS` keys: the tuner's
    cost per block falls as the tier grows, its accuracy does not."""
    rate = SAMPLE_MASK + 1
    while rate < 256 and slots // (2 * rate) >= SHADOW_KEYS:
        rate *= 2
    return rate - 1


def adaptive_mask(slots: int) -> int:
    """The sampling mask of an adaptive tier of ``slots``: every key in tiers up to
    2 x :data:`ADAPTIVE_SHADOW_KEYS` slots, then 1 in 2, 4, ... (down to 1 in 256) while the
    shadows still hold that many keys. Its switches cost no transient, so it relies on what
    the shadows tell more than the reuse policy does: bigger shadows in small tiers, a thin
    sample in big ones (the cost per block falls as they grow)."""
    rate = 1
    while rate < 256 and slots // (2 * rate) >= ADAPTIVE_SHADOW_KEYS:
        rate *= 2
    return rate - 1


class LRUShadow:
    """A cache of ``slots`` keys, least recently used out first."""

    __slots__ = ("_lru", "_slots")

    def __init__(self, slots: int) -> None:
        self._lru: OrderedDict[Hashable, None] = OrderedDict()
        self._slots = max(1, slots)

    def refer(self, key: Hashable) -> bool:
        lru = self._lru
        if key in lru:
            lru.move_to_end(key)
            return True
        if len(lru) >= self._slots:
            lru.popitem(last=False)
        lru[key] = None
        return False


class ReuseShadow:
    """A cache of ``slots`` keys ranked as :class:`~kvstore.tiers.reuse_policy.ReusePolicy` ranks
    them at one ``scale``: a list per use class, oldest use first."""

    __slots__ = ("_lists", "_uses", "_ghost", "_ghost_old", "_ghost_cap", "_slots", "_off",
                 "_clock")

    def __init__(self, slots: int, scale: float, *, classes: int = 4, ghosts: int = 6) -> None:
        # key -> the clock at its last use, one list per use class
        self._lists: list[OrderedDict[Hashable, int]] = [OrderedDict() for _ in range(classes)]
        self._uses: dict[Hashable, int] = {}
        self._ghost: dict[Hashable, int] = {}
        self._ghost_old: dict[Hashable, int] = {}
        self._slots = max(1, slots)
        self._ghost_cap = max(1, ghosts * self._slots // 2)
        self._off = [int(c * scale * self._slots) for c in range(classes)]
        self._clock = 0  # keys inserted, as the policy counts

    def refer(self, key: Hashable) -> bool:
        uses, lists = self._uses, self._lists
        u = uses.get(key)
        top = len(lists) - 1
        if u is not None:
            if u < top:
                del lists[u][key]
                u += 1
                uses[key] = u
                lists[u][key] = self._clock
            else:
                d = lists[u]
                d[key] = self._clock
                d.move_to_end(key)
            return True
        if len(uses) >= self._slots:
            self._evict()
        self._clock += 1
        back = self._ghost.pop(key, None)
        if back is None and self._ghost_old:
            back = self._ghost_old.pop(key, None)
        u = 0 if back is None else min(back + 1, top)
        uses[key] = u
        lists[u][key] = self._clock
        return False

    def _evict(self) -> None:
        lists, off = self._lists, self._off
        best = where = -1
        for c in range(len(lists)):
            d = lists[c]
            if d:
                r = d[next(iter(d))] + off[c]
                if where < 0 or r < best:
                    best, where = r, c
        k, _ = lists[where].popitem(last=False)
        del self._uses[k]
        ghost = self._ghost
        ghost[k] = where
        if len(ghost) >= self._ghost_cap:
            self._ghost_old, self._ghost = ghost, {}


def make_shadow(slots: int, scale: float, *, classes: int = 4, ghosts: int = 6) -> Shadow:
    """The shadow cache of ``slots`` keys at ``scale`` (``classes`` use classes, ``ghosts``
    ghost keys per slot, as the policy it shadows)."""
    if scale == 0:
        return LRUShadow(slots)
    return ReuseShadow(slots, scale, classes=classes, ghosts=ghosts)


class ScaleTuner:
    """Shadows at each of :data:`SCALES`; :attr:`scale` is the best one lately."""

    __slots__ = ("scale", "mask", "_shadows", "_hits", "_period", "_refs", "_long", "_guard")

    def __init__(self, slots: int, start: float,
                 make: Callable[[int, float], Shadow] = make_shadow, *,
                 mask: int | None = None, guard: float | None = None) -> None:
        self.scale = start
        # the tier samples a key when its last byte & mask == 0
        self.mask = sample_mask(slots) if mask is None else mask
        n = max(1, slots // (self.mask + 1))
        self._shadows = [make(n, s) for s in SCALES]
        self._hits = [0.0] * len(SCALES)
        self._period = max(64, n)  # sampled references between decisions
        self._refs = 0
        # guard (the adaptive policy's): hits over a long memory; leave LRU (scale 0) only
        # for a shadow that has not lost to LRU's over it
        self._long = [0.0] * len(SCALES)
        self._guard = guard

    def reference(self, key: Hashable) -> None:
        """A use or a miss of a sampled key (see ``ReusePolicy.insert``) in the tier."""
        hits = self._hits
        for i, s in enumerate(self._shadows):
            if s.refer(key):
                hits[i] += 1
        self._refs += 1
        if self._refs >= self._period:
            self._refs = 0
            now = hits[SCALES.index(self.scale)] if self.scale in SCALES else 0.0
            best = max(range(len(SCALES)), key=lambda i: (hits[i], -abs(SCALES[i] - self.scale)))
            g = self._guard
            if g is not None:
                long = self._long
                for i in range(len(long)):
                    long[i] = long[i] * g + hits[i]
                if SCALES[best] and long[best] < long[0]:
                    best = 0  # lost to LRU in the long run: not worth leaving it
            margin = MARGIN if g is None or self.scale or not SCALES[best] else ADAPTIVE_LEAVE
            if hits[best] > margin * now or (g is not None and best == 0 and self.scale
                                             and self._long[self._cur()] < self._long[0]):
                self.scale = SCALES[best]
            self._hits = [h * MEMORY for h in hits]  # the last few periods, mostly the last

    def _cur(self) -> int:
        return SCALES.index(self.scale) if self.scale in SCALES else 0
