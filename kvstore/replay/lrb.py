"""A learned eviction ranking in the style of LRB ("learning relaxed Belady", Song et al.,
NSDI'20), for the replay simulator only (``kvstore replay --baselines lrb``): issue 30's
second "new kind of ranking" (docs/benchmarks.md "Eviction across trace families"); never a
tier's policy.

Belady evicts the block whose next use is farthest; LRB relaxes that to "evict a block not
used again within a horizon" (the *Belady boundary*) and learns which blocks those are. Here
an online logistic regression predicts, for a block as it stands now, the chance that it is
asked for again (a use while held, or a miss that puts it back) within ``horizon x slots``
blocks inserted. The victim is the lowest-scoring leaf among candidates drawn at eviction
time: ``sample`` blocks at random plus the ``tail`` least recently used ones (LRU's own
victims always compete, so a model that knows nothing still evicts about as LRU does).
The defaults were chosen on issue 30's fit traces (docs/benchmarks.md): the mean share of the
LRU -> Belady gap closed at 5 % rose with the sample, 16 / 64 / 128 / 256 keys: 10.0 / 24.4 /
25.7 / 27.3 %, and so did the cost (+39-52 us per block reference beyond LRU in the simulator
at 256, far over the store's 2 us budget: this is a measurement of what a learned ranking can
do, not a tier's policy). ``batch`` > 1 lets one scoring serve that many evictions (its
lowest candidates in order; 256 / 8: 24.2 %, +6-10 us).

Features (one-hot, so a score is a sum of a few weights):

* dynamic: the block's age since its last use (8 bins, powers of two of 1/8 tier turnover)
  crossed with its use class (0, 1, 2, 3+ uses, kept across eviction by a ghost list, as
  :mod:`kvstore.tiers.use_classes` counts them); its last gap between two uses (5 bins);
* the prefix tree, fixed when the block was put: its depth (5 bins); its place in the put
  (the first new block, the put's leaf, both, or inside); how long a run the request found
  cached (0, 1, 2-5, 6-20, 20+ blocks: a long cached run with a new tail is a conversation's
  next turn, none is a new document or a scan); its parent's use class; how many children
  its parent had taken before it (a branch point: a system prompt, a document asked many
  questions, a scan's shared instruction).

The policy sees no parent links: it infers them from the calls the store makes (a fetch
touches its held run leaf first; the put then inserts the new blocks root first and touches
them), exactly in the simulator; a wrong guess costs ranking quality, never a guarantee
(the simulator and the store still skip blocks with children).

Training (the label is the future, so it comes late): when candidates are drawn, one in
``2 ** train_shift`` of them (by key hash) is remembered with its features and the clock; a
use of that key or its return after eviction before ``horizon`` has passed labels it 1, the
horizon passing labels it 0, and one SGD step follows. Evicted keys keep their pending
samples (the ghost side of the label), so what the policy evicts is still learned from.

Uses as the store counts them: a touch in a later touch call than the block's last one. Runs
under admission ``"always"``. With hints (``kvstore replay --hints``, the one simulator
baseline that takes them: :data:`~kvstore.replay.baselines.HINTED`) a put the session hint
sends to probation (it branched off its session's last put) is a feature of its blocks, one
more thing to learn from, not a place in the order: it has no probation.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator
from itertools import chain

#: use classes (0, 1, 2, 3+ uses)
LRB_CLASSES = 4
#: the horizon of the label, in tier turnovers (blocks inserted / slots)
LRB_HORIZON = 1.0
#: candidates per eviction: drawn at random, and the least recently used
LRB_SAMPLE, LRB_TAIL = 256, 8
#: evictions served by one scoring (the lowest ``batch`` candidates, in order)
LRB_BATCH = 1
#: one candidate in 2 ** this becomes a training sample
LRB_TRAIN_SHIFT = 2
#: SGD step size
LRB_RATE = 0.05
#: ghost keys per slot (two generations), as the store's reuse-ranking policies keep
LRB_GHOSTS = 6

# feature layout: one weight per one-hot slot
_AGE_BINS = 8
_F_BIAS = 0
_F_AGE = 1  # age bin x use class
_F_GAP = _F_AGE + _AGE_BINS * LRB_CLASSES  # none, then 4 bins
_F_DEPTH = _F_GAP + 5
_F_PLACE = _F_DEPTH + 5  # inner, first, leaf, first and leaf
_F_RUN = _F_PLACE + 4  # the request's cached run
_F_PARENT = _F_RUN + 5  # no parent, then its use class
_F_FAN = _F_PARENT + 1 + LRB_CLASSES  # children the parent took before: 0, 1, 2-3, 4+
# the put's hint sent it to probation (its session branched); absent otherwise, so that runs
# without hints learn exactly as before the feature was added (a second bias would not)
_F_HINT = _F_FAN + 4
FEATURES = _F_HINT + 1

_PLACE_FIRST, _PLACE_LEAF = 1, 2
#: the prefix-tree features, in the order of the static feature tuple
TREE_FEATURES = ("depth", "place", "run", "parent", "fan")


def _run_bin(n: int) -> int:
    return 0 if n == 0 else 1 if n == 1 else 2 if n <= 5 else 3 if n <= 20 else 4


def _depth_bin(d: int) -> int:
    return 0 if d == 0 else 1 if d <= 2 else 2 if d <= 8 else 3 if d <= 32 else 4


def _fan_bin(n: int) -> int:
    return 0 if n == 0 else 1 if n == 1 else 2 if n <= 3 else 3


def _first(t: tuple[float, Hashable]) -> float:
    return t[0]


def prior() -> list[float]:
    """The weights before any label: older is lower, a use is worth a little (about LRU
    over the candidates, with ``"reuse"``'s lean)."""
    w = [0.0] * FEATURES
    for a in range(_AGE_BINS):
        for c in range(LRB_CLASSES):
            w[_F_AGE + a * LRB_CLASSES + c] = -0.5 * a + 0.25 * c
    return w


class LRBPolicy:
    """A learned next-use ranking over sampled candidates (see the module docstring)."""

    name = "lrb"
    __slots__ = ("_slots", "_info", "_lru", "_keys", "_ghost", "_ghost_old", "_ghost_cap",
                 "_clock", "_call", "_w", "_pending", "_horizon", "_sample", "_tail",
                 "_train_mask", "_rate", "_rng", "_children", "_fresh", "_anchor",
                 "_anchor_run", "_put", "_labels", "_tree", "_victim", "_batch", "_doomed",
                 "_scored")

    def __init__(self, slots: int, *, horizon: float = LRB_HORIZON, sample: int = LRB_SAMPLE,
                 tail: int = LRB_TAIL, train_shift: int = LRB_TRAIN_SHIFT,
                 rate: float = LRB_RATE, ghosts: int = LRB_GHOSTS, seed: int = 0,
                 tree: tuple[str, ...] = TREE_FEATURES, batch: int = LRB_BATCH) -> None:
        self._slots = max(1, slots)
        # key -> [use class, last touch call, clock at last use, last gap (-1: none),
        #         static feature indices, position in _keys, parent, children taken]
        self._info: dict[Hashable, list] = {}
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self._keys: list[Hashable] = []  # every key held, for drawing at random
        # evicted key -> its use class, two generations
        self._ghost: dict[Hashable, int] = {}
        self._ghost_old: dict[Hashable, int] = {}
        self._ghost_cap = max(1, ghosts * self._slots // 2)
        self._clock = 0  # blocks inserted
        self._call = 0  # touch calls
        self._w = prior()
        # key -> (feature indices, clock when drawn): samples waiting for their label
        self._pending: OrderedDict[Hashable, tuple[tuple[int, ...], int]] = OrderedDict()
        self._horizon = max(1, int(horizon * self._slots))
        self._sample, self._tail = sample, tail
        self._train_mask = (1 << train_shift) - 1
        self._rate = rate
        self._rng = random.Random(seed)
        self._children: dict[Hashable, int] = {}  # cached children per key (> 0 only)
        self._fresh: list[Hashable] = []  # inserted since the last touch call, in order
        self._anchor: Hashable | None = None  # the deepest block the last fetch found held
        self._anchor_run = 0  # how many blocks that fetch found held
        self._put = -1  # the touch call whose put the inserts belong to
        self._labels = [0, 0]  # samples labelled 0 and 1
        for t in tree:
            if t not in TREE_FEATURES:
                raise ValueError(f"not a tree feature: {t!r}")
        # which of the tree features the model sees (the others stay at their first bin)
        self._tree = tuple(t in tree for t in TREE_FEATURES)
        # the victim peek() chose, until the tier changes (victims() starts with the same)
        self._victim: Hashable | None = None
        # the next victims of the last scoring, lowest first: a scoring of ``sample`` keys
        # serves ``batch`` evictions; a key touched (or removed) since drops out
        self._batch = max(1, batch)
        self._doomed: list[Hashable] = []
        self._scored = 0  # the touch call of that scoring

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._info

    @property
    def weights(self) -> list[float]:
        """The model (a copy), indexed as the module's feature layout."""
        return list(self._w)

    @property
    def labels(self) -> tuple[int, int]:
        """Training samples labelled so far: (not used within the horizon, used)."""
        return self._labels[0], self._labels[1]

    def uses_class(self, key: Hashable) -> int:
        return self._info[key][0]

    def parent(self, key: Hashable) -> Hashable | None:
        """The block ``key`` was inferred to hang off (None: a root, or unknown)."""
        return self._info[key][6]

    # the model

    def features(self, key: Hashable) -> tuple[int, ...]:
        """The feature indices of a held ``key`` now."""
        e = self._info[key]
        x = (self._clock - e[2]) * 8 // self._slots
        a = x.bit_length() if x < 128 else _AGE_BINS - 1
        if a >= _AGE_BINS:
            a = _AGE_BINS - 1
        g = e[3]
        if g < 0:
            gb = 0
        else:
            y = (g * 8 // self._slots).bit_length() // 2
            gb = 1 + (y if y < 3 else 3)
        return (_F_BIAS, _F_AGE + a * LRB_CLASSES + e[0], _F_GAP + gb) + e[4]

    def score(self, key: Hashable) -> float:
        """The model's logit that a held ``key`` is asked for within the horizon."""
        w = self._w
        return sum(w[i] for i in self.features(key))

    def _learn(self, idx: tuple[int, ...], y: int) -> None:
        w = self._w
        z = sum(w[i] for i in idx)
        p = 1.0 / (1.0 + math.exp(-z)) if z > -30 else 0.0
        step = self._rate * (y - p)
        for i in idx:
            w[i] += step
        self._labels[y] += 1

    def _expire(self) -> None:
        """Samples whose horizon passed without a use: labelled 0."""
        pend, oldest = self._pending, self._clock - self._horizon
        while pend:
            k, (idx, t) = next(iter(pend.items()))
            if t > oldest:
                break
            del pend[k]
            self._learn(idx, 0)

    def _asked(self, key: Hashable) -> None:
        """``key`` was asked for again (a use, or back after eviction)."""
        got = self._pending.pop(key, None)
        if got is not None:
            self._learn(got[0], 1 if self._clock - got[1] <= self._horizon else 0)

    # the protocol

    def insert(self, key: Hashable, *, probation: bool = False, uses: int = 0) -> None:
        self._victim = None
        self._clock = clock = self._clock + 1
        e = self._info.get(key)
        if e is not None:  # republished: a use-less touch
            e[1], e[2] = self._call, clock
            self._lru.move_to_end(key)
            return
        back = self._ghost.pop(key, None)
        if back is None and self._ghost_old:
            back = self._ghost_old.pop(key, None)
        if key in self._pending:
            self._asked(key)
        c = min(uses, LRB_CLASSES - 1)
        if back is not None:
            c = max(c, min(back + 1, LRB_CLASSES - 1))
        # the put's place in the tree: its first block hangs off the fetch's deepest block
        if self._put != self._call:
            self._put = self._call
            parent, depth, place = self._anchor, self._anchor_run, _PLACE_FIRST
        else:
            parent = self._fresh[-1] if self._fresh else None
            depth, place = self._anchor_run + len(self._fresh), 0
        pinfo = self._info.get(parent) if parent is not None else None
        if pinfo is None:
            parent, pclass, fan = None, 0, 0
        else:
            pclass, fan = 1 + pinfo[0], pinfo[7]
            pinfo[7] += 1
            self._children[parent] = self._children.get(parent, 0) + 1
        on = self._tree
        static = (_F_DEPTH + (_depth_bin(depth) if on[0] else 0), _F_PLACE + (place if on[1] else 0),
                  _F_RUN + (_run_bin(self._anchor_run) if on[2] else 0),
                  _F_PARENT + (pclass if on[3] else 0), _F_FAN + (_fan_bin(fan) if on[4] else 0)
                  ) + ((_F_HINT,) if probation else ())
        self._info[key] = [c, self._call, clock, -1, static, len(self._keys), parent, 0]
        self._keys.append(key)
        self._lru[key] = None
        self._fresh.append(key)

    def remove(self, key: Hashable, *, for_room: bool) -> None:
        self._victim = None
        e = self._info.pop(key)
        del self._lru[key]
        keys, i = self._keys, e[5]
        last = keys.pop()
        if last is not key and i < len(keys):
            keys[i] = last
            self._info[last][5] = i
        p = e[6]
        if p is not None and p in self._children:
            n = self._children[p] - 1
            if n > 0:
                self._children[p] = n
            else:
                del self._children[p]
        if for_room:
            ghost = self._ghost
            ghost[key] = e[0]
            if len(ghost) >= self._ghost_cap:
                self._ghost_old, self._ghost = ghost, {}
        else:
            self._pending.pop(key, None)

    def touch(self, keys: Iterable[Hashable]) -> None:
        info = self._info
        self._victim = None
        self._call = call = self._call + 1
        fresh = self._fresh
        if fresh:  # the put is over: its last block is its leaf
            leaf = info.get(fresh[-1])
            if leaf is not None and self._tree[1]:
                s = leaf[4]
                leaf[4] = (s[0], s[1] + _PLACE_LEAF) + s[2:]
            self._fresh = []
        if not info:
            return
        last, clock, lru, pend = call - 1, self._clock, self._lru, self._pending
        floor = 0  # a parent is used whenever its child is
        first: Hashable | None = None
        run = 0
        for k in keys:  # leaf first
            e = info.get(k)
            if e is None:
                continue
            if first is None:
                first = k
            run += 1
            c = e[0]
            if e[1] < last:  # a use
                if c < LRB_CLASSES - 1:
                    c += 1
                e[3] = clock - e[2]
                if k in pend:
                    self._asked(k)
            if c < floor:
                c = floor
            floor = c
            e[0], e[1], e[2] = c, call, clock
            lru.move_to_end(k)
        if first is not None:
            # a fetch's held run (the put's own touch of what it inserted is no fetch)
            if fresh and first is fresh[-1]:
                self._anchor, self._anchor_run = None, 0
            else:
                self._anchor, self._anchor_run = first, run

    def _candidates(self) -> list[Hashable]:
        children, keys = self._children, self._keys
        out: list[Hashable] = []
        # the tail's leaves, among at most 4 x tail keys (a long chain put at once is all
        # inner blocks but its leaf: the walk is bounded, not the tail)
        n, left = 0, 4 * self._tail
        for k in self._lru:
            left -= 1
            if left < 0:
                break
            if k not in children:
                out.append(k)
                n += 1
                if n >= self._tail:
                    break
        if len(keys) > self._tail:
            draw = self._rng.randrange
            m = len(keys)
            for _ in range(self._sample):
                k = keys[draw(m)]
                if k not in children:
                    out.append(k)
        return out

    def peek(self) -> Hashable | None:
        if self._victim is not None:
            return self._victim
        if not self._info:
            return None
        info, children, doomed = self._info, self._children, self._doomed
        while doomed:
            k = doomed.pop()
            e = info.get(k)
            if e is not None and e[1] <= self._scored and k not in children:
                self._victim = k
                return k
        self._expire()
        w, pend, mask = self._w, self._pending, self._train_mask
        scored = []
        for k in self._candidates():
            idx = self.features(k)
            scored.append((sum(w[i] for i in idx), k))
            # sampled by the key's last byte (a digest: the same in every process)
            if not (k[-1] if type(k) is bytes else hash(k)) & mask and k not in pend:
                pend[k] = (idx, self._clock)
        if not scored:
            self._victim = next(iter(self._lru))
            return self._victim
        if self._batch == 1:
            self._victim = min(scored, key=_first)[1]
            return self._victim
        scored.sort(key=_first)
        seen: set[Hashable] = set()
        best = [k for _, k in scored if not (k in seen or seen.add(k))][:self._batch]
        self._scored = self._call
        self._doomed = best[:0:-1]  # the rest, popped lowest first
        self._victim = best[0]
        return self._victim

    def victims(self) -> Iterator[Hashable]:
        """The best candidate first, then least recently used first (the simulator walks
        this only when the first is not a leaf)."""
        first = self.peek()
        if first is None:
            return iter(())
        return chain((first,), (k for k in self._lru if k is not first))

    def order(self) -> list[Hashable]:
        return list(self.victims())

    def state(self) -> str:
        return ""
