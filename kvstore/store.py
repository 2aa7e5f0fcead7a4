"""The embedded store: state, keys, lookup, pins, flush, stats and ``open_store``.

Locking: one lock guards the catalog, the tiers' maps and the counters. Copies run on the
copy engine, outside it; the blocks being copied are pinned, so they cannot be evicted
mid-copy. The operations (fetch, put, eviction, paged I/O, disk writes, the shared-memory
data plane) are mixins in :mod:`kvstore.storeops`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, takewhile
from pathlib import Path

import torch

from kvstore.api import PinReceipt, PutGrant
from kvstore.copy_engine import CopyEngine
from kvstore.errors import (
    ConfigError,
    NamespaceMismatchError,
    SizeError,
    StoreClosedError,
)
from kvstore.index import Catalog
from kvstore.keys import BlockKey, KeyChain, all_keys, check_key
from kvstore.keys import block_keys as _block_keys
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.sizes import parse_size
from kvstore.stats import Counters, StoreStats, TierStats
from kvstore.storeops import DISK, HOT, REMOTE, WARM
from kvstore.storeops.borrow import BorrowOps
from kvstore.storeops.disk_writes import DiskWriteOps
from kvstore.storeops.fetch import FetchOps, FetchPlan
from kvstore.storeops.paged import PagedOps
from kvstore.storeops.put import OverflowJob, PutOps
from kvstore.storeops.room import RoomOps
from kvstore.storeops.shared import SharedMemoryOps
from kvstore.tiers.memory import MemoryTier
from kvstore.transfer import Transfer
from kvstore.writer import WriteBehind

__all__ = ["DISK", "HOT", "WARM", "FetchPlan", "PinReceipt", "PutGrant", "Store", "StoreConfig",
           "open_store"]
log = logging.getLogger("kvstore.store")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Everything :func:`open_store` resolved from its arguments."""

    path: Path | None
    namespace: Namespace
    device: torch.device
    gpu_capacity: int
    cpu_capacity: int
    disk_capacity: int
    admission: str
    pin_memory: bool
    disk_codec: str = "none"
    warm_shared_memory: str | None = None  # file (e.g. under /dev/shm) backing the warm slab
    remote: str | None = None  # redis://, rediss:// or redis+cluster:// URL of the remote tier
    remote_codec: str = "zstd"
    remote_budget_s: float = 0.05
    remote_ttl_s: float | None = None


def _run_in(held: dict, ks: list[BlockKey], start: int) -> int:
    """How many of ``ks[start:]`` in a row are keys of ``held``."""
    if not held or start >= len(ks):
        return 0
    return len(list(takewhile(held.__contains__, islice(ks, start, None))))


class Store(FetchOps, BorrowOps, PutOps, SharedMemoryOps, RoomOps, PagedOps, DiskWriteOps):
    """A tiered KV prefix cache for one model namespace. Create with :func:`open_store`.

    The operations live in :mod:`kvstore.storeops` (one module per job); this class holds the
    state they share and the small calls: keys, lookup, pins, flush, stats, lifecycle.
    """

    PutGrant = PutGrant

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.namespace = config.namespace
        self.layout: KVLayout = config.namespace.layout
        self.namespace_id: bytes = config.namespace.id
        self.device = config.device
        self._lock = threading.RLock()
        self._closed = False
        self._closing = False
        self._catalog = Catalog()
        self._counters = Counters()
        self._hot: MemoryTier | None = None
        self._warm: MemoryTier | None = None
        if config.gpu_capacity:
            self._hot = MemoryTier(HOT, self.layout, config.gpu_capacity, config.device)
        if config.cpu_capacity:
            self._warm = MemoryTier(
                WARM, self.layout, config.cpu_capacity, torch.device("cpu"),
                pin_memory=config.pin_memory, shared_path=config.warm_shared_memory,
            )
        if self._hot is None and self._warm is None:
            raise ConfigError(
                "gpu_capacity and cpu_capacity are both 0: give at least one memory tier room"
            )
        self._disk = None
        self._remote = None
        self._skip_remote: set[BlockKey] = set()  # dirty blocks that came from the remote tier
        self._writer: WriteBehind | None = None
        self._overflow: deque[OverflowJob] = deque()
        self._overflow_bytes = 0
        self._pending: dict[BlockKey, Transfer[int]] = {}  # keys whose put copy is in flight
        self._granted: set[BlockKey] = set()  # keys of granted puts not yet committed
        self._engine: CopyEngine | None = CopyEngine(config.device)
        if config.path is not None and config.disk_capacity:
            if self._warm is None:
                raise ConfigError(
                    "a disk tier stages reads and writes in the warm tier: set cpu_capacity > 0 "
                    "or disk_capacity=0"
                )
            from kvstore.tiers.disk import DiskTier

            self._disk = DiskTier(
                config.path, capacity_bytes=config.disk_capacity, codec=config.disk_codec
            )
            try:
                self._disk.register_namespace(self.namespace)
            except BaseException:
                self._disk.close()
                raise
        if config.remote is not None:
            if self._warm is None:
                raise ConfigError("a remote tier stages blocks in the warm tier: set cpu_capacity > 0")
            from kvstore.tiers.remote import RemoteConfig, RemoteTier

            itemsize = self.layout.itemsize
            self._remote = RemoteTier(
                RemoteConfig(config.remote, codec=config.remote_codec, ttl_s=config.remote_ttl_s,
                             budget_s=config.remote_budget_s,
                             # one key space per namespace: no tenant can shadow or delete
                             # another's blocks, whatever keys it sends
                             key_prefix=f"kvstore:{self.namespace_id.hex()}:"),
                itemsize_for=lambda _ns: itemsize,
            )
        if self._disk is not None or self._remote is not None:
            self._writer = WriteBehind(self._write_pass, name="kvstore-writer")

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush and release every tier. Idempotent; any later call raises StoreClosedError."""
        with self._lock:
            if self._closed or self._closing:
                return
            self._closing = True  # new calls now fail; what is queued still completes
        if self._engine is not None:
            self._engine.close()  # queued copies complete first
        if self._writer is not None:
            self._writer.close()  # drains what is dirty: close() implies flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._disk is not None:
                self._disk.close()
            if self._remote is not None:
                self._remote.close()
            if self._warm is not None:
                self._warm.slab.close()
            self._hot = self._warm = None
            self._disk = self._remote = None
            self._catalog = Catalog()

    @property
    def warm_free_slots(self) -> int:
        """Free slots of the warm tier (0 without one): for leak accounting."""
        with self._lock:
            return 0 if self._warm is None else self._warm.slab.allocator.free_count

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise StoreClosedError("the store is closed; open a new one with open_store()")

    # -- keys -----------------------------------------------------------------------------
    def block_keys(
        self,
        token_ids: object,
        salt: str | bytes | None = None,
        *,
        extras: Sequence[bytes | None] | None = None,
    ) -> KeyChain:
        """Keys of every full block of ``token_ids`` (``list`` of 32-byte ``bytes``)."""
        self._check_open()
        return _block_keys(
            self.namespace_id, token_ids, self.layout.block_tokens, salt=salt, extras=extras
        )

    def _keys(self, keys: Sequence[bytes]) -> list[BlockKey]:
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
    def _chain_parent(keys: Sequence[bytes]) -> BlockKey | None:
        return keys.parent if isinstance(keys, KeyChain) else None

    def _held(self, key: BlockKey) -> bool:
        """Held by a memory tier."""
        return (self._hot is not None and key in self._hot) or (
            self._warm is not None and key in self._warm
        )

    def _leading_run(self, ks: list[BlockKey], remote_at: list[int] | None = None,
                     located: dict[int, bytes] | None = None) -> int:
        """Leading ``ks`` held by memory, disk or the remote tier, consulted in that order one
        stretch at a time (each lower tier answers a whole stretch in one call).

        Positions only the remote tier holds are appended to ``remote_at``; the disk's index
        records of the positions it holds go into ``located`` (a fetch reads with them).
        """
        i, n = 0, len(ks)
        hot = self._hot._slots if self._hot is not None else {}
        warm = self._warm._slots if self._warm is not None else {}
        while i < n:
            # the hot loop of every lookup: stretches of dict probes run by C-level iterators
            m = 0
            while True:  # a chain may alternate between the memory tiers
                m += _run_in(warm, ks, i + m)
                in_hot = _run_in(hot, ks, i + m)
                if not in_hot:
                    break
                m += in_hot
            if m:
                i += m
                continue
            m = 0
            if self._disk is not None:
                recs = self._disk.locate(ks[i:], self.namespace_id)
                m = len(recs)
                if located is not None:
                    located.update(zip(range(i, i + m), recs, strict=True))
            if m == 0 and self._remote is not None:
                j = i
                while j < n and not self._held(ks[j]):
                    j += 1  # ask the remote tier only for the stretch memory lacks
                m = self._remote.leading_run(ks[i:j])
                if remote_at is not None:
                    remote_at.extend(range(i, i + m))
            if m == 0:
                break
            i += m
        return i

    def _touch_chain(self, keys: list[BlockKey]) -> None:
        # leaf first, root last: roots are the newest, so LRU meets leaves first
        rev = keys[::-1]
        for tier in (self._hot, self._warm):
            if tier is not None:
                tier.touch(rev)

    # -- lookup ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` held by any tier (a miss is 0, not an exception)."""
        return self._lookup(self._keys(keys))

    def _lookup(self, ks: list[BlockKey]) -> int:
        with self._lock:
            self._check_open()
            n = self._leading_run(ks)
            c = self._counters
            c.lookups += 1
            c.hits += n
            c.misses += len(ks) - n
            return n

    # -- pins -----------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> PinReceipt:
        """Pin the leading held ``keys`` so they are not evicted; returns a receipt.

        Use as a context manager or call ``receipt.release()`` (or ``store.unpin(keys)``).
        """
        ks = self._keys(keys)
        with self._lock:
            self._check_open()
            pinned: list[BlockKey] = []
            for k in ks:
                if not self._held(k):
                    break
                self._catalog.pin(k)
                pinned.append(k)
            return PinReceipt(self.unpin, pinned)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop one pin from each of ``keys``; returns how many were pinned."""
        ks = self._keys(keys)
        with self._lock:
            if self._closed:
                return 0
            return sum(1 for k in ks if self._catalog.unpin(k))

    # -- flush / stats ------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Return once every earlier ``put``/``fetch`` copy has landed and every earlier ``put``
        is durable on disk (where there is a disk tier).

        Blocks that were evicted from memory before the writer reached them are not waited
        for: they are counted in ``stats().dirty_dropped``.
        """
        self._check_open()
        if self._engine is not None and not self._engine.drain(timeout):
            raise TimeoutError(f"flush did not finish within {timeout} s (copies in flight)")
        if self._writer is not None and not self._writer.flush(timeout):
            raise TimeoutError(f"flush did not finish within {timeout} s")

    def stats(self) -> StoreStats:
        """A frozen snapshot of the counters and the tiers' occupancy."""
        with self._lock:
            self._check_open()
            c = self._counters
            tiers = [
                TierStats(
                    name=t.name,
                    device=str(t.device),
                    capacity_bytes=t.slab.nbytes,
                    used_bytes=t.used_bytes,
                    blocks=len(t),
                    evictions=t.counters.evictions,
                    demotions_in=t.counters.demotions_in,
                    promotions_in=t.counters.promotions_in,
                )
                for t in (self._hot, self._warm)
                if t is not None
            ]
            if self._disk is not None:
                d = self._disk.stats()
                tiers.append(TierStats(
                    name=DISK, device=str(self.config.path), capacity_bytes=d.capacity_bytes,
                    used_bytes=d.stored_bytes, blocks=d.blocks, evictions=d.evictions,
                ))
            if self._remote is not None:
                r = self._remote.stats()
                tiers.append(TierStats(
                    name=REMOTE, device=self._remote._url, capacity_bytes=0,
                    used_bytes=r.stored_bytes_written, blocks=r.blocks_written, evictions=0,
                ))
            return StoreStats(
                lookups=c.lookups, hits=c.hits, misses=c.misses, fetches=c.fetches,
                fetched_blocks=c.fetched_blocks, fetch_short=c.fetch_short, puts=c.puts,
                put_blocks=c.put_blocks, put_duplicates=c.put_duplicates,
                put_dropped=c.put_dropped, damaged=c.damaged, dirty_dropped=c.dirty_dropped,
                disk_write_dropped=c.disk_write_dropped,
                pinned_blocks=self._catalog.pinned_count, blocks=len(self._catalog),
                dirty_blocks=self._catalog.dirty_count,
                block_nbytes=self.layout.block_nbytes, tiers=tuple(tiers),
            )


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a torch device ('cpu', 'cuda:0', ...)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"device={device!r}: the hot tier runs on 'cpu' or 'cuda:N'")
    return dev


def _capacity(value: int | str, what: str, block_nbytes: int) -> int:
    n = parse_size(value, what=what)
    if 0 < n < block_nbytes:
        raise SizeError(
            f"{what}={value!r} is smaller than one block ({block_nbytes} B for this layout); "
            "raise it, or pass 0 to disable the tier"
        )
    return n


def open_store(
    path: str | os.PathLike[str] | None = None,
    *,
    layout: KVLayout,
    model_id: str,
    model_revision: str | None = None,
    device: str | torch.device | None = None,
    gpu_capacity: int | str | None = None,
    cpu_capacity: int | str = "4GiB",
    disk_capacity: int | str = "64GiB",
    tp_rank: int = 0,
    tp_size: int = 1,
    namespace_extras: Mapping[str, object] | None = None,
    admission: str = "always",
    disk_codec: str = "none",
    warm_shared_memory: str | None = None,
    remote: str | None = None,
    remote_budget_s: float = 0.05,
    remote_ttl_s: float | None = None,
    remote_codec: str = "zstd",
) -> Store:
    """Open (or create) a store. Sizes are ints or strings like ``"4GiB"``.

    ``gpu_capacity`` defaults to 1GiB on a CUDA device and 0 on ``cpu`` (pass a size to run
    the hot tier on the CPU, as the tests do). ``path=None`` keeps everything in memory.
    ``warm_shared_memory`` puts the warm slab in a file (under ``/dev/shm``) that other
    processes can map — the sidecar daemon's data plane. ``remote`` adds a shared tier below
    disk on Redis (``redis://host:port``, ``rediss://`` for TLS, ``redis+cluster://host:port``);
    a lookup or read there never costs more than ``remote_budget_s`` (a slow or absent Redis
    is a miss), values expire after ``remote_ttl_s`` when set. See docs/scale-out.md.
    """
    if not isinstance(layout, KVLayout):
        raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if remote is not None and not isinstance(remote, str):
        raise ConfigError("remote must be a URL string like 'redis://host:6379'")
    if remote_codec not in ("none", "zstd"):
        raise ConfigError(f"remote_codec must be 'none' or 'zstd', got {remote_codec!r}")
    if disk_codec not in ("none", "zstd"):
        raise ConfigError(f"disk_codec must be 'none' or 'zstd', got {disk_codec!r}")
    if admission not in ("always", "second-hit"):
        raise ConfigError(f"admission must be 'always' or 'second-hit', got {admission!r}")
    dev = _resolve_device(device)
    ns = Namespace.create(
        model_id, layout, model_revision=model_revision, tp_rank=tp_rank, tp_size=tp_size,
        extras=namespace_extras,
    )
    if gpu_capacity is None:
        gpu_capacity = "1GiB" if dev.type == "cuda" else 0
    bn = layout.block_nbytes
    config = StoreConfig(
        path=Path(os.fspath(path)).expanduser() if path is not None else None,
        namespace=ns,
        device=dev,
        gpu_capacity=_capacity(gpu_capacity, "gpu_capacity", bn),
        cpu_capacity=_capacity(cpu_capacity, "cpu_capacity", bn),
        disk_capacity=_capacity(disk_capacity, "disk_capacity", bn),
        admission=admission,
        pin_memory=torch.cuda.is_available() and dev.type == "cuda",
        disk_codec=disk_codec,
        warm_shared_memory=warm_shared_memory,
        remote=remote,
        remote_codec=remote_codec,
        remote_budget_s=float(remote_budget_s),
        remote_ttl_s=remote_ttl_s,
    )
    return Store(config)
