"""The daemon's stores: one embedded ``Store`` per namespace, opened on first use.

Each store runs with ``gpu_capacity=0`` (the daemon owns no GPU; clients copy to their own
devices) and its warm tier in a ``0600`` file of the daemon's private shared-memory
directory, which clients map. A namespace stays open after its last client leaves (the
cache outlives engines); when ``max_namespaces`` are open, the least recently used idle one
is flushed and closed to make room (its blocks stay on disk).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.daemon.config import DaemonConfig
from kvstore.errors import KVStoreError
from kvstore.namespace import Namespace
from kvstore.stats import StoreStats
from kvstore.store import Store, open_store
from kvstore.wire.messages import BadRequest, ErrorCode

log = logging.getLogger("kvstore.daemon")

RunBlocking = Callable[..., Awaitable]


@dataclass(eq=False, slots=True)
class NamespaceEntry:
    namespace: Namespace
    store: Store
    shm_path: Path
    slots: int
    memory_only: bool  # no disk tier: store calls never block on I/O
    connections: set = field(default_factory=set)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return self.namespace.id.hex()[:16]


def free_warm_slots(store: Store) -> int:
    """Warm slots neither holding a block nor granted to a put."""
    return store.warm_free_slots


def _reserve(path: Path, nbytes: int) -> None:
    """Allocate the slab file's pages now: a tmpfs that runs out of room later would kill
    whoever touches the missing page (SIGBUS), daemon or client; here it is an error."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise BadRequest(
            f"no room for a {nbytes}-byte warm tier in {path.parent.parent} ({e.strerror}); "
            "lower --cpu-capacity or grow /dev/shm", ErrorCode.CONFIG) from None
    finally:
        os.close(fd)


def _remove_from_disk(path: Path, namespace_id: bytes, keys: list[bytes] | None) -> int:
    """The namespace's disk records of ``keys`` (or all) in the store at ``path``, for a
    namespace the daemon has not open (nothing in its memory) or a daemon without a disk tier
    of its own (embedded writers may share the path). Only records of that namespace go,
    whatever keys are named."""
    from kvstore.admin.common import StoreNotFoundError, open_disk

    try:
        with open_disk(path, readonly=False) as disk:
            doomed = [r.key for r in disk.records(namespace_id)] if keys is None else keys
            return len(disk.delete_owned(doomed, namespace_id)) if doomed else 0
    except StoreNotFoundError:
        return 0  # nothing was ever written there


class NamespaceRegistry:
    def __init__(self, config: DaemonConfig, shm_dir: Path, run_blocking: RunBlocking) -> None:
        self._config = config
        self._shm_dir = shm_dir
        self._run = run_blocking
        self._entries: dict[bytes, NamespaceEntry] = {}
        self._lock = asyncio.Lock()
        self._close_failed = False

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[NamespaceEntry]:
        return list(self._entries.values())

    def snapshot(self) -> list[tuple[str, str, StoreStats]]:
        """Stats of every open store (thread-safe; for the metrics collector)."""
        out = []
        for e in list(self._entries.values()):
            try:
                out.append((e.label, e.namespace.model_id, e.store.stats()))
            except KVStoreError:
                continue  # closing
        return out

    async def acquire(self, ns: Namespace, warm_capacity: int | None, conn: object) -> NamespaceEntry:
        async with self._lock:
            entry = self._entries.get(ns.id)
            if entry is None:
                if len(self._entries) >= self._config.limits.max_namespaces:
                    await self._close_idle()
                entry = await self._open(ns, warm_capacity)
                self._entries[ns.id] = entry
            entry.connections.add(conn)
            entry.last_used = time.monotonic()
            return entry

    async def remove(self, namespace_id: bytes, keys: list[bytes] | None) -> int:
        """Delete a namespace's blocks (``keys``, or all) from its store's memory and from
        disk; blocks pinned by a client right now stay. Holds the registry lock, so the
        namespace is neither opened nor closed (flushing its dirty blocks back to disk)
        meanwhile."""
        async with self._lock:
            entry = self._entries.get(namespace_id)
            if entry is not None:
                store = entry.store

                def _remove() -> int:
                    # blocks the disk writer is writing right now are pinned, and an evict
                    # skips them (then they land on disk after it): let it finish first
                    store.flush()
                    # a plain key list: the store's own namespace check decides what is its own
                    n = store.evict(keys, tier=None)
                    if entry.memory_only:  # embedded writers may have blocks on that disk
                        n += _remove_from_disk(self._config.path, namespace_id, keys)
                    return n

                return await self._run(_remove)
            return await self._run(_remove_from_disk, self._config.path, namespace_id, keys)

    async def release(self, entry: NamespaceEntry, conn: object) -> None:
        entry.connections.discard(conn)
        entry.last_used = time.monotonic()

    async def _open(self, ns: Namespace, warm_capacity: int | None) -> NamespaceEntry:
        cfg = self._config
        bn = ns.layout.block_nbytes
        cap = cfg.cpu_capacity if not warm_capacity else min(warm_capacity, cfg.cpu_capacity)
        if cap < bn:
            raise BadRequest(
                f"a block of this layout is {bn} bytes but the namespace's warm tier would be "
                f"{cap} bytes (the daemon's --cpu-capacity is {cfg.cpu_capacity}); raise it",
                ErrorCode.CONFIG,
            )
        shm = self._shm_dir / f"ns-{ns.id.hex()[:32]}.slab"

        def _open_store() -> Store:
            store = open_store(
                cfg.path, layout=ns.layout, model_id=ns.model_id,
                model_revision=ns.model_revision or None, device="cpu", gpu_capacity=0,
                cpu_capacity=cap - cap % bn, disk_capacity=cfg.disk_capacity,
                tp_rank=ns.tp_rank, tp_size=ns.tp_size, namespace_extras=dict(ns.extras),
                admission=cfg.admission, disk_codec=cfg.disk_codec,
                warm_shared_memory=str(shm),
            )
            try:
                _reserve(shm, cap - cap % bn)
            except BaseException:
                store.close()
                raise
            return store

        try:
            store = await self._run(_open_store)
        except BadRequest:
            raise
        except (KVStoreError, OSError) as e:
            raise BadRequest(f"cannot open a store for this namespace: {e}", ErrorCode.CONFIG) from None
        if store.namespace_id != ns.id:  # pragma: no cover - a namespace derivation bug
            await self._run(store.close)
            raise BadRequest("namespace derivation mismatch", ErrorCode.INTERNAL)
        slab = store.warm_slab
        assert slab is not None
        memory_only = not (cfg.disk_capacity and cfg.path is not None)
        log.info("opened namespace %s (model %s): %d warm slots of %d B, shm %s",
                 ns.id.hex()[:16], ns.model_id, slab.shape[0], bn, shm)
        return NamespaceEntry(ns, store, shm, int(slab.shape[0]), memory_only)

    async def _close_idle(self) -> None:
        idle = sorted((e for e in self._entries.values() if not e.connections),
                      key=lambda e: e.last_used)
        if not idle:
            raise BadRequest(
                f"the daemon already serves {len(self._entries)} namespaces, each with clients "
                "(--max-namespaces); try again later or raise the limit", ErrorCode.LIMIT)
        victim = idle[0]
        del self._entries[victim.namespace.id]
        log.info("closing idle namespace %s to make room", victim.label)
        try:
            await self._run(victim.store.close)
        except BaseException:
            self._close_failed = True  # its dirty blocks may not have reached disk
            raise

    async def close_all(self) -> bool:
        """Flush and close every store; False if one failed (now or earlier, for room)."""
        async with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        ok = not self._close_failed
        for e in entries:
            try:
                await self._run(e.store.close)  # flushes what is dirty to disk
            except Exception:
                ok = False
                log.exception("closing namespace %s failed", e.label)
        return ok
