"""The store's catalog of blocks held in memory: chain links, pins and disk state.

Which memory tier holds a block is the tiers' business; the catalog knows each cached
block's parent and cached children (for leaf-first eviction and prefix-closure), its pin
count, whether a copy is known to be on disk, and which blocks still wait for the disk
writer (dirty, oldest first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvstore.keys import BlockKey


class Catalog:
    """Parent/children links of the blocks held in memory, and pin counts."""

    __slots__ = ("_parent", "_children", "_pins", "_on_disk", "_dirty", "_uses", "_stamp")

    def __init__(self) -> None:
        self._parent: dict[BlockKey, BlockKey | None] = {}
        self._children: dict[BlockKey, set[BlockKey]] = {}
        self._pins: dict[BlockKey, int] = {}
        self._on_disk: set[BlockKey] = set()
        #: dirty key -> the stamp it got when it became dirty (oldest first): a flush waits
        #: for the stamps up to the last one given before it, not for the list to run dry
        self._dirty: OrderedDict[BlockKey, int] = OrderedDict()
        self._uses: dict[BlockKey, int] = {}
        self._stamp = 0

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def __len__(self) -> int:
        return len(self._parent)

    def add(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self._parent:
            return
        self._parent[key] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)

    def forget(self, key: BlockKey) -> None:
        """Remove ``key`` (it must have no cached children)."""
        parent = self._parent.pop(key)
        if parent is not None:
            sib = self._children.get(parent)
            if sib is not None:
                sib.discard(key)
                if not sib:
                    del self._children[parent]
        self._pins.pop(key, None)
        self._on_disk.discard(key)
        self._dirty.pop(key, None)
        self._uses.pop(key, None)

    def parent(self, key: BlockKey) -> BlockKey | None:
        return self._parent.get(key)

    def has_children(self, key: BlockKey) -> bool:
        return bool(self._children.get(key))

    def children(self, key: BlockKey) -> set[BlockKey]:
        return self._children.get(key, set())

    def descendants_postorder(self, key: BlockKey) -> list[BlockKey]:
        """``key``'s cached descendants, children before parents, then ``key`` itself."""
        out: list[BlockKey] = []
        stack: list[tuple[BlockKey, bool]] = [(key, False)]
        while stack:
            k, expanded = stack.pop()
            if expanded:
                out.append(k)
                continue
            stack.append((k, True))
            for c in self._children.get(k, ()):
                stack.append((c, False))
        return out

    # -- pins --------------------------------------------------------------------------
    def pin(self, key: BlockKey) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def pin_many(self, keys: Iterable[BlockKey]) -> None:
        """One pin on each of ``keys`` (a fetch pins hundreds at once: no call per key)."""
        pins = self._pins
        get = pins.get
        for k in keys:
            pins[k] = get(k, 0) + 1

    def unpin_many(self, keys: Iterable[BlockKey]) -> None:
        """Drop one pin from each of ``keys`` (those not pinned are skipped)."""
        pins = self._pins
        get = pins.get
        for k in keys:
            n = get(k, 0)
            if n == 1:
                del pins[k]
            elif n > 1:
                pins[k] = n - 1

    def unpin(self, key: BlockKey) -> bool:
        """Drop one pin; False if ``key`` was not pinned."""
        n = self._pins.get(key, 0)
        if n <= 0:
            return False
        if n == 1:
            del self._pins[key]
        else:
            self._pins[key] = n - 1
        return True

    def is_pinned(self, key: BlockKey) -> bool:
        return key in self._pins

    @property
    def pinned_count(self) -> int:
        return len(self._pins)

    def keys(self) -> Iterator[BlockKey]:
        return iter(self._parent)

    # -- disk state -----------------------------------------------------------------------
    def set_on_disk(self, key: BlockKey) -> None:
        if key in self._parent:
            self._on_disk.add(key)
            self._dirty.pop(key, None)

    def clear_on_disk(self, key: BlockKey) -> None:
        self._on_disk.discard(key)

    def on_disk(self, key: BlockKey) -> bool:
        return key in self._on_disk

    def mark_dirty(self, key: BlockKey) -> None:
        if key in self._parent and key not in self._on_disk and key not in self._dirty:
            self._dirty[key] = self.next_stamp()

    def next_stamp(self) -> int:
        """A new stamp, later than every one given before (dirty blocks, overflow jobs)."""
        self._stamp += 1
        return self._stamp

    @property
    def stamp(self) -> int:
        """The last stamp given."""
        return self._stamp

    def oldest_dirty_stamp(self) -> int | None:
        """The stamp of the block that has waited longest for the writer (None: none waits)."""
        return next(iter(self._dirty.values()), None)

    def discard_dirty(self, key: BlockKey) -> None:
        """``key`` no longer waits for the writer (its disk copy was evicted on purpose)."""
        self._dirty.pop(key, None)

    def is_dirty(self, key: BlockKey) -> bool:
        return key in self._dirty

    def take_dirty(self, n: int) -> list[BlockKey]:
        """Remove and return up to ``n`` dirty keys, oldest first."""
        out: list[BlockKey] = []
        while self._dirty and len(out) < n:
            out.append(self._dirty.popitem(last=False)[0])
        return out

    @property
    def dirty_count(self) -> int:
        return len(self._dirty)

    def use(self, key: BlockKey) -> int:
        """Count one use of ``key``; returns the uses so far (for second-hit admission)."""
        n = self._uses.get(key, 0) + 1
        self._uses[key] = n
        return n
