"""``PrefixIndex``: which engine holds which block, fed by KV event batches.

Per block hash the index keeps a bitmask of the engines holding it (in any medium), per
engine the media each of its blocks sits in, and one global parent -> children map (a block's
parent is part of its hash, so it is the same on every engine). Each engine's blocks are kept
**prefix-closed**, as the store keeps its own: a ``BlockStored`` whose parent the engine does
not hold is dropped (counted), and a block that leaves an engine's last medium takes its
descendants on that engine with it. So "engine ``e`` holds block ``i`` of a prompt" is
monotone in ``i``, and :meth:`PrefixIndex.match` finds every engine's leading run by
bisection: ``O(engines * log(blocks))`` dictionary probes, whatever the prompt's length.

Thread-safe: the subscriber's thread applies batches while routers match.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.events.types import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)

_MAX_MEDIA = 16  # distinct medium names tracked; further unknown ones share the last bit


@dataclass(frozen=True, slots=True)
class Matches:
    """Each engine's leading run of a prompt's blocks, in the order the engines were asked."""

    engines: tuple[str, ...]
    blocks: tuple[int, ...]

    def of(self, engine: str) -> int:
        return self.blocks[self.engines.index(engine)]

    @property
    def longest(self) -> int:
        return max(self.blocks, default=0)


@dataclass(frozen=True, slots=True)
class Applied:
    """What one batch did to one engine's entry."""

    stored: int  # blocks newly held (or held in one more medium)
    removed: int  # blocks that left the engine (descendants included)
    dropped: int  # blocks refused: their parent is not held by the engine
    cleared: bool


@dataclass(frozen=True, slots=True)
class IndexStats:
    engines: tuple[str, ...]
    blocks: tuple[int, ...]  # per engine
    unique_blocks: int
    dropped: int


class PrefixIndex:
    """The engines' blocks. Engines are added by name (:meth:`add_engine`) before their
    batches are applied; removing one forgets everything it held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bit: dict[str, int] = {}
        self._free: list[int] = []
        self._held: dict[BlockHash, int] = {}
        self._media: dict[str, dict[BlockHash, int]] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self._medium_bit: dict[str | None, int] = {
            MEDIUM_GPU: 1, MEDIUM_CPU: 2, MEDIUM_STORAGE: 4, None: 8}
        self._dropped = 0

    # -- engines -------------------------------------------------------------------------------
    def add_engine(self, name: str) -> None:
        with self._lock:
            if name in self._bit:
                return
            self._bit[name] = 1 << (self._free.pop() if self._free else len(self._bit))
            self._media[name] = {}

    def remove_engine(self, name: str) -> None:
        """Forget ``name`` and every block it held."""
        with self._lock:
            if name not in self._bit:
                return
            self._clear(name)
            bit = self._bit.pop(name)
            del self._media[name]
            self._free.append(bit.bit_length() - 1)

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(self._bit)

    def clear(self, name: str) -> None:
        """``name`` holds nothing (it fell silent, or it is about to be resynced)."""
        with self._lock:
            if name in self._bit:
                self._clear(name)

    # -- events --------------------------------------------------------------------------------
    def apply(self, name: str, events: Iterable[Event]) -> Applied:
        """Apply one batch's events from engine ``name`` (which must have been added)."""
        stored = removed = dropped = 0
        cleared = False
        with self._lock:
            if name not in self._bit:
                raise KeyError(f"engine {name!r} is not in the index; add_engine() it first")
            for ev in events:
                if isinstance(ev, BlockStored):
                    s, d = self._stored(name, ev)
                    stored += s
                    dropped += d
                elif isinstance(ev, BlockRemoved):
                    removed += self._removed(name, ev)
                elif isinstance(ev, AllBlocksCleared):
                    removed += self._clear(name)
                    cleared = True
            self._dropped += dropped
        return Applied(stored, removed, dropped, cleared)

    def _mbit(self, medium: str | None) -> int:
        b = self._medium_bit.get(medium)
        if b is None:
            n = len(self._medium_bit)
            b = 1 << min(n, _MAX_MEDIA - 1)
            if n < _MAX_MEDIA:
                self._medium_bit[medium] = b
        return b

    def _stored(self, name: str, ev: BlockStored) -> tuple[int, int]:
        bit, media, held = self._bit[name], self._media[name], self._held
        prev = ev.parent_block_hash
        if prev is not None and prev not in media:
            return 0, len(ev.block_hashes)  # not reachable from the engine's prefixes
        mb = self._mbit(ev.medium)
        parent_of, children = self._parent, self._children
        n = 0
        for i, h in enumerate(ev.block_hashes):
            m = media.get(h)
            if m is None:
                if parent_of.get(h, prev) != prev:
                    # known under another parent (a hostile or colliding publisher): held here
                    # it would not be among that parent's children, so this engine's removal
                    # of ``prev`` would leave it behind and match() would claim the whole run
                    rest = len(ev.block_hashes) - i
                    return n, rest
                media[h] = mb
                held[h] = held.get(h, 0) | bit
                if h not in parent_of:
                    parent_of[h] = prev
                    if prev is not None:
                        children.setdefault(prev, set()).add(h)
                n += 1
            elif not m & mb:
                media[h] = m | mb
                n += 1
            prev = h
        return n, 0

    def _removed(self, name: str, ev: BlockRemoved) -> int:
        media = self._media[name]
        mb = None if ev.medium is None else self._mbit(ev.medium)
        n = 0
        for h in ev.block_hashes:
            m = media.get(h)
            if m is None:
                continue
            rest = 0 if mb is None else m & ~mb
            if rest:
                media[h] = rest
            else:
                n += self._drop(name, h)
        return n

    def _drop(self, name: str, root: BlockHash) -> int:
        """``root`` and its descendants leave engine ``name``."""
        bit, media, held, children = self._bit[name], self._media[name], self._held, self._children
        n = 0
        stack = [root]
        while stack:
            k = stack.pop()
            if media.pop(k, None) is None:
                continue
            n += 1
            kids = children.get(k)
            if kids:
                stack.extend(kids)
            rest = held[k] & ~bit
            if rest:
                held[k] = rest
            else:
                del held[k]
                self._forget(k)
        return n

    def _forget(self, k: BlockHash) -> None:
        p = self._parent.pop(k, None)
        if p is not None:
            sib = self._children.get(p)
            if sib is not None:
                sib.discard(k)
                if not sib:
                    del self._children[p]

    def _clear(self, name: str) -> int:
        bit, media, held = self._bit[name], self._media[name], self._held
        n = len(media)
        for k in media:
            rest = held[k] & ~bit
            if rest:
                held[k] = rest
            else:
                del held[k]
                self._forget(k)
        media.clear()
        return n

    # -- queries -------------------------------------------------------------------------------
    def match(self, keys: Sequence[BlockHash], engines: Sequence[str] | None = None) -> Matches:
        """The leading run of ``keys`` each engine holds (``engines``: those to ask, default
        all; unknown names hold nothing)."""
        with self._lock:
            names = tuple(self._bit) if engines is None else tuple(engines)
            bits = self._bit
            mask = 0
            for e in names:
                mask |= bits.get(e, 0)
            found = self._boundaries(keys, mask) if mask else {}
            return Matches(names, tuple([found.get(bits.get(e, 0), 0) for e in names]))

    def _boundaries(self, keys: Sequence[BlockHash], mask: int) -> dict[int, int]:
        """engine bit -> leading run, for the engines of ``mask`` holding ``keys[0]``."""
        n = len(keys)
        get = self._held.get
        # list's own item access: a KeyChain's Python-level __getitem__ costs 5x per probe
        at = list.__getitem__.__get__(keys) if isinstance(keys, list) else keys.__getitem__
        first = get(at(0), 0) & mask if n else 0
        out: dict[int, int] = {}
        if not first:
            return out
        last = get(at(n - 1), 0) & first
        _assign(out, last, n)
        # each engine holding keys[0] but not keys[n-1] ends somewhere in between: a plain
        # bisection per engine, a tight loop of ~log2(n) probes (sharing the first probes
        # between engines through a work stack cost more in bookkeeping than it saved)
        rest = first & ~last
        while rest:
            bit = rest & -rest
            rest ^= bit
            lo, hi = 0, n - 1  # keys[lo] is held by the engine, keys[hi] is not
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if get(at(mid), 0) & bit:
                    lo = mid
                else:
                    hi = mid
            out[bit] = lo + 1
        return out

    def holds(self, name: str, key: BlockHash) -> bool:
        with self._lock:
            m = self._media.get(name)
            return m is not None and key in m

    def media_of(self, name: str, key: BlockHash) -> tuple[str | None, ...]:
        """The media ``name`` holds ``key`` in (empty if it does not)."""
        with self._lock:
            m = self._media.get(name, {}).get(key, 0)
            return tuple(med for med, b in self._medium_bit.items() if m & b)

    def stats(self) -> IndexStats:
        with self._lock:
            names = tuple(self._bit)
            return IndexStats(names, tuple(len(self._media[e]) for e in names),
                              len(self._held), self._dropped)


def _assign(out: dict[int, int], mask: int, length: int) -> None:
    while mask:
        low = mask & -mask
        out[low] = length
        mask ^= low
