"""How much a use is worth: :class:`ScaleTuner` picks the reuse scale of
:class:`~kvstore.tiers.policy.ReusePolicy` from miniature simulations.

A fixed worth is a guess about the workload: where blocks that were used before come back
(shared system prompts, documents many questions hang off) protecting them wins; where the
next turn of a conversation wants the blocks just written, it loses to plain LRU. So the
tier runs a few shadow caches side by side, each the same policy at another scale, over a
1/32 hash sample of the keys with 1/32 of the slots (spatially sampled miniature caches,
Waldspurger et al., ATC'17), and the tier uses the scale whose shadow hit most lately.
Shadows are the policy itself, untuned, over keys only: a few dict operations per sampled
reference.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

#: reuse scales the shadows try (0 is LRU)
SCALES = (0.0, 1.0, 2.0, 4.0)
SAMPLE_MASK = 31  # a key is sampled when its last byte & SAMPLE_MASK == 0: 1 in 32
MIN_SLOTS = 512  # below this the sample is too small to tell: the scale stays fixed
MEMORY = 0.9  # each decision period's hits weigh this much less in the next one
MARGIN = 1.02  # switch when the best shadow hit this many times as often as the current one


class Shadow(Protocol):
    def refer(self, key: Hashable) -> bool:
        """One reference of ``key``; True when the shadow held it."""


class ScaleTuner:
    """Shadows at each of :data:`SCALES`; :attr:`scale` is the best one lately."""

    __slots__ = ("scale", "_shadows", "_hits", "_period", "_refs")

    def __init__(self, slots: int, start: float,
                 make: Callable[[int, float], Shadow]) -> None:
        self.scale = start
        n = max(1, slots // (SAMPLE_MASK + 1))
        self._shadows = [make(n, s) for s in SCALES]
        self._hits = [0.0] * len(SCALES)
        self._period = max(64, n)  # sampled references between decisions
        self._refs = 0

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
            if hits[best] > MARGIN * now:
                self.scale = SCALES[best]
            self._hits = [h * MEMORY for h in hits]  # the last few periods, mostly the last
