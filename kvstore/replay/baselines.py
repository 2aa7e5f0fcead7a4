"""Published eviction policies the replay simulator compares the store's against: ARC and
S3-FIFO, as :class:`~kvstore.tiers.policy.EvictionPolicy` orders (simulator only, never a
tier's policy).

Each runs under the simulator's rules (the store's): a block with cached children is skipped
(leaf-first, prefix-closed), and a use is a touch in a later touch call than the block's last
one (a fetch and then the same request's put count once; the touch right after an insert is
not a use), as :class:`~kvstore.tiers.reuse_policy.ReusePolicy` counts uses.

* ``"arc"``: Adaptive Replacement Cache (Megiddo and Modha, FAST'03): ``T1`` (used once
  lately) and ``T2`` (used twice or more), both LRU, with ghost lists ``B1``/``B2`` of the
  keys they evicted (up to the cache's size each); a key back from ``B1`` grows ``T1``'s
  target ``p``, one back from ``B2`` shrinks it; the victim is ``T1``'s oldest while ``T1``
  is over ``p``, else ``T2``'s.
* ``"s3fifo"``: S3-FIFO (Yang et al., SOSP'23): a small FIFO (10 % of the slots) new keys
  enter, a main FIFO, a ghost FIFO of keys evicted from the small one (as many as slots); a
  key leaving the small FIFO moves to the main one if it was used there, else it is
  evicted (a ghost); the main FIFO reinserts a used key with its count (up to 3) minus one.
  Keys back from the ghost enter the main FIFO.
* ``"lhd"``: hit density per use class and age (LHD's shape, Beckmann et al., NSDI'18),
  issue 30's candidate that was not adopted: :mod:`kvstore.replay.lhd`. Only on request
  (``--baselines lhd``), not among :data:`DEFAULT_BASELINES`.
* ``"lrb"``: a learned next-use ranking (LRB's shape, Song et al., NSDI'20): an online
  logistic regression over recency, uses and prefix-tree features scores sampled
  candidates; issue 30's second candidate, not adopted: :mod:`kvstore.replay.lrb`. Only on
  request (``--baselines lrb``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from itertools import chain

from kvstore.replay.lhd import LHDPolicy
from kvstore.replay.lrb import LRBPolicy

#: policies only the simulator runs: name -> class (built with the tier's slots)
SIM_ONLY = ("arc", "s3fifo", "lhd", "lrb")
#: the ones that take a put's hint (as a feature of the put's blocks, not a placement)
HINTED = ("lrb",)
#: the ones a report shows unless told otherwise
DEFAULT_BASELINES = ("arc", "s3fifo")


class ARCPolicy:
    """ARC as an eviction order (see the module docstring)."""

    name = "arc"

    def __init__(self, slots: int) -> None:
        self._c = max(1, slots)
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._p = 0.0
        self._last: dict[Hashable, int] = {}  # key -> its last touch call
        self._call = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        if key in self._t1 or key in self._t2:
            return
        self._last[key] = self._call
        if key in self._b1:
            self._p = min(self._c, self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        del self._last[key]
        if key in self._t1:
            del self._t1[key]
            ghost = self._b1
        else:
            del self._t2[key]
            ghost = self._b2
        if for_room:
            ghost[key] = None
            if len(ghost) > self._c:
                ghost.popitem(last=False)

    def touch(self, keys: Iterable[Hashable]) -> None:
        self._call = call = self._call + 1
        last, t1, t2 = self._last, self._t1, self._t2
        for k in keys:
            seen = last.get(k)
            if seen is None:
                continue
            last[k] = call
            if k in t2:
                t2.move_to_end(k)
            elif seen < call - 1:  # a use: on to T2
                del t1[k]
                t2[k] = None
            else:
                t1.move_to_end(k)

    def _first(self) -> tuple[OrderedDict[Hashable, None], OrderedDict[Hashable, None]]:
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            return self._t1, self._t2
        return self._t2, self._t1

    def victims(self) -> Iterator[Hashable]:
        a, b = self._first()
        return chain(a, b)

    def peek(self) -> Hashable | None:
        a, b = self._first()
        return next(iter(a)) if a else (next(iter(b)) if b else None)

    def state(self) -> str:
        return ""

    def order(self) -> list[Hashable]:
        return list(self.victims())


class S3FIFOPolicy:
    """S3-FIFO as an eviction order (see the module docstring). :meth:`peek` and
    :meth:`victims` move keys between the queues (the policy's lazy promotion) before they
    offer the victim."""

    name = "s3fifo"

    def __init__(self, slots: int, *, small: float = 0.1) -> None:
        self._c = max(1, slots)
        self._small_cap = max(1, int(self._c * small))
        self._s: OrderedDict[Hashable, None] = OrderedDict()
        self._m: OrderedDict[Hashable, None] = OrderedDict()
        self._g: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._last: dict[Hashable, int] = {}
        self._call = 0

    def __len__(self) -> int:
        return len(self._s) + len(self._m)

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        if key in self._freq:
            return
        self._freq[key] = 0
        self._last[key] = self._call
        if key in self._g:
            del self._g[key]
            self._m[key] = None
        else:
            self._s[key] = None

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        del self._freq[key]
        del self._last[key]
        if key in self._s:
            del self._s[key]
            if for_room:
                self._g[key] = None
                if len(self._g) > self._c:
                    self._g.popitem(last=False)
        else:
            del self._m[key]

    def touch(self, keys: Iterable[Hashable]) -> None:
        self._call = call = self._call + 1
        last, freq = self._last, self._freq
        for k in keys:
            seen = last.get(k)
            if seen is None:
                continue
            last[k] = call
            if seen < call - 1 and freq[k] < 3:
                freq[k] += 1

    def _settle(self) -> Hashable | None:
        """Promote and rotate until the head of a queue is a victim; return it."""
        s, m, freq = self._s, self._m, self._freq
        while True:
            if s and (len(s) >= self._small_cap or not m):
                k = next(iter(s))
                if freq[k] > 0:
                    del s[k]
                    freq[k] = 0
                    m[k] = None
                    continue
                return k
            if not m:
                return None
            k = next(iter(m))
            f = freq[k]
            if f > 0:
                freq[k] = f - 1
                m.move_to_end(k)
                continue
            return k

    def victims(self) -> Iterator[Hashable]:
        first = self._settle()
        if first is None:
            return iter(())
        if first in self._s:
            return chain(self._s, self._m)
        return chain(self._m, self._s)

    def peek(self) -> Hashable | None:
        return self._settle()

    def state(self) -> str:
        return ""

    def order(self) -> list[Hashable]:
        return list(self.victims())


def make_baseline(name: str, slots: int) -> ARCPolicy | S3FIFOPolicy | LHDPolicy | LRBPolicy:
    if name == "lrb":
        return LRBPolicy(slots)
    if name == "lhd":
        return LHDPolicy(slots)
    if name == "arc":
        return ARCPolicy(slots)
    if name == "s3fifo":
        return S3FIFOPolicy(slots)
    raise ValueError(f"not a simulator baseline: {name!r}")
