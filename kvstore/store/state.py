"""The state every part of the store shares, in one place.

One lock (``lock``) guards the catalog, the memory tiers' maps and the counters. Copies run
on the copy engine outside it; the blocks being copied are pinned, so they cannot be evicted
mid-copy. Each job of the store (residency, fetch, put, paged I/O, write-back, zero-copy) is a
module of :mod:`kvstore.store` holding this state, never a mixin reaching into another's.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import NamespaceMismatchError, StoreClosedError
from kvstore.keys import BlockKey, KeyChain, all_keys, check_key
from kvstore.stats import Counters
from kvstore.store.admission import DiskAdmission
from kvstore.store.catalog import Catalog
from kvstore.store.durability import Durability
from kvstore.tiers.admission import HintAdmission

if TYPE_CHECKING:
    import torch

    from kvstore.events.sink import EventSink
    from kvstore.layout import KVLayout
    from kvstore.namespace import Namespace
    from kvstore.store.config import StoreConfig
    from kvstore.store.copy_engine import CopyEngine
    from kvstore.store.put import OverflowJob
    from kvstore.store.writer import WriteBehind
    from kvstore.tiers.base import LowerTier
    from kvstore.tiers.memory import MemoryTier
    from kvstore.transfer import Transfer

#: tier names (``kvstore.api.Tier`` values)
HOT, WARM, DISK, REMOTE = "hot", "warm", "disk", "remote"

#: this process's id, renewed in a forked child: ``check_open`` runs on every call and compares
#: against it instead of calling ``os.getpid()`` (a system call, ~90 ns)
_this_pid = os.getpid()


#: every store state of this process: a forked child gives each a fresh lock
_states: weakref.WeakSet[StoreState] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _this_pid
    _this_pid = os.getpid()
    # a thread of the parent inside the store at the fork held its lock, and no thread of
    # the child will ever release it: every call here (which only raises StoreClosedError
    # naming the fork, or forgets the copy in close) waited on it forever
    for st in list(_states):
        st.lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(eq=False)
class StoreState:
    """What the store's parts share. Mutable fields change only under ``lock``."""

    config: StoreConfig
    hot: MemoryTier | None
    warm: MemoryTier | None
    lower: list[LowerTier] = field(default_factory=list)  # below memory, fastest first
    engine: CopyEngine | None = None
    writer: WriteBehind | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    catalog: Catalog = field(default_factory=Catalog)
    counters: Counters = field(default_factory=Counters)
    closed: bool = False
    closing: bool = False
    pid: int = field(default_factory=os.getpid)  # the process that opened it
    # dirty blocks read from a lower tier below the first: the index of that tier (write-back
    # copies them to the tiers above it, not back to where they came from)
    came_from: dict[BlockKey, int] = field(default_factory=dict)
    overflow: deque[OverflowJob] = field(default_factory=deque)  # puts going straight to disk
    overflow_bytes: int = 0
    pending: dict[BlockKey, Transfer[int]] = field(default_factory=dict)  # put copies in flight
    granted: set[BlockKey] = field(default_factory=set)  # granted puts not yet committed
    durability: Durability = field(default_factory=Durability)  # what flush cannot vouch for
    events: EventSink | None = None  # told what each tier now holds or let go (KV events)
    disk_admission: DiskAdmission = field(init=False)  # from config.admission
    hints: HintAdmission = field(default_factory=HintAdmission)  # where hinted puts start

    def __post_init__(self) -> None:
        self.disk_admission = DiskAdmission(self.config.admission)
        _states.add(self)

    def announce_stored(self, tier: str, keys: Sequence[BlockKey],
                        parents: Sequence[BlockKey | None] | None = None) -> None:
        """Tell the event sink ``keys`` joined ``tier`` (parents from the catalog unless
        given); a no-op without one. Called under ``lock``, so events follow the tier's order."""
        if self.events is not None and keys:
            if parents is None:
                parents = [self.catalog.parent(k) for k in keys]
            self.events.stored(tier, list(keys), list(parents))

    def announce_removed(self, tier: str | None, keys: Sequence[BlockKey]) -> None:
        """Tell the event sink ``keys`` left ``tier`` (``None``: every tier)."""
        if self.events is not None and keys:
            self.events.removed(tier, list(keys))

    @property
    def durable(self) -> LowerTier | None:
        """The first lower tier that keeps what it is given (the disk), or None."""
        for t in self.lower:
            if not t.volatile:
                return t
        return None

    @property
    def namespace(self) -> Namespace:
        return self.config.namespace

    @property
    def layout(self) -> KVLayout:
        return self.config.namespace.layout

    @property
    def namespace_id(self) -> bytes:
        return self.config.namespace.id

    @property
    def device(self) -> torch.device:
        return self.config.device

    def forked(self) -> bool:
        """Whether this is a forked child's copy of a store its parent opened."""
        return self.pid != _this_pid

    def check_open(self) -> None:
        if self.closed or self.closing:
            raise StoreClosedError("the store is closed; open a new one with open_store()")
        if self.forked():
            # after fork() the child has the store's memory but none of its copy and
            # write-back threads: a put waited forever on a copy no thread would run
            raise StoreClosedError(
                f"this store was opened in process {self.pid}, before a fork; it cannot be "
                f"used in this process ({os.getpid()}): open a store here with open_store() "
                "after the fork (processes share a store directory safely), or use "
                "multiprocessing's 'spawn' or 'forkserver' start method"
            )

    def keys(self, keys: Sequence[bytes]) -> list[BlockKey]:
        """``keys`` checked: 32-byte keys, not of another namespace."""
        if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
            raise TypeError("keys must be a list of block keys from block_keys()")
        if isinstance(keys, KeyChain) and keys.namespace_id not in (None, self.namespace_id):
            raise NamespaceMismatchError(
                "these keys were computed for another namespace (model, revision, layout, "
                "tensor-parallel shard or store); compute them with this store's block_keys()"
            )
        ks = list(keys)
        if all_keys(ks):  # the common case, checked in one C loop
            return ks  # type: ignore[return-value]
        return [check_key(k) for k in ks]

    @staticmethod
    def chain_parent(keys: Sequence[bytes]) -> BlockKey | None:
        return keys.parent if isinstance(keys, KeyChain) else None
