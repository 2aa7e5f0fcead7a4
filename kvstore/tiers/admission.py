"""Admission of the memory tiers: whether a block joins a tier as a full member or on
probation.

A memory tier never refuses a block (a refusal would break what the store promises the put:
the block is stored, its chain stays prefix-closed, a dirty block is kept until the disk
writer has it). Admission only decides *where* in the eviction order a new block starts:

* ``"always"`` (:class:`AlwaysAdmit`, the default): where the eviction policy puts any new
  block (the newest end under LRU).
* ``"second-hit"`` (:class:`SecondHitAdmit`): a block whose key the tier has not seen lately
  joins *on probation*, at the victim end of the policy's order (see
  ``EvictionPolicy.insert``), so it is the first to go when room is needed unless it is
  used again first; a key seen lately (inserted or evicted within the doorkeeper's memory)
  joins normally. A one-time scan then passes through the tier's victim end without pushing
  out what is used twice. The doorkeeper is keys only, two FIFO generations of
  :data:`DOORKEEPER_PER_SLOT` / 2 x slots keys each (like the reuse policy's ghost list):
  O(1) per operation and bounded.

The store's ``admission=`` for the disk tier (whether a block is written to disk on its first
or second use) is another decision, made by the store (see ``open_store``).

Not thread-safe: the store serialises access under its lock.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from kvstore.errors import ConfigError

#: admission names accepted by ``open_store(admission=...)`` (per tier)
ADMISSIONS = ("always", "second-hit")
DEFAULT_ADMISSION = "always"
#: keys the second-hit doorkeeper remembers per slot of the tier (two generations of half)
DOORKEEPER_PER_SLOT = 4


class Admission(Protocol):
    """How a memory tier admits a block it does not hold."""

    name: str

    def admit(self, key: Hashable) -> bool:
        """``key`` is joining the tier: True to insert it normally, False on probation.
        Called once per insert of a key the tier does not hold."""

    def evicted(self, key: Hashable) -> None:
        """``key`` left the tier to make room (a key asked for again soon after is admitted
        normally)."""


class AlwaysAdmit:
    """Every block joins normally (the tier never calls it: see ``MemoryTier``)."""

    name = "always"
    __slots__ = ()

    def admit(self, key: Hashable) -> bool:
        return True

    def evicted(self, key: Hashable) -> None:
        pass


class SecondHitAdmit:
    """A key joins normally when the doorkeeper saw it lately, on probation otherwise."""

    name = "second-hit"
    __slots__ = ("_new", "_old", "_cap")

    def __init__(self, slots: int, *, per_slot: int = DOORKEEPER_PER_SLOT) -> None:
        # two generations: when the new one is full the old one is dropped whole (a FIFO at
        # O(1) without an OrderedDict); a key remembered lately is in one of them
        self._new: set[Hashable] = set()
        self._old: set[Hashable] = set()
        self._cap = max(1, per_slot * max(1, slots) // 2)

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def _note(self, key: Hashable) -> None:
        new = self._new
        new.add(key)
        if len(new) >= self._cap:
            self._old, self._new = new, set()

    def admit(self, key: Hashable) -> bool:
        seen = key in self._new or key in self._old
        self._note(key)
        return seen

    def evicted(self, key: Hashable) -> None:
        self._note(key)


def check_admission(name: object, what: str = "admission") -> str:
    """``name`` if it is an admission name, else a :class:`ConfigError` naming them."""
    if not isinstance(name, str) or name not in ADMISSIONS:
        raise ConfigError(f"{what} must be one of {', '.join(map(repr, ADMISSIONS))}, "
                          f"got {name!r}")
    return name


def make_admission(name: str, slots: int) -> Admission:
    """The admission ``name`` for a tier of ``slots`` blocks."""
    if check_admission(name) == "second-hit":
        return SecondHitAdmit(slots)
    return AlwaysAdmit()


def tier_admission(name: str, slots: int) -> Admission | None:
    """What a memory tier (and the replay simulator, which mirrors it) consults on insert:
    None under ``"always"``, so that the default path pays nothing."""
    adm = make_admission(name, slots)
    return None if adm.name == DEFAULT_ADMISSION else adm
