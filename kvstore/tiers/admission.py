"""Admission of the memory tiers: whether a block joins a tier as a full member or on
probation.

A memory tier never refuses a block (a refusal would break what the store promises the put:
the block is stored, its chain stays prefix-closed, a dirty block is kept until the disk
writer has it). Admission only decides *where* in the eviction order a new block starts:

* ``"always"`` (:class:`AlwaysAdmit`, the default): where the eviction policy puts any new
  block (the newest end under LRU; the ``adaptive`` policy starts keys its ghost list does not
  know on probation while its shadows show that pays, see
  :mod:`kvstore.tiers.adaptive_policy`).
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

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvstore.errors import ConfigError
from kvstore.hints import PutHint

if TYPE_CHECKING:
    from kvstore.tiers.policy import EvictionPolicy

#: admission names accepted by ``open_store(admission=...)`` (per tier)
ADMISSIONS = ("always", "second-hit")
DEFAULT_ADMISSION = "always"
#: keys the second-hit doorkeeper remembers per slot of the tier (two generations of half)
DOORKEEPER_PER_SLOT = 4
#: where a hinted put's new blocks start (:meth:`HintAdmission.start`): on probation
PROBATION = -1
#: sessions whose last put :class:`HintAdmission` remembers (least recently seen dropped)
HINT_SESSIONS = 65_536


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


def place(policy: EvictionPolicy, door: Admission | None, key: Hashable, start: int = 0, *,
          new: bool = True) -> None:
    """Insert ``key`` into ``policy`` where it starts: on probation when ``start`` is
    :data:`PROBATION`, as if used ``start`` times when positive, else where ``door`` (the
    tier's admission; None under ``"always"``) puts a ``new`` key. A hinted start wins over
    the doorkeeper, which still notes the key. The memory tier and the replay simulator both
    place through here, so the simulator is the tier's order by construction."""
    probation = start < 0
    if door is not None and new:
        probation |= not door.admit(key) and not start
    if probation or start:
        policy.insert(key, probation=probation, uses=max(start, 0))
    else:
        policy.insert(key)


class HintAdmission:
    """Where a put's new blocks start in the memory tiers' order, from its
    :class:`~kvstore.hints.PutHint`: :data:`PROBATION`, or a number of uses (0: as any new
    block). One per store, for every tier: a session's puts may land in either.

    A session remembers the last block of its last put. A put of the same session that
    neither contains that block nor hangs directly off it *branches* (a batch job's next
    prompt, the next question on a document): its new blocks start on probation. One that
    extends it (a conversation's next turn) and a session's first put start as usual; when
    the session's last block has left memory there is nothing to judge by, and the session's
    previous verdict stands. Bounded: the :data:`HINT_SESSIONS` sessions seen last. Not
    thread-safe (the store's lock).
    """

    __slots__ = ("_last", "_cap")

    def __init__(self, sessions: int = HINT_SESSIONS) -> None:
        # session -> (the last block of its last put, whether that put branched)
        self._last: OrderedDict[str, tuple[Hashable, bool]] = OrderedDict()
        self._cap = max(1, sessions)

    def __len__(self) -> int:
        return len(self._last)

    def start(self, hint: PutHint | None, keys: Sequence[Hashable], parent: Hashable | None,
              held: Callable[[Hashable], bool]) -> int:
        """Where the new blocks of a put of ``keys`` (the chain's blocks from ``keys[0]``,
        whose parent is ``parent``) start; ``held``: whether a block is in memory."""
        if hint is None:
            return 0
        start = PROBATION if hint.priority < 0 else hint.priority
        s = hint.session
        if s is None or not keys:
            return start
        last = self._last
        seen = last.get(s)
        branched = False
        if seen is None:
            if len(last) >= self._cap:
                last.popitem(last=False)
        else:
            last.move_to_end(s)
            prev, branched = seen
            if held(prev):
                branched = prev != parent and prev not in keys
        last[s] = (keys[-1], branched)
        return PROBATION if branched else start


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
