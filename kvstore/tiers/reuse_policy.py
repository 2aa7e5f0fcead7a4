"""The ``"reuse"`` eviction policy (:class:`ReusePolicy`): recency plus reuse, ranked in a
timing wheel.

Each use of a block buys it ``scale`` more tier-turnovers of retention (up to three uses
count): the victim is the block whose ``last use + min(uses, 3) x scale x slots`` (time
counted in blocks inserted) is smallest. Uses survive eviction in a ghost list of the keys
last evicted (3-6x the tier's slots, keys only), so a block asked for again soon after it left
comes back with its uses. In a prefix cache uses accumulate where chains meet: a block many
chains pass through (a shared system prompt, a document many questions hang off, the turns of
a long conversation) is used by each of them. ``scale`` is not a constant fitted to a trace:
:class:`~kvstore.tiers.tuning.ScaleTuner` picks it (0 = LRU ... 4) from shadow caches over a
sample of the keys. A tuned tier starts as LRU and leaves it only once its shadows show reuse
paying, so where uses do not predict the next use (the next turn of a chat wants the blocks
just written) the tier stays LRU; tiers too small to tune rank at scale 1 (the smaller the
cache, the more a use is worth keeping). A block is ranked at least as high as any block below
it in the chain (a hit on the child needs the parent), which keeps leaves first in the order.

Use classes, the ghost list and the tuner's sampling: :mod:`kvstore.tiers.use_classes`;
probation and the protocol: :mod:`kvstore.tiers.policy`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator

from kvstore.tiers.tuning import MIN_SLOTS
from kvstore.tiers.use_classes import GHOSTS_PER_SLOT, MAX_CLASS, USE_CLASSES, UseClassPolicy

#: rank resolution of :class:`ReusePolicy`: buckets per tier turnover
BUCKETS_PER_TURNOVER = 64


class ReusePolicy(UseClassPolicy):
    """Recency plus reuse with a ghost list (see the module docstring).

    A use is a touch; touches of a block in consecutive touch calls (a fetch and then the
    put of the same request) count as one use. The order is a timing wheel: a block's rank
    ``last use + class x scale x slots`` falls in a bucket of ``slots / 64`` ticks, each
    bucket an LRU list; the victim is the oldest block of the lowest bucket, so a touch, an
    insert and an eviction each cost a few dict operations. ``_info``'s rank field is the
    block's bucket.
    """

    name = "reuse"
    __slots__ = ("_buckets", "_low", "_width", "_step", "_prob_bucket")

    def __init__(self, slots: int, *, ghosts: int = GHOSTS_PER_SLOT, scale: float | None = None,
                 tune: bool = True) -> None:
        self._buckets: dict[int, OrderedDict[Hashable, None]] = {}
        self._low = 0  # no bucket below this one holds a key
        self._prob_bucket: int | None = None  # the bucket of the blocks on probation
        super().__init__(slots, ghosts=ghosts, scale=scale, tuned=tune and slots >= MIN_SLOTS)
        self._width = max(1, self._slots // BUCKETS_PER_TURNOVER)

    def _rescale(self) -> None:
        self._step = self._scale * self._slots  # ticks of retention per use

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

    def _republish(self, key: Hashable, e: list[int], clock: int) -> None:
        self._buckets[e[2]].move_to_end(key)

    def _admit(self, key: Hashable, back: int | None, probation: bool, uses: int,
               clock: int) -> None:
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
        self._info[key] = [uses, self._call, b]
        q = self._buckets.get(b)
        if q is None:
            self._put(key, b)
        else:
            q[key] = None

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        if self._fresh:
            self._fresh.pop(key, None)
        e = self._info.pop(key)
        b = e[2]
        q = self._buckets[b]
        del q[key]
        if not q:
            self._drop_bucket(b)
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
            if e[1] < last:
                if e[0] < MAX_CLASS:
                    e[0] += 1
                if tuner is not None and not (
                        k[-1] if type(k) is bytes else hash(k)) & mask:  # type: ignore[index]
                    self._sample(k)  # a hit of the tier
                    step = self._step
                    ranks = [(base + int(c * step)) // width for c in range(USE_CLASSES)]
            e[1] = call
            b = ranks[e[0]]
            if b < floor:
                b = floor
            floor = b
            old = e[2]
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
            e[2] = b
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
            old = e[2]
            src = buckets[old]
            del src[k]
            if not src:
                self._drop_bucket(old)
            self._put(k, b)
            e[2] = b
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
