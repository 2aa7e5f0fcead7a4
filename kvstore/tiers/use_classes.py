"""What the reuse-ranking eviction policies share (:class:`UseClassPolicy`, the base of
:class:`~kvstore.tiers.reuse_policy.ReusePolicy` and
:class:`~kvstore.tiers.adaptive_policy.AdaptivePolicy`): uses counted in classes (0, 1, 2,
3+), a ghost list that keeps them across eviction, and the scale tuner fed a sample of the
keys.

* Uses: a use is a touch; touches of a block in consecutive touch calls (a fetch and then the
  put of the same request) count as one. Each use buys the block ``scale`` more tier
  turnovers of retention, up to :data:`MAX_CLASS` uses.
* Ghost list: the use classes of the keys last evicted for room (3-6x the tier's slots, keys
  only), in two plain-dict generations of ``ghosts / 2 x slots`` keys: when the new one is
  full the old one is dropped whole (a FIFO at O(1), no OrderedDict). A key inserted again
  while remembered comes back with its uses (one more: being asked for again is a use).
* Tuner: :class:`~kvstore.tiers.tuning.ScaleTuner` sees a use or a miss of each sampled key
  (a key is sampled when its last byte, or its ``hash()`` for keys other than bytes, ``&``
  the tuner's mask is 0) and picks ``scale``; :meth:`UseClassPolicy._rescale` applies a new
  one.

The base holds the state and the per-key bookkeeping both policies do the same way:
:meth:`UseClassPolicy.insert` (a republished key, the ghost list's recall, the tuner's miss)
around the subclass's :meth:`~UseClassPolicy._admit`. ``remove`` and ``touch`` stay the
subclasses' own, with the ghost list's push (its aging: :meth:`UseClassPolicy._age_ghosts`)
and the sampling test written inline: they run per block, and a Python call there costs
about 450 instructions (45 ns), 2-3 % of a block's bookkeeping.

Not thread-safe: the store serialises access under its lock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from functools import partial

from kvstore.tiers.tuning import SCALE_CANDIDATES, ScaleTuner, make_shadow

#: use classes (0, 1, 2, 3+ uses)
USE_CLASSES = 4
MAX_CLASS = USE_CLASSES - 1
#: retention per use of a tuned tier before its shadows have shown reuse pays: LRU
TUNED_START = 0.0
#: retention per use of a tier too small to tune (small caches gain most from reuse)
UNTUNED_SCALE = 1.0
#: ghost entries (evicted keys and their uses) per slot of the tier
GHOSTS_PER_SLOT = 6


class UseClassPolicy:
    """Use classes, the ghost list and the tuner's sampling of a reuse-ranking policy (see the
    module docstring). Subclasses give :meth:`_admit`, :meth:`_republish` and
    :meth:`_rescale`, and their own ``remove``, ``touch``, ``peek`` and ``victims``.

    ``_info`` maps each key held to ``[use class, last touch call, the subclass's rank
    field]`` (a list, changed in place on the hot paths).
    """

    name: str
    __slots__ = ("_info", "_ghost", "_ghost_old", "_ghost_cap", "_slots", "_clock", "_call",
                 "_tuner", "_scale", "_second", "_mask", "_fresh")

    def __init__(self, slots: int, *, ghosts: int, scale: float | None, tuned: bool,
                 mask: int | None = None, guard: float | None = None,
                 candidates: tuple[tuple[float, bool], ...] = SCALE_CANDIDATES) -> None:
        """``tuned``: a :class:`~kvstore.tiers.tuning.ScaleTuner` picks the scale among
        ``candidates`` (``mask`` and ``guard`` are its too); ``scale``: the start (default:
        LRU when tuned, else :data:`UNTUNED_SCALE`)."""
        self._info: dict[Hashable, list[int]] = {}
        # evicted key -> its use class, in two generations of ghosts/2 x slots keys each
        self._ghost: dict[Hashable, int] = {}
        self._ghost_old: dict[Hashable, int] = {}
        self._slots = max(1, slots)
        self._ghost_cap = max(1, ghosts * self._slots // 2)  # per generation
        self._clock = 0  # blocks inserted: the tier's turnover
        self._call = 0  # touch calls
        start = scale if scale is not None else (TUNED_START if tuned else UNTUNED_SCALE)
        self._scale = start  # retention per use, in tier turnovers (the tuner's, when tuned)
        # new keys the ghost list does not know start on probation (the tuner's choice)
        self._second = False
        self._tuner = (ScaleTuner(slots, start, partial(make_shadow, classes=USE_CLASSES,
                                                        ghosts=ghosts), mask=mask, guard=guard,
                                  candidates=candidates)
                       if tuned else None)
        self._mask = self._tuner.mask if self._tuner is not None else 0
        # keys inserted on probation since the last touch call, in insertion order
        self._fresh: dict[Hashable, None] = {}
        self._rescale()

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._info

    @property
    def scale(self) -> float:
        """Retention a use buys, in tier turnovers (the tuner's current choice)."""
        return self._scale

    def uses(self, key: Hashable) -> int:
        """Uses of a held key (ghost uses included), counted up to :data:`MAX_CLASS`."""
        return self._info[key][0]

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        """See :meth:`~kvstore.tiers.policy.EvictionPolicy.insert`."""
        self._clock = clock = self._clock + 1
        e = self._info.get(key)
        if e is not None:  # republished under another slot
            e[1] = self._call
            self._republish(key, e, clock)
            return
        back = self._ghost.pop(key, None)
        if back is None and self._ghost_old:
            back = self._ghost_old.pop(key, None)
        self._admit(key, back, probation, uses, clock)
        # sampled by the key's last byte (a SHA-256 digest: uniform, and the same in every
        # process, unlike hash() of bytes); other keys (tests, simulators) by hash(); the
        # subclasses' touch loops test the same inline
        if self._tuner is not None and not (
                key[-1] if type(key) is bytes else hash(key)) & self._mask:  # type: ignore[index]
            self._sample(key)  # a miss of the tier

    def order(self) -> list[Hashable]:
        """:meth:`victims` as a list (a snapshot)."""
        return list(self.victims())

    def state(self) -> str:
        """The scale in use, ``second-hit`` while new unknown keys start on probation, and
        whether the tuner chooses them (``fixed`` when the tier is too small to tune)."""
        out = f"scale {self._scale:g}" + (", second-hit" if self._second else "")
        return out if self._tuner is not None else out + ", fixed"

    def _sample(self, key: Hashable) -> None:
        """A use or a miss of a sampled key: the tuner's shadows see it."""
        tuner = self._tuner
        assert tuner is not None
        tuner.reference(key)
        self._second = tuner.probation
        if tuner.scale != self._scale:
            self._scale = tuner.scale
            self._rescale()

    def _age_ghosts(self) -> None:
        """The new ghost generation is full: it becomes the old one, the old one is dropped
        (``remove`` pushes inline and calls this once per ``_ghost_cap`` pushes)."""
        self._ghost_old, self._ghost = self._ghost, {}

    # what each policy does its own way

    def victims(self) -> Iterator[Hashable]:
        raise NotImplementedError

    def _admit(self, key: Hashable, back: int | None, probation: bool, uses: int,
               clock: int) -> None:
        """Place a new ``key`` (``back``: its use class in the ghost list, None when not
        there; ``clock``: this insert's) and add it to ``_info``."""
        raise NotImplementedError

    def _republish(self, key: Hashable, e: list[int], clock: int) -> None:
        """``key``, held (``e`` its ``_info`` entry, its touch call already set), was
        inserted again under another slot."""
        raise NotImplementedError

    def _rescale(self) -> None:
        """``_scale`` changed (or was set first): update what the ranks derive from it."""
        raise NotImplementedError
