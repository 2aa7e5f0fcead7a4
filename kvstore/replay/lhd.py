"""A hit-density eviction order in the style of LHD (Beckmann et al., NSDI'18), for the replay
simulator only (``kvstore replay --baselines lhd``): issue 30's "Tried ... not adopted"
candidate (docs/benchmarks.md "Eviction across trace families"), kept so its figures can be
rerun; never a tier's policy.

A block's *hit density* is the hits it can still expect per unit of cache space-time: for a
block of use class ``c`` (0, 1, 2, 3+ uses, as :mod:`kvstore.tiers.use_classes` counts them)
and age ``a`` (blocks inserted since its last use, in bins of ``slots / bins``),

    HD_c(a) = sum_{x >= a} hits_c(x) / sum_{x >= a} (x - a + 1) x (hits_c(x) + ends_c(x)),

from per-class histograms of the ages at which a block's lifetime ended: at its next use (a
hit), or, for a block evicted and never asked for again, when it left the ghost list (an
*end*). Ages are counted **past eviction**: a key asked for again while in the ghost list
(3-6x slots keys, two generations) is a hit at its age since its last use, as if it had
stayed. Without that (LHD's own histograms, lifetimes ended by eviction) every class is
evicted at the same age, the histograms learn nothing past it and the order is nearly LRU's
(the conversation trace at 2 %: 0.079, LRU's 0.079; the fit traces at 5 %: 6.4 % of the LRU ->
Belady gap against 20.3 %). The histograms decay by ``decay`` every ``slots / 2`` lifetime
ends, and the densities are recomputed then.

The order: one LRU list per class, the victim the list head (the class's oldest) of lowest
density. LHD's own eviction, the lowest density of 32 keys sampled at random, did worse on
the fit traces (5 %: 11.8 % of the gap against 20.3 %, and 0.936x LRU at 10 %): the sample's
noise cost more than the lists' assumption that a class's density falls with age. A parent
joins at least its child's class on a touch, as under ``"adaptive"``, so leaves go first.
Uses as the store counts them: a touch in a later touch call than the block's last one. Runs
under admission ``"always"`` and without hints (the simulator's baselines), so it has no
probation. (The 20.3 % above was measured before :meth:`LHDPolicy.victims` was fixed, on
2026-12-07, to rank each list by its own class: 21.0 % since; docs/benchmarks.md.)
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator

#: use classes (0, 1, 2, 3+ uses)
LHD_CLASSES = 4
#: age bins per tier turnover (``slots`` inserts), and turnovers the histograms span
LHD_BINS, LHD_SPAN = 64, 8
#: the histograms' decay per recompute (every ``slots / 2`` lifetime ends)
LHD_DECAY = 0.9
#: ghost keys per slot (two generations), as the store's reuse-ranking policies keep
LHD_GHOSTS = 6


def hit_density(hits: list[float], ends: list[float]) -> list[float]:
    """Per age bin ``a``: the hits expected past ``a`` per bin of lifetime still to come, of a
    block that reached ``a`` (0 where no lifetime reaches it)."""
    out = [0.0] * len(hits)
    ch = ce = life = 0.0
    for a in range(len(hits) - 1, -1, -1):
        ch += hits[a]
        ce += hits[a] + ends[a]
        life += ce  # every lifetime ending at or past a lasts one more bin
        out[a] = ch / life if life > 0 else 0.0
    return out


class LHDPolicy:
    """Hit density per use class and age, learned online (see the module docstring)."""

    name = "lhd"
    __slots__ = ("_slots", "_lists", "_info", "_ghost", "_ghost_old", "_ghost_cap", "_clock",
                 "_call", "_width", "_bins", "_hits", "_ends", "_hd", "_period", "_events",
                 "_decay")

    def __init__(self, slots: int, *, bins: int = LHD_BINS, span: int = LHD_SPAN,
                 decay: float = LHD_DECAY, ghosts: int = LHD_GHOSTS) -> None:
        self._slots = max(1, slots)
        self._lists: list[OrderedDict[Hashable, None]] = [OrderedDict()
                                                          for _ in range(LHD_CLASSES)]
        # key -> [class, last touch call, clock at its last use]
        self._info: dict[Hashable, list[int]] = {}
        # evicted key -> (class, clock at its last use), two generations
        self._ghost: dict[Hashable, tuple[int, int]] = {}
        self._ghost_old: dict[Hashable, tuple[int, int]] = {}
        self._ghost_cap = max(1, ghosts * self._slots // 2)
        self._clock = 0  # blocks inserted
        self._call = 0  # touch calls
        self._width = max(1, self._slots // bins)  # clock ticks per age bin
        self._bins = bins * span
        n = self._bins
        self._hits = [[0.0] * n for _ in range(LHD_CLASSES)]
        self._ends = [[0.0] * n for _ in range(LHD_CLASSES)]
        # before any data: the older the lower, every class alike (LRU)
        self._hd = [[1.0 / (1 + a) for a in range(n)] for _ in range(LHD_CLASSES)]
        self._period = max(64, self._slots // 2)
        self._events = 0
        self._decay = decay

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._info

    def uses_class(self, key: Hashable) -> int:
        """A held key's use class (0, 1, 2, 3+ uses)."""
        return self._info[key][0]

    def lifetimes(self, c: int) -> tuple[list[float], list[float]]:
        """Use class ``c``'s histograms of lifetime ends per age bin since the last
        recompute (decayed): by a hit, and unused (copies)."""
        return list(self._hits[c]), list(self._ends[c])

    def density(self, c: int) -> list[float]:
        """Use class ``c``'s hit density per age bin, as last recomputed (a copy)."""
        return list(self._hd[c])

    def _bin(self, age: int) -> int:
        b = age // self._width
        return b if b < self._bins else self._bins - 1

    def _ended(self, c: int, hist: list[list[float]], age: int) -> None:
        hist[c][self._bin(age)] += 1.0
        self._events += 1
        if self._events >= self._period:
            self._events = 0
            d = self._decay
            for k in range(LHD_CLASSES):
                h, e = self._hits[k], self._ends[k]
                self._hd[k] = hit_density(h, e)
                self._hits[k] = [x * d for x in h]
                self._ends[k] = [x * d for x in e]

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        self._clock = clock = self._clock + 1
        e = self._info.get(key)
        if e is not None:  # republished: as a use-less touch
            e[1] = self._call
            e[2] = clock
            self._lists[e[0]].move_to_end(key)
            return
        back = self._ghost.pop(key, None)
        if back is None and self._ghost_old:
            back = self._ghost_old.pop(key, None)
        c = min(uses, LHD_CLASSES - 1)
        if back is not None:  # a hit past eviction, at its age since its last use
            self._ended(back[0], self._hits, clock - back[1])
            c = max(c, min(back[0] + 1, LHD_CLASSES - 1))
        self._info[key] = [c, self._call, clock]
        self._lists[c][key] = None

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        c, _, t = self._info.pop(key)
        del self._lists[c][key]
        if for_room:
            ghost = self._ghost
            ghost[key] = (c, t)
            if len(ghost) >= self._ghost_cap:
                clock = self._clock
                for oc, ot in self._ghost_old.values():  # never asked for again: ended
                    self._ended(oc, self._ends, clock - ot)
                self._ghost_old, self._ghost = ghost, {}

    def touch(self, keys: Iterable[Hashable]) -> None:
        info, lists = self._info, self._lists
        if not info:
            return
        self._call = call = self._call + 1
        last, clock, top = call - 1, self._clock, LHD_CLASSES - 1
        floor = 0  # a parent is used whenever its child is
        for k in keys:  # leaf first
            e = info.get(k)
            if e is None:
                continue
            c = old = e[0]
            if e[1] < last:  # a use: a hit at its age
                self._ended(old, self._hits, clock - e[2])
                if c < top:
                    c += 1
            if c < floor:
                c = floor
            floor = c
            e[1], e[2] = call, clock
            if c == old:
                lists[c].move_to_end(k)
            else:
                del lists[old][k]
                lists[c][k] = None
                e[0] = c

    def _score(self, c: int, key: Hashable) -> float:
        return self._hd[c][self._bin(self._clock - self._info[key][2])]

    def peek(self) -> Hashable | None:
        best: Hashable | None = None
        low = 0.0
        for c, d in enumerate(self._lists):
            if d:
                k = next(iter(d))
                s = self._score(c, k)
                if best is None or s < low:
                    best, low = k, s
        return best

    def victims(self) -> Iterator[Hashable]:
        """The list heads by density, each list oldest first (a merge: exact where a class's
        density falls with age)."""
        return (k for _, _, _, k in heapq.merge(*(
            self._ranked(c, d) for c, d in enumerate(self._lists) if d)))

    def _ranked(self, c: int, d: OrderedDict[Hashable, None],
                ) -> Iterator[tuple[float, int, int, Hashable]]:
        # a function of its own: a generator expression nested in victims() would read the
        # class ``c`` late (the last class's, for every list)
        return ((self._score(c, k), c, i, k) for i, k in enumerate(d))

    def order(self) -> list[Hashable]:
        return list(self.victims())

    def state(self) -> str:
        return ""
