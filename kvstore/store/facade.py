"""``Store`` and ``open_store``: the embedded store's public API, delegating each job to the
module named for it (residency, fetch, put, paged, write_back, zero_copy) over one
:class:`~kvstore.store.state.StoreState`."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from kvstore.api import BorrowedBlocks, PinReceipt, PutGrant
from kvstore.errors import ConfigError
from kvstore.index import Catalog
from kvstore.keys import BlockKey, KeyChain
from kvstore.keys import block_keys as _block_keys
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.stats import StoreStats, TierStats
from kvstore.store.config import StoreConfig, capacity, resolve_device
from kvstore.store.fetch import Fetcher
from kvstore.store.opening import open_state
from kvstore.store.paged import PagedIO
from kvstore.store.put import Putter
from kvstore.store.residency import Residency
from kvstore.store.state import DISK, REMOTE
from kvstore.store.write_back import WriteBack
from kvstore.store.zero_copy import ZeroCopyPlane
from kvstore.transfer import Transfer
from kvstore.writer import WriteBehind


class Store:
    """A tiered KV prefix cache for one model namespace. Create with :func:`open_store`.

    Each job lives in the module named for it; this class wires them together and holds the
    small calls: keys, lookup, pins, flush, stats, lifecycle.
    """

    PutGrant = PutGrant

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.namespace = config.namespace
        self.layout: KVLayout = config.namespace.layout
        self.namespace_id: bytes = config.namespace.id
        self.device = config.device
        self.state = st = open_state(config)
        self.residency = Residency(st)
        self.fetcher = Fetcher(st, self.residency)
        self.putter = Putter(st, self.residency)
        self.paged = PagedIO(st, self.fetcher, self.putter)
        self.write_back = WriteBack(st, self.residency)
        self.zero_copy = ZeroCopyPlane(st, self.residency, self.fetcher)
        if st.disk is not None or st.remote is not None:
            st.writer = WriteBehind(self.write_back.write_pass, name="kvstore-writer")

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush and release every tier. Idempotent; any later call raises StoreClosedError."""
        st = self.state
        with st.lock:
            if st.closed or st.closing:
                return
            st.closing = True  # new calls now fail; what is queued still completes
        if st.engine is not None:
            st.engine.close()  # queued copies complete first
        if st.writer is not None:
            st.writer.close()  # drains what is dirty: close() implies flush()
        with st.lock:
            if st.closed:
                return
            st.closed = True
            if st.disk is not None:
                st.disk.close()
            if st.remote is not None:
                st.remote.close()
            if st.warm is not None:
                st.warm.slab.close()
            st.hot = st.warm = None
            st.disk = st.remote = None
            st.catalog = Catalog()

    @property
    def warm_free_slots(self) -> int:
        """Free slots of the warm tier (0 without one): for leak accounting."""
        with self.state.lock:
            warm = self.state.warm
            return 0 if warm is None else warm.slab.allocator.free_count

    @property
    def closed(self) -> bool:
        return self.state.closed

    # -- keys and lookup ----------------------------------------------------------------
    def block_keys(self, token_ids: object, salt: str | bytes | None = None, *,
                   extras: Sequence[bytes | None] | None = None) -> KeyChain:
        """Keys of every full block of ``token_ids`` (``list`` of 32-byte ``bytes``)."""
        self.state.check_open()
        return _block_keys(self.namespace_id, token_ids, self.layout.block_tokens, salt=salt,
                           extras=extras)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` held by any tier (a miss is 0, not an exception)."""
        return self.residency.lookup(self.state.keys(keys))

    # -- data -----------------------------------------------------------------------------
    def fetch(self, keys: Sequence[bytes], *,
              out: torch.Tensor | None = None) -> Transfer[torch.Tensor]:
        """Copy the leading held blocks of ``keys`` to the store's device (or into ``out``).

        The result ``[n, L, P, T, H, D]`` has ``n <= len(keys)`` blocks: the run stops at the
        first miss or damaged block (damage is counted, never raised). Blocks read from disk
        land in the warm tier; blocks served from a lower tier are promoted into hot.
        """
        return self.fetcher.fetch(keys, out=out)

    def prefetch(self, keys: Sequence[bytes]) -> Transfer[int]:
        """Read the leading held blocks of ``keys`` from disk into the warm tier ahead of
        need; yields the number of leading blocks now held in memory."""
        return self.fetcher.prefetch(keys)

    def put(self, keys: Sequence[bytes], kv: torch.Tensor) -> Transfer[int]:
        """Store ``kv`` (``[len(keys), L, P, T, H, D]``) under ``keys``; held keys are skipped.

        Validation is synchronous (raises before anything is queued); the copy completes
        through the returned :class:`Transfer`, whose result is the number of blocks stored.
        ``kv`` must not be modified until the transfer is done.
        """
        return self.putter.put(keys, kv)

    def load_into(self, keys: Sequence[bytes], pages: Sequence[object], block_ids: object, *,
                  page_size: int | None = None) -> Transfer[int]:
        """Scatter the leading held blocks of ``keys`` into an engine's paged KV cache
        (see :meth:`kvstore.store.paged.PagedIO.load_into`)."""
        return self.paged.load_into(keys, pages, block_ids, page_size=page_size)

    def save_from(self, pages: Sequence[object], block_ids: object, keys: Sequence[bytes], *,
                  page_size: int | None = None) -> Transfer[int]:
        """Gather the blocks for ``keys`` out of an engine's paged KV cache and ``put`` them."""
        return self.paged.save_from(pages, block_ids, keys, page_size=page_size)

    def evict(self, keys: Sequence[bytes] | None = None, *, tier: str | None = None) -> int:
        """Evict ``keys`` (default: every unpinned block) and return how many left
        (see :meth:`kvstore.store.residency.Residency.evict`)."""
        return self.residency.evict(keys, tier=tier)

    # -- zero copy (kvstore.api.ZeroCopy) -------------------------------------------------
    def borrow_blocks(self, keys: Sequence[bytes]) -> BorrowedBlocks:
        """Pin the leading run of ``keys`` held in memory and return it in place."""
        return self.zero_copy.borrow_blocks(keys)

    def lease_warm(self, keys: Sequence[bytes]) -> tuple[list[BlockKey], list[int]]:
        """Pin the leading held run of ``keys`` in the warm tier; returns it with its slots."""
        return self.zero_copy.lease_warm(keys)

    def release_lease(self, keys: Sequence[bytes]) -> None:
        self.zero_copy.release_lease(keys)

    def grant_put(self, keys: Sequence[bytes]) -> PutGrant:
        """Reserve warm slots for the blocks of ``keys`` not held yet (nothing visible yet)."""
        return self.zero_copy.grant_put(keys)

    def commit_put(self, grant: PutGrant) -> int:
        return self.zero_copy.commit_put(grant)

    def abort_put(self, grant: PutGrant) -> None:
        self.zero_copy.abort_put(grant)

    @property
    def warm_slab(self) -> torch.Tensor | None:
        """The warm tier's ``[slots, block_nbytes]`` bytes (for the daemon's shared memory)."""
        return self.zero_copy.warm_slab

    def lookup_split(self, keys: list[BlockKey]) -> int:
        """:meth:`lookup` of keys already known to be 32-byte ``bytes`` (the daemon)."""
        return self.zero_copy.lookup_split(keys)

    def count_lookups(self, lookups: int, hits: int, misses: int) -> None:
        """Add lookups answered elsewhere (clients probing the daemon's key directory)."""
        self.zero_copy.count_lookups(lookups, hits, misses)

    # -- pins -----------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> PinReceipt:
        """Pin the leading held ``keys`` so they are not evicted; returns a receipt.

        Use as a context manager or call ``receipt.release()`` (or ``store.unpin(keys)``).
        """
        st = self.state
        ks = st.keys(keys)
        with st.lock:
            st.check_open()
            pinned: list[BlockKey] = []
            for k in ks:
                if not self.residency.held(k):
                    break
                st.catalog.pin(k)
                pinned.append(k)
            return PinReceipt(self.unpin, pinned)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop one pin from each of ``keys``; returns how many were pinned."""
        st = self.state
        ks = st.keys(keys)
        with st.lock:
            if st.closed:
                return 0
            return sum(1 for k in ks if st.catalog.unpin(k))

    # -- flush / stats ------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Return once every earlier ``put``/``fetch`` copy has landed and every earlier ``put``
        is durable on disk (where there is a disk tier).

        Blocks that were evicted from memory before the writer reached them are not waited
        for: they are counted in ``stats().dirty_dropped``.
        """
        st = self.state
        st.check_open()
        if st.engine is not None and not st.engine.drain(timeout):
            raise TimeoutError(f"flush did not finish within {timeout} s (copies in flight)")
        if st.writer is not None and not st.writer.flush(timeout):
            raise TimeoutError(f"flush did not finish within {timeout} s")

    def stats(self) -> StoreStats:
        """A frozen snapshot of the counters and the tiers' occupancy."""
        st = self.state
        with st.lock:
            st.check_open()
            c = st.counters
            tiers = [
                TierStats(name=t.name, device=str(t.device), capacity_bytes=t.slab.nbytes,
                          used_bytes=t.used_bytes, blocks=len(t), evictions=t.counters.evictions,
                          demotions_in=t.counters.demotions_in,
                          promotions_in=t.counters.promotions_in)
                for t in (st.hot, st.warm) if t is not None
            ]
            if st.disk is not None:
                d = st.disk.stats()
                tiers.append(TierStats(
                    name=DISK, device=str(self.config.path), capacity_bytes=d.capacity_bytes,
                    used_bytes=d.stored_bytes, blocks=d.blocks, evictions=d.evictions))
            if st.remote is not None:
                r = st.remote.stats()
                tiers.append(TierStats(
                    name=REMOTE, device=st.remote.url, capacity_bytes=0,
                    used_bytes=r.stored_bytes_written, blocks=r.blocks_written, evictions=0))
            return StoreStats(
                lookups=c.lookups, hits=c.hits, misses=c.misses, fetches=c.fetches,
                fetched_blocks=c.fetched_blocks, fetch_short=c.fetch_short, puts=c.puts,
                put_blocks=c.put_blocks, put_duplicates=c.put_duplicates,
                put_dropped=c.put_dropped, damaged=c.damaged, dirty_dropped=c.dirty_dropped,
                disk_write_dropped=c.disk_write_dropped,
                pinned_blocks=st.catalog.pinned_count, blocks=len(st.catalog),
                dirty_blocks=st.catalog.dirty_count,
                block_nbytes=self.layout.block_nbytes, tiers=tuple(tiers),
            )


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
    dev = resolve_device(device)
    ns = Namespace.create(model_id, layout, model_revision=model_revision, tp_rank=tp_rank,
                          tp_size=tp_size, extras=namespace_extras)
    if gpu_capacity is None:
        gpu_capacity = "1GiB" if dev.type == "cuda" else 0
    bn = layout.block_nbytes
    config = StoreConfig(
        path=Path(os.fspath(path)).expanduser() if path is not None else None,
        namespace=ns,
        device=dev,
        gpu_capacity=capacity(gpu_capacity, "gpu_capacity", bn),
        cpu_capacity=capacity(cpu_capacity, "cpu_capacity", bn),
        disk_capacity=capacity(disk_capacity, "disk_capacity", bn),
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
