"""The ``"adaptive"`` eviction policy (:class:`AdaptivePolicy`, the default): recency plus
reuse whose weight is chosen online and switches at once.

Use classes, the ghost list and the tuner's sampling: :mod:`kvstore.tiers.use_classes`;
the rank it shares with ``"reuse"``: :mod:`kvstore.tiers.reuse_policy`; probation and the
protocol: :mod:`kvstore.tiers.policy`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from itertools import chain

from kvstore.tiers.tuning import (
    ADAPTIVE_CANDIDATES,
    ADAPTIVE_GUARD,
    ADAPTIVE_MIN_SLOTS,
    SCALE_CANDIDATES,
    adaptive_mask,
)
from kvstore.tiers.use_classes import GHOSTS_PER_SLOT, MAX_CLASS, USE_CLASSES, UseClassPolicy


class AdaptivePolicy(UseClassPolicy):
    """Recency plus reuse whose weight is chosen online and switches at once (``"adaptive"``,
    the default; see the module docstring).

    A block's rank is ``last use + class x scale x slots`` as under
    :class:`~kvstore.tiers.reuse_policy.ReusePolicy`, but the order is one LRU list per use
    class (0, 1, 2, 3+ uses) and the rank is computed only at eviction time, from the lists'
    oldest entries: a new ``scale`` applies to every block at once, with no ranks given under
    the old one left to age out. The :class:`~kvstore.tiers.tuning.ScaleTuner`'s shadows are
    this very structure in miniature, so what they measure is what the tier would do; its
    scale 0 is LRU (the victim is the oldest head), so a tier whose shadows show reuse not
    paying evicts exactly as LRU does from the next eviction on. With ``probation`` (every
    memory tier) the tuner also tries second-hit candidates: while one is chosen, a new key
    the ghost list does not know starts on probation (``_second``). A parent joins at least its
    child's class on a touch (every use of a child is a use of its parent), so a parent never
    ranks below a child touched with it and leaves stay first. Blocks on probation wait in a
    FIFO before all others. ``_info``'s rank field is the clock at the block's last use.
    """

    name = "adaptive"
    __slots__ = ("_lists", "_off", "_prob")

    def __init__(self, slots: int, *, ghosts: int = GHOSTS_PER_SLOT, scale: float | None = None,
                 tune: bool = True, probation: bool = False) -> None:
        # one LRU list per use class, oldest use first
        self._lists: list[OrderedDict[Hashable, None]] = [OrderedDict()
                                                          for _ in range(USE_CLASSES)]
        # blocks on probation (a tier with second-hit admission): first in first out, before
        # every class list; None without probation
        self._prob: OrderedDict[Hashable, None] | None = OrderedDict() if probation else None
        super().__init__(slots, ghosts=ghosts, scale=scale,
                         tuned=tune and slots >= ADAPTIVE_MIN_SLOTS,
                         mask=adaptive_mask(slots), guard=ADAPTIVE_GUARD,
                         candidates=ADAPTIVE_CANDIDATES if probation else SCALE_CANDIDATES)

    def _rescale(self) -> None:
        s = self._scale
        self._off = [int(c * s * self._slots) for c in range(USE_CLASSES)]

    def _republish(self, key: Hashable, e: list[int], clock: int) -> None:
        prob = self._prob
        if not (prob and key in prob):
            e[2] = clock
            self._lists[e[0]].move_to_end(key)

    def _admit(self, key: Hashable, back: int | None, probation: bool, uses: int,
               clock: int) -> None:
        if back is None:
            c = uses if uses < MAX_CLASS else MAX_CLASS
            if (probation or self._second) and not c:
                if self._prob is None:
                    raise TypeError("this AdaptivePolicy has no probation: "
                                    "make_policy(..., probation=True)")
                self._info[key] = [0, self._call, clock]
                self._prob[key] = None
                self._fresh[key] = None
                return
        else:  # its uses came back from the ghost list: seen before, no probation
            c = max(uses, back + 1 if back < MAX_CLASS else MAX_CLASS)
        self._info[key] = [c, self._call, clock]  # seen by this call: its next touch is no use
        self._lists[c][key] = None

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        e = self._info.pop(key)
        prob = self._prob
        if prob and key in prob:
            del prob[key]
            self._fresh.pop(key, None)
        else:
            del self._lists[e[0]][key]
        if for_room:  # to the ghost list
            ghost = self._ghost
            ghost[key] = e[0]
            if len(ghost) >= self._ghost_cap:
                self._age_ghosts()

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
