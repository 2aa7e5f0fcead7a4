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
The adaptive policy's tuner also shadows second-hit candidates (:data:`ADAPTIVE_CANDIDATES`:
new keys the ghost list does not know start on probation) and leaves LRU only on evidence
(:meth:`ScaleTuner._decide_guarded`).
Shadows rank as the policy does (``last use + min(uses, 3) x scale x slots``, uses kept
across eviction in a ghost list), over keys only and without the timing wheel: one LRU list
per use class, the victim the best of their oldest entries. The scale-0 shadow is plain
LRU. A few dict operations per sampled reference.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
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
#: the adaptive policy's evidence: each decision period's disagreements with LRU (a shadow
#: hit where LRU's missed, or the reverse) weigh this much less in the next one (~100 periods)
ADAPTIVE_GUARD = 0.99
#: the adaptive policy leaves LRU only for a shadow whose wins over LRU's exceed its losses
#: by this many standard deviations (a sign test, McNemar's: both see the same references)
ADAPTIVE_Z = 2.5
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
                 "_clock", "_prob")

    def __init__(self, slots: int, scale: float, *, classes: int = 4, ghosts: int = 6,
                 probation: bool = False) -> None:
        # key -> the clock at its last use, one list per use class
        self._lists: list[OrderedDict[Hashable, int]] = [OrderedDict() for _ in range(classes)]
        # probation (the adaptive policy's second-hit candidate): a key not in the ghost list
        # joins here, first out, until its next use; its ``_uses`` entry is -1. None: off
        self._prob: OrderedDict[Hashable, None] | None = OrderedDict() if probation else None
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
            if u < 0:  # on probation: its second use lifts it (class 1, as any first use)
                del self._prob[key]  # type: ignore[index]
                uses[key] = 1
                lists[1][key] = self._clock
            elif u < top:
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
        if back is None and self._prob is not None:
            uses[key] = -1
            self._prob[key] = None
            return False
        u = 0 if back is None else min(back + 1, top)
        uses[key] = u
        lists[u][key] = self._clock
        return False

    def _evict(self) -> None:
        prob = self._prob
        if prob:
            k = next(iter(prob))
            del prob[k]
            del self._uses[k]
            self._bury(k, 0)
            return
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
        self._bury(k, where)

    def _bury(self, k: Hashable, where: int) -> None:
        ghost = self._ghost
        ghost[k] = where
        if len(ghost) >= self._ghost_cap:
            self._ghost_old, self._ghost = ghost, {}


def make_shadow(slots: int, scale: float, probation: bool = False, *, classes: int = 4,
                ghosts: int = 6) -> Shadow:
    """The shadow cache of ``slots`` keys at ``scale`` (``classes`` use classes, ``ghosts``
    ghost keys per slot, as the policy it shadows); ``probation``: new keys the ghost list
    does not know start on probation (second-hit)."""
    if scale == 0 and not probation:
        return LRUShadow(slots)
    return ReuseShadow(slots, scale, classes=classes, ghosts=ghosts, probation=probation)


#: what a policy may do, ``(scale, probation)``: each a shadow. ``SCALE_CANDIDATES`` are the
#: reuse policy's; the adaptive policy's add probation for new keys the ghost list does not
#: know (second-hit admission) at two scales. The first is LRU, the safe choice
SCALE_CANDIDATES: tuple[tuple[float, bool], ...] = tuple((s, False) for s in SCALES)
ADAPTIVE_CANDIDATES: tuple[tuple[float, bool], ...] = SCALE_CANDIDATES + ((0.0, True),
                                                                          (2.0, True))


class ScaleTuner:
    """A shadow per candidate (:data:`SCALE_CANDIDATES` by default); :attr:`scale` and
    :attr:`probation` are the best one's lately.

    Unguarded (the reuse policy): the shadow that hit most over the last few decision periods,
    once it leads the current one by :data:`MARGIN`. Guarded (the adaptive policy, ``guard``
    = the evidence's decay per period): among LRU (candidate 0) and the shadows shown better
    than LRU's (:data:`ADAPTIVE_Z`, a sign test over the references where the two disagree,
    decayed by ``guard``), the one that hit most lately, as soon as it leads: no margin, since
    a switch of the adaptive policy costs no transient. A shadow that won by chance (small
    shadows, few disagreements) is not taken; LRU is what a tier falls back to.
    """

    __slots__ = ("scale", "probation", "mask", "_cands", "_shadows", "_hits", "_period", "_refs",
                 "_won", "_lost", "_guard")

    def __init__(self, slots: int, start: float,
                 make: Callable[[int, float, bool], Shadow] = make_shadow, *,
                 mask: int | None = None, guard: float | None = None,
                 candidates: tuple[tuple[float, bool], ...] = SCALE_CANDIDATES) -> None:
        if not candidates or candidates[0] != (0.0, False):
            raise ValueError("the first candidate must be LRU, (0.0, False)")
        self.scale = start
        self.probation = False
        self._cands = candidates
        # the tier samples a key when its last byte & mask == 0
        self.mask = sample_mask(slots) if mask is None else mask
        n = max(1, slots // (self.mask + 1))
        self._shadows = [make(n, s, p) for s, p in candidates]
        self._hits = [0.0] * len(candidates)
        self._period = max(64, n)  # sampled references between decisions
        self._refs = 0
        # guarded: per candidate, the references it hit and LRU's shadow missed, and the reverse
        self._guard = guard
        self._won = [0.0] * len(candidates)
        self._lost = [0.0] * len(candidates)

    def reference(self, key: Hashable) -> None:
        """A use or a miss of a sampled key (see ``ReusePolicy.insert``) in the tier."""
        hits, shadows = self._hits, self._shadows
        if self._guard is None:
            for i, s in enumerate(shadows):
                if s.refer(key):
                    hits[i] += 1
        else:
            won, lost = self._won, self._lost
            lru = shadows[0].refer(key)
            if lru:
                hits[0] += 1
            for i in range(1, len(shadows)):
                if shadows[i].refer(key):
                    hits[i] += 1
                    if not lru:
                        won[i] += 1
                elif lru:
                    lost[i] += 1
        self._refs += 1
        if self._refs >= self._period:
            self._refs = 0
            if self._guard is None:
                self._decide(hits)
            else:
                self._decide_guarded(hits)
            self._hits = [h * MEMORY for h in hits]  # the last few periods, mostly the last

    def _best(self, hits: list[float], among: Sequence[int]) -> int:
        """The candidate of ``among`` that hit most; ties: the one nearest the current."""
        cands, scale, prob = self._cands, self.scale, self.probation
        return max(among, key=lambda i: (hits[i], -(cands[i][1] != prob),
                                         -abs(cands[i][0] - scale)))

    def _decide(self, hits: list[float]) -> None:
        cur = self._cur()
        best = self._best(hits, range(len(self._cands)))
        if hits[best] > MARGIN * (hits[cur] if cur >= 0 else 0.0):
            self.scale, self.probation = self._cands[best]

    def _decide_guarded(self, hits: list[float]) -> None:
        won, lost, g = self._won, self._lost, self._guard
        assert g is not None
        ok = [0] + [i for i in range(1, len(won))
                    if won[i] - lost[i] > ADAPTIVE_Z * math.sqrt(won[i] + lost[i] + 1)]
        cur = self._cur()
        best = self._best(hits, ok)
        if cur not in ok or hits[best] > hits[cur]:
            self.scale, self.probation = self._cands[best]
        for i in range(len(won)):
            won[i] *= g
            lost[i] *= g

    def _cur(self) -> int:
        """The current candidate's index, -1 when the start is none of them."""
        c = (self.scale, self.probation)
        return self._cands.index(c) if c in self._cands else -1
