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
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.events import report_evicted
from kvstore.errors import KVStoreError
from kvstore.layout import dtype_name
from kvstore.namespace import Namespace
from kvstore.sizes import format_size
from kvstore.stats import StoreStats
from kvstore.store import Store, open_store
from kvstore.tiers.disk import NamespaceInfo
from kvstore.wire.errors import BadRequest, ErrorCode

if TYPE_CHECKING:
    from kvstore.daemon.events import DaemonEvents
    from kvstore.events.publisher import NamespaceSink

log = logging.getLogger("kvstore.daemon")

RunBlocking = Callable[..., Awaitable]
#: namespaces the registry remembers having opened (for the "new namespace" note)
_SEEN_MAX = 4096
#: how long the store's namespace list is reused for the "new namespace" note (a namespace
#: another process stored meanwhile is named as new at most this late: an INFO line)
_STORED_TTL_S = 60.0


@dataclass(eq=False, slots=True)
class NamespaceEntry:
    namespace: Namespace
    store: Store
    shm_path: Path
    slots: int
    memory_only: bool  # no disk tier: store calls never block on I/O
    connections: set = field(default_factory=set)
    last_used: float = field(default_factory=time.monotonic)
    events: NamespaceSink | None = None  # where its tier changes are reported (--kv-events)
    #: said to the first clients when nothing was stored under the namespace before this
    #: daemon opened it (their model id may have a typo): its fields, and near namespaces
    new_note: str = ""

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
            f"no room for a {format_size(nbytes)} warm tier in {path.parent.parent} "
            f"({e.strerror}); "
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


def _describe(ns: Namespace) -> str:
    lay = ns.layout
    L, P, T, H, D = lay.block_shape
    extras = f", extras {dict(ns.extras)}" if ns.extras else ""
    return (f"model_id {ns.model_id!r}, revision {ns.model_revision or '-'!r}, dtype "
            f"{dtype_name(lay.dtype)}, layout L{L} P{P} T{T} H{H} D{D}, tp "
            f"{ns.tp_rank}/{ns.tp_size}{extras}")


def _differences(ns: Namespace, info) -> list[str]:
    """Which fields of ``ns`` differ from a stored namespace's (``NamespaceInfo``)."""
    lay = ns.layout
    pairs = (("model_id", ns.model_id, info.model_id),
             ("revision", ns.model_revision, info.model_revision),
             ("dtype", dtype_name(lay.dtype), info.dtype),
             ("layout", lay.block_shape, info.block_shape),
             ("tp", (ns.tp_rank, ns.tp_size), (info.tp_rank, info.tp_size)),
             ("extras/salt", tuple(ns.extras), tuple(info.extras)))
    return [f"{name} {theirs!r}" for name, ours, theirs in pairs if ours != theirs]


def _stored_namespaces(cfg: DaemonConfig) -> list:
    """The namespaces the store at ``cfg.path`` has records of ([] when it has no index)."""
    if not (cfg.path / "index" / "data.mdb").exists():
        return []
    from kvstore.tiers.disk import DiskTier

    try:
        tier = DiskTier(cfg.path, capacity_bytes=0, readonly=True)
        try:
            return tier.namespaces()
        finally:
            tier.close()
    except (KVStoreError, OSError):
        return []  # the store's own open reports what is wrong


class NamespaceRegistry:
    def __init__(self, config: DaemonConfig, shm_dir: Path, run_blocking: RunBlocking,
                 events: DaemonEvents | None = None) -> None:
        self._config = config
        self._events = events
        self._shm_dir = shm_dir
        self._run = run_blocking
        self._entries: dict[bytes, NamespaceEntry] = {}
        self._lock = asyncio.Lock()
        self._close_failed = False
        # namespaces opened by this daemon (the latest _SEEN_MAX: namespaces come and go)
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._stored_cache: tuple[float, list] | None = None  # (when read, namespaces)

    def _new_namespace_note(self, ns: Namespace) -> str | None:
        """An INFO line when ``ns`` is new to the store (nothing was ever stored under it),
        naming its fields and any namespace of the store that differs in one field only: a
        client's typo'd model id otherwise silently gets an empty cache."""
        if ns.id in self._seen:
            return None
        known = self._stored() if self._config.disk_capacity else []
        if any(i.namespace_id == ns.id for i in known):
            return None
        near = [f"{i.namespace_id.hex()[:16]} ({', '.join(d)})" for i in known
                if len(d := _differences(ns, i)) == 1]
        return (f"new namespace {ns.id.hex()[:16]}: {_describe(ns)}; nothing is stored under "
                "it yet" + (f"; the store has namespace(s) differing in one field only: "
                            f"{'; '.join(near[:4])}" if near else ""))

    def _stored(self) -> list:
        """The store's namespaces, read at most every :data:`_STORED_TTL_S` seconds: reading
        them costs time in their number (~0.1 ms each), and a daemon whose namespaces churn
        (tenants, adapters) would pay it on every new one (60 ms each at 600)."""
        now = time.monotonic()
        if self._stored_cache is None or now - self._stored_cache[0] > _STORED_TTL_S:
            self._stored_cache = (now, _stored_namespaces(self._config))
        return self._stored_cache[1]

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
                    # evict wins over the writer's writes in flight (no flush first: on a
                    # full disk that raises, and an rm must still work there)
                    # a plain key list: the store's own namespace check decides what is its own
                    n = store.evict(keys, tier=None)
                    if entry.memory_only:  # embedded writers may have blocks on that disk
                        n += _remove_from_disk(self._config.path, namespace_id, keys)
                    return n

                n = await self._run(_remove)
            else:
                n = await self._run(_remove_from_disk, self._config.path, namespace_id, keys)
            if self._events is not None:
                report_evicted(self._events.sink_of(namespace_id), keys, None)
            return n

    async def release(self, entry: NamespaceEntry, conn: object) -> None:
        entry.connections.discard(conn)
        entry.last_used = time.monotonic()

    async def _open(self, ns: Namespace, warm_capacity: int | None) -> NamespaceEntry:
        cfg = self._config
        bn = ns.layout.block_nbytes
        cap = cfg.cpu_capacity if not warm_capacity else min(warm_capacity, cfg.cpu_capacity)
        if cap < bn:
            raise BadRequest(
                f"a block of this layout is {format_size(bn)} but the namespace's warm tier "
                f"would be {format_size(cap)} (the daemon's --cpu-capacity is "
                f"{format_size(cfg.cpu_capacity)}); raise it",
                ErrorCode.CONFIG,
            )
        shm = self._shm_dir / f"ns-{ns.id.hex()[:32]}.slab"

        notes: list[str] = []
        sink = self._events.sink(ns) if self._events is not None else None

        def _open_store() -> Store:
            note = self._new_namespace_note(ns)
            if note is not None:
                log.info("%s", note)
                notes.append(note)
            store = open_store(
                cfg.path, layout=ns.layout, model_id=ns.model_id,
                model_revision=ns.model_revision or None, device="cpu", gpu_capacity=0,
                cpu_capacity=cap - cap % bn, disk_capacity=cfg.disk_capacity,
                tp_rank=ns.tp_rank, tp_size=ns.tp_size, namespace_extras=dict(ns.extras),
                admission={"warm": cfg.warm_admission, "disk": cfg.admission},
                eviction=cfg.eviction, disk_codec=cfg.disk_codec,
                warm_shared_memory=str(shm), events=sink,  # the store reports its tiers
                group=cfg.group,
            )
            try:
                _reserve(shm, cap - cap % bn)
            except BaseException:
                store.close()
                raise
            return store

        try:
            store = await self._run(_open_store)
        except BaseException as e:
            if sink is not None:  # nothing was opened: its sink is not held
                self._events.release(ns.id)  # type: ignore[union-attr]
            if isinstance(e, (KVStoreError, OSError)) and not isinstance(e, BadRequest):
                raise BadRequest(f"cannot open a store for this namespace: {e}",
                                 ErrorCode.CONFIG) from None
            raise
        if store.namespace_id != ns.id:  # pragma: no cover - a namespace derivation bug
            await self._run(store.close)
            raise BadRequest("namespace derivation mismatch", ErrorCode.INTERNAL)
        slab = store.warm_slab
        assert slab is not None
        memory_only = not (cfg.disk_capacity and cfg.path is not None)
        self._seen[ns.id] = None
        self._seen.move_to_end(ns.id)
        if len(self._seen) > _SEEN_MAX:  # bounded: a forgotten one is looked up on disk again
            self._seen.popitem(last=False)
        if not memory_only and self._stored_cache is not None:  # now stored (its record)
            known = self._stored_cache[1]
            if all(i.namespace_id != ns.id for i in known):
                known.append(NamespaceInfo.of(ns))
        log.info("opened namespace %s (model %s): %d warm slots of %s (%s), shm %s",
                 ns.id.hex()[:16], ns.model_id, slab.shape[0], format_size(bn),
                 format_size(slab.shape[0] * bn), shm)
        return NamespaceEntry(ns, store, shm, int(slab.shape[0]), memory_only, events=sink,
                              new_note=notes[0] if notes else "")

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
        finally:
            if victim.events is not None:
                await self._warm_gone(victim)

    async def _warm_gone(self, entry: NamespaceEntry) -> None:
        """A closed namespace: its warm tier is gone, what it flushed is on disk."""
        assert entry.events is not None and self._events is not None
        if not entry.memory_only:
            try:
                await self._run(self._events.announce_disk, self._config.path, entry.namespace.id)
            except Exception:
                log.exception("announcing namespace %s's disk blocks failed", entry.label)
        entry.events.cleared("warm")
        self._events.release(entry.namespace.id)  # forgotten if it holds nothing now

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
            if e.events is not None:
                e.events.cleared("warm")
        return ok
