"""The embedded store: keys, longest-prefix lookup, fetch, put, pins, eviction, stats.

Locking: one lock guards the catalog, the tiers' maps and the counters. Fetch copies run
outside it; the blocks being copied are pinned, so they cannot be evicted mid-copy.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.copy_engine import CopyEngine, Job, copy_block_runs, layerwise_supported
from kvstore.errors import (
    ConfigError,
    NamespaceMismatchError,
    SizeError,
    StoreClosedError,
    TensorMismatchError,
)
from kvstore.index import Catalog
from kvstore.kernels import gather_pages, scatter_pages
from kvstore.keys import BlockKey, KeyChain, check_key
from kvstore.keys import block_keys as _block_keys
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.paged import page_index, paged_geometry
from kvstore.sizes import parse_size
from kvstore.stats import Counters, StoreStats, TierStats
from kvstore.tiers.memory import MemoryTier
from kvstore.transfer import Transfer
from kvstore.writer import WriteBehind

HOT, WARM, DISK = "hot", "warm", "disk"
log = logging.getLogger("kvstore.store")
#: how much the background writer puts into one segment
_WRITE_BATCH_BYTES = 64 << 20
#: puts that find memory full of not-yet-written blocks may queue this much for disk
_OVERFLOW_BYTES = 256 << 20


@dataclass(slots=True)
class _OverflowJob:
    """Blocks of one put that go from the caller's tensor straight to disk."""

    keys: list[BlockKey]
    parents: list[BlockKey | None]
    kv: torch.Tensor
    positions: list[int]  # rows of kv
    transfer: Transfer[int]
    memory: Transfer[int] | None  # the same put's copy into memory, if any
    base: int  # blocks of the same put stored in memory


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


def _item_runs(items: list[tuple[int, int]]):
    """Coalesce ``(position, row)`` pairs into ``(position, first_row, length)`` runs where
    both positions and rows are consecutive."""
    i, n = 0, len(items)
    while i < n:
        j = i + 1
        while j < n and items[j][0] == items[j - 1][0] + 1 and items[j][1] == items[j - 1][1] + 1:
            j += 1
        yield items[i][0], items[i][1], j - i
        i = j


class PinReceipt:
    """Pins held on some blocks; release with :meth:`release` or by leaving a ``with`` block."""

    __slots__ = ("_store", "keys", "_released")

    def __init__(self, store: Store, keys: list[BlockKey]) -> None:
        self._store = store
        self.keys = keys
        self._released = False

    def __len__(self) -> int:
        return len(self.keys)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store.unpin(self.keys)

    def __enter__(self) -> PinReceipt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Store:
    """A tiered KV prefix cache for one model namespace. Create with :func:`open_store`."""

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
        self._writer: WriteBehind | None = None
        self._overflow: deque[_OverflowJob] = deque()
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
            self._writer = WriteBehind(self._write_pass, name="kvstore-disk-writer")

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
            if self._warm is not None:
                self._warm.slab.close()
            self._hot = self._warm = None
            self._disk = None
            self._catalog = Catalog()

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
        return [check_key(k) for k in keys]

    @staticmethod
    def _chain_parent(keys: Sequence[bytes]) -> BlockKey | None:
        return keys.parent if isinstance(keys, KeyChain) else None

    def _held(self, key: BlockKey) -> bool:
        """Held by a memory tier."""
        return (self._hot is not None and key in self._hot) or (
            self._warm is not None and key in self._warm
        )

    def _leading_run(self, ks: list[BlockKey]) -> int:
        """Leading ``ks`` held by memory or disk (disk consulted one stretch at a time)."""
        i, n = 0, len(ks)
        while i < n:
            if self._held(ks[i]):
                i += 1
                continue
            if self._disk is None:
                break
            m = self._disk.leading_run(ks[i:])
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
        ks = self._keys(keys)
        with self._lock:
            self._check_open()
            n = self._leading_run(ks)
            c = self._counters
            c.lookups += 1
            c.hits += n
            c.misses += len(ks) - n
            return n

    # -- fetch ----------------------------------------------------------------------------
    def fetch(
        self, keys: Sequence[bytes], *, out: torch.Tensor | None = None
    ) -> Transfer[torch.Tensor]:
        """Copy the leading held blocks of ``keys`` to the store's device (or into ``out``).

        The result ``[n, L, P, T, H, D]`` has ``n <= len(keys)`` blocks: the run stops at the
        first miss or damaged block (damage is counted, never raised). Blocks read from disk
        land in the warm tier; blocks served from a lower tier are promoted into hot.
        """
        ks = self._keys(keys)
        if out is not None:
            self._check_out(out, len(ks))
        return self._fetch(ks, self._chain_parent(keys), out, want_result=True)

    def _fetch(
        self, ks: list[BlockKey], parent: BlockKey | None, out: torch.Tensor | None,
        *, want_result: bool,
    ) -> Transfer:
        return self._submit_fetch(ks, parent, out, want_result=want_result)[0]

    def _submit_fetch(
        self, ks: list[BlockKey], parent: BlockKey | None, out: torch.Tensor | None,
        *, want_result: bool,
        then: Callable[[bool, BaseException | None], None] | None = None,
    ) -> tuple[Transfer, Store._FetchPlan, torch.Tensor | None]:
        """Plan under the lock, then queue: disk reads (``disk_read``), copies (``h2d``)."""
        lay = self.layout
        with self._lock:
            self._check_open()
            plan = self._plan_fetch(ks, parent, want_result=want_result)
        n = len(plan.keys)
        result = None
        if want_result:
            try:
                if out is None:
                    out = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device=self.device)
                result = out[:n]
            except BaseException:
                with self._lock:
                    self._finish_fetch(plan, ok=False)
                raise
        t: Transfer = Transfer(lay.num_layers)
        asked = len(ks)
        engine = self._engine
        assert engine is not None

        def settle(ok: bool, error: BaseException | None) -> None:
            with self._lock:
                self._finish_fetch(plan, ok=ok)

        def finish(ok: bool, error: BaseException | None) -> None:
            with self._lock:
                if want_result:
                    c = self._counters
                    c.fetches += 1
                    c.fetched_blocks += plan.valid if ok else 0
                    c.fetch_short += asked - (plan.valid if ok else 0)
            if not ok:
                t.set_error(error or RuntimeError("fetch failed"))
            elif want_result:
                assert result is not None
                t.set_result(result[: plan.valid])
            else:
                t.set_result(plan.valid)
            if then is not None:
                then(ok, error)
            if ok and plan.promote and plan.valid:
                # promotion into hot happens behind the caller's back, off its critical path
                try:
                    engine.submit("h2d", Job(Transfer(), lambda st: self._promote_copy(plan, st), settle))
                    return
                except BaseException:  # noqa: BLE001 - closing: just settle without promoting
                    plan.promote_failed = True
            settle(ok, error)

        def run_copy(stream: torch.cuda.Stream | None) -> list:
            return self._copy_fetch(plan, result, t, stream)

        copy_job = Job(t, run_copy, finish)
        try:
            self._queue_fetch(engine, plan, copy_job, result, finish, want_result)
        except BaseException:
            with self._lock:
                self._finish_fetch(plan, ok=False)
            raise
        return t, plan, result

    def _queue_fetch(self, engine, plan, copy_job, result, finish, want_result) -> None:  # noqa: ANN001
        if plan.disk:
            def run_disk(stream: torch.cuda.Stream | None) -> list:
                self._read_disk(plan, result)
                return []

            def after_disk(ok: bool, error: BaseException | None) -> None:
                if not ok:
                    finish(False, error)
                elif want_result:
                    try:
                        engine.submit("h2d", copy_job)
                    except BaseException as e:  # closing: fail cleanly, release everything
                        finish(False, e)
                else:
                    finish(True, None)

            engine.submit("disk_read", Job(Transfer(), run_disk, after_disk))
        elif want_result:
            engine.submit("h2d", copy_job)
        else:
            finish(True, None)

    def _check_out(self, out: torch.Tensor, n: int) -> None:
        lay = self.layout
        if not isinstance(out, torch.Tensor):
            raise TensorMismatchError("out must be a torch.Tensor [n, L, P, T, H, D]")
        if out.dtype != lay.dtype:
            raise TensorMismatchError(f"out has dtype {out.dtype}; the layout needs {lay.dtype}")
        if out.dim() != 6 or tuple(out.shape[1:]) != lay.block_shape:
            raise TensorMismatchError(
                f"out must have shape [n, {', '.join(map(str, lay.block_shape))}], got "
                f"{list(out.shape)}"
            )
        if out.shape[0] < n:
            raise TensorMismatchError(f"out holds {out.shape[0]} blocks, {n} keys were asked for")
        if not out.is_contiguous():
            raise TensorMismatchError("out must be contiguous")

    @dataclass(slots=True)
    class _FetchPlan:
        keys: list[BlockKey]  # the leading run found at planning time
        parent: BlockKey | None
        hot: list[tuple[int, int]]  # (position, hot slot)
        warm: list[tuple[int, int]]  # (position, warm slot)
        disk: list[tuple[int, int]]  # (position, reserved warm slot or -1) to read from disk
        promote: list[int]  # hot slots reserved for the warm+disk positions, in order
        pinned: list[BlockKey]
        deps: list[tuple[int, Transfer]]  # (position, pending put that writes it)
        valid: int = 0  # leading positions whose bytes are good
        direct: bool = False  # disk blocks were read straight into the result
        staging: torch.Tensor | None = None  # host rows for disk blocks without a warm slot
        promote_failed: bool = False  # the hot copies were not made: release the hot slots

    def _plan_fetch(
        self, ks: list[BlockKey], parent: BlockKey | None, *, want_result: bool
    ) -> Store._FetchPlan:
        hot, warm, cat = self._hot, self._warm, self._catalog
        n = self._leading_run(ks)
        plan = Store._FetchPlan(ks[:n], parent, [], [], [], [], [], [])
        disk_pos: list[int] = []
        for i in range(n):
            k = ks[i]
            if hot is not None and k in hot:
                plan.hot.append((i, hot.slot(k)))
            elif warm is not None and k in warm:
                plan.warm.append((i, warm.slot(k)))
            else:
                disk_pos.append(i)
                continue
            cat.pin(k)
            plan.pinned.append(k)
            pending = self._pending.get(k)
            if pending is not None:
                plan.deps.append((i, pending))
            if self.config.admission == "second-hit" and cat.use(k) >= 2:
                cat.mark_dirty(k)
        self._touch_chain(plan.keys)
        if disk_pos:
            assert warm is not None
            slots = self._reserve(warm, len(disk_pos))
            plan.disk = [(p, slots[j] if j < len(slots) else -1) for j, p in enumerate(disk_pos)]
            if not want_result and len(slots) < len(disk_pos):
                # a prefetch has nowhere else to put blocks: it ends where the room does
                self._truncate(plan, disk_pos[len(slots)])
        if want_result and hot is not None and (plan.warm or plan.disk):
            plan.promote = self._reserve(hot, len(plan.warm) + sum(1 for _, s in plan.disk if s >= 0))
        plan.valid = len(plan.keys)
        if self._writer is not None and self.config.admission == "second-hit":
            self._writer.notify()
        return plan

    @staticmethod
    def _truncate(plan: Store._FetchPlan, cut: int) -> None:
        plan.keys = plan.keys[:cut]
        plan.hot = [(p, s) for p, s in plan.hot if p < cut]
        plan.warm = [(p, s) for p, s in plan.warm if p < cut]
        plan.disk = [(p, s) for p, s in plan.disk if p < cut and s >= 0]

    def _read_disk(self, plan: Store._FetchPlan, result: torch.Tensor | None) -> None:
        """Read the plan's disk blocks (straight into ``result`` when it is in host memory,
        else into their warm slots or host staging rows) and cut ``plan.valid`` at damage."""
        from kvstore.tiers.disk import ReadStatus

        assert self._disk is not None and self._warm is not None
        warm = self._warm.slab.data
        flat = None
        if result is not None and result.numel():
            flat = result.view(result.shape[0], -1).view(torch.uint8)
        plan.direct = flat is not None and flat.device.type == "cpu"
        if not plan.direct and any(s < 0 for _, s in plan.disk):
            plan.staging = torch.empty((len(plan.disk), self.layout.block_nbytes),
                                       dtype=torch.uint8, pin_memory=self.config.pin_memory)
        dsts = []
        for j, (p, s) in enumerate(plan.disk):
            if plan.direct:
                dsts.append(flat[p])
            elif s >= 0:
                dsts.append(warm[s])
            else:
                dsts.append(plan.staging[j])
        statuses = self._disk.read_many([plan.keys[p] for p, _ in plan.disk], dsts)
        bad = [p for (p, _), st in zip(plan.disk, statuses, strict=True) if st is not ReadStatus.OK]
        if bad:
            with self._lock:
                self._counters.damaged += len(bad)
            plan.valid = min(plan.valid, min(bad))
        if plan.direct:
            for (p, s), dst in zip(plan.disk, dsts, strict=True):
                if p < plan.valid and s >= 0:
                    warm[s].copy_(dst)  # keep a warm copy of what was read

    def _copy_fetch(
        self, plan: Store._FetchPlan, result: torch.Tensor | None, t: Transfer,
        stream: torch.cuda.Stream | None,
    ) -> list:
        """Copy every block into ``result`` layer by layer, then promote into hot.

        Runs on the ``h2d`` worker: returns one CUDA event per layer (or marks the layers
        ready as it goes on the CPU).
        """
        for p, dep in plan.deps:  # a put queued before us on this path has finished (FIFO)
            if dep.done() and dep.exception() is None and dep.wait() == 0:
                plan.valid = min(plan.valid, p)  # its copy failed: those bytes are not there
        n = plan.valid
        lay = self.layout
        if result is None or n == 0:
            t.set_layers_ready(lay.num_layers)
            return []
        L, lb = lay.num_layers, lay.layer_nbytes
        dst = result[:n].view(n, -1).view(torch.uint8)
        sources: list[tuple[torch.Tensor, list[tuple[int, int, int]]]] = []
        if self._hot is not None and plan.hot:
            sources.append((self._hot.slab.data, list(_item_runs([(p, s) for p, s in plan.hot if p < n]))))
        if self._warm is not None:
            warm_items = [(p, s) for p, s in plan.warm if p < n]
            if not plan.direct:
                warm_items += [(p, s) for p, s in plan.disk if p < n and s >= 0]
            if warm_items:
                sources.append((self._warm.slab.data, list(_item_runs(sorted(warm_items)))))
        if plan.staging is not None and not plan.direct:
            rows = [(p, j) for j, (p, s) in enumerate(plan.disk) if p < n and s < 0]
            if rows:
                sources.append((plan.staging, list(_item_runs(rows))))
        events: list = []
        if not layerwise_supported(stream):  # whole blocks at once; every layer ready together
            for data, runs in sources:
                copy_block_runs(dst, data, runs, layer=None, layer_nbytes=lb, stream=stream)
            ev = torch.cuda.Event()
            ev.record(stream)
            return [ev] * L
        for layer in range(L):
            for data, runs in sources:
                copy_block_runs(dst, data, runs, layer=layer, layer_nbytes=lb, stream=stream)
            if stream is None:
                t.set_layers_ready(layer + 1)
            else:
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
        return events

    def _promote_copy(self, plan: Store._FetchPlan, stream: torch.cuda.Stream | None) -> list:
        """Copy the fetched lower-tier blocks from their warm slots into reserved hot slots.

        Runs after the fetch completed (the caller already has its bytes), from the warm
        slots, never from the caller's buffer, which it may already be reusing.
        """
        hot, warm = self._hot, self._warm
        if hot is None or warm is None or not plan.promote:
            return []
        lower = sorted(plan.warm + [(p, s) for p, s in plan.disk if s >= 0])
        items = [(plan.promote[j], s) for j, (p, s) in enumerate(lower[: len(plan.promote)])
                 if p < plan.valid]
        for dst_first, src_first, length in _item_runs(items):
            hot.slab.data[dst_first : dst_first + length].copy_(
                warm.slab.data[src_first : src_first + length], non_blocking=stream is not None)
        if stream is None:
            return []
        ev = torch.cuda.Event()
        ev.record(stream)
        return [ev]

    def _finish_fetch(self, plan: Store._FetchPlan, *, ok: bool) -> None:
        hot, warm, cat = self._hot, self._warm, self._catalog
        if self._closed:
            return
        n = plan.valid if ok else 0
        # blocks read from disk join the warm tier (only the valid leading run: prefix-closed)
        for p, slot in plan.disk:
            if slot < 0:
                continue
            assert warm is not None
            k = plan.keys[p] if p < len(plan.keys) else None
            if k is not None and p < n and k not in warm:
                if k not in cat:
                    cat.add(k, plan.keys[p - 1] if p else plan.parent)
                    cat.set_on_disk(k)
                warm.insert(k, slot)
                warm.counters.promotions_in += 1
            else:
                warm.release(slot)
        if hot is not None and plan.promote:
            lower = sorted(plan.warm + [(p, s) for p, s in plan.disk if s >= 0])
            for (p, _), slot in zip(lower, plan.promote, strict=False):
                k = plan.keys[p] if p < len(plan.keys) else None
                if k is not None and p < n and not plan.promote_failed and k not in hot and k in cat:
                    hot.insert(k, slot)
                    hot.counters.promotions_in += 1
                else:
                    hot.release(slot)
        if n:
            self._touch_chain(plan.keys[:n])
            if self._disk is not None:
                self._disk.touch(plan.keys[:n])
        for k in plan.pinned:
            cat.unpin(k)

    # -- put ------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], kv: torch.Tensor) -> Transfer[int]:
        """Store ``kv`` (``[len(keys), L, P, T, H, D]``) under ``keys``; held keys are skipped.

        Validation is synchronous (raises before anything is queued); the copy completes
        through the returned :class:`Transfer`, whose result is the number of blocks stored.
        ``kv`` must not be modified until the transfer is done.
        """
        ks = self._keys(keys)
        self._check_kv(kv, len(ks))
        parent = self._chain_parent(keys)
        with self._lock:
            self._check_open()
            return self._put_locked(ks, parent, kv)

    def _check_kv(self, kv: torch.Tensor, n: int) -> None:
        lay = self.layout
        if not isinstance(kv, torch.Tensor):
            raise TensorMismatchError(
                f"kv must be a torch.Tensor [n, {', '.join(map(str, lay.block_shape))}], "
                f"got {type(kv).__name__}"
            )
        if kv.dtype != lay.dtype:
            raise TensorMismatchError(
                f"kv has dtype {kv.dtype}; this store's layout holds {lay.dtype} "
                "(convert with kv.to(layout.dtype) or open the store with the engine's dtype)"
            )
        if kv.dim() != 6 or tuple(kv.shape[1:]) != lay.block_shape:
            raise TensorMismatchError(
                f"kv must have shape [n, L, P, T, H, D] = [n, {', '.join(map(str, lay.block_shape))}]"
                f", got {list(kv.shape)}"
            )
        if kv.shape[0] != n:
            raise TensorMismatchError(
                f"kv holds {kv.shape[0]} blocks but {n} keys were given; pass one key per block"
            )
        if kv.device.type not in ("cpu", self.device.type) or (
            kv.device.type == self.device.type
            and kv.device.index is not None
            and self.device.index is not None
            and kv.device.index != self.device.index
        ):
            raise TensorMismatchError(
                f"kv is on {kv.device}; this store takes tensors on {self.device} or cpu"
            )

    def _put_locked(
        self, ks: list[BlockKey], parent: BlockKey | None, kv: torch.Tensor
    ) -> Transfer[int]:
        c = self._counters
        c.puts += 1
        cat = self._catalog
        new_pos: list[int] = []
        new_parents: list[BlockKey | None] = []
        prev = parent
        on_disk = self._disk_run(ks)
        for i, k in enumerate(ks):
            if i < on_disk or self._held(k):
                c.put_duplicates += 1
            elif (
                prev is None
                or self._held(prev)
                or (new_pos and ks[new_pos[-1]] == prev)
                or (i and i - 1 < on_disk)
                or (i == 0 and self._disk is not None and self._disk.contains(prev))
            ):
                new_pos.append(i)
                new_parents.append(prev)
            else:
                # its prefix is no longer cached: lookup could never reach these blocks
                c.put_dropped += len(ks) - i
                break
            prev = k
        self._touch_chain(ks)
        if not new_pos:
            return Transfer.completed(0)
        # Link every new block to its parent first: a parent with a child may be demoted but
        # is never evicted as a leaf to make room for its own children.
        for p, par in zip(new_pos, new_parents, strict=True):
            cat.add(ks[p], par)
        writes: list[tuple[MemoryTier, list[int], list[int]]] = []  # (tier, positions, slots)
        rest = new_pos
        for tier in (self._hot, self._warm):
            if tier is None or not rest:
                continue
            slots = self._reserve(tier, len(rest))
            if slots:
                writes.append((tier, rest[: len(slots)], slots))
                rest = rest[len(slots) :]
        stored = len(new_pos) - len(rest)
        overflow_ok = (
            rest and self._disk is not None
            and self._overflow_bytes + len(rest) * self.layout.block_nbytes <= _OVERFLOW_BYTES
        )
        for p in reversed(rest):
            cat.forget(ks[p])  # not in memory: the catalog tracks memory only
        written: list[BlockKey] = []
        for tier, pos, slots in writes:
            for p, s in zip(pos, slots, strict=True):
                k = ks[p]
                tier.insert(k, s)
                cat.pin(k)  # pending until the copy lands: not evicted, not read by the writer
                written.append(k)
            tier.counters.puts_in += len(pos)
        c.put_blocks += stored
        mem: Transfer[int] | None = None
        if writes:
            mem = self._submit_put_copy(kv, writes, written, stored)
            for k in written:
                self._pending[k] = mem
        if overflow_ok:
            # memory is full of blocks that may not go yet: the rest goes straight to disk
            # from the caller's tensor (which must stay unmodified until the put is done)
            overflow: Transfer[int] = Transfer()
            self._overflow.append(_OverflowJob(
                [ks[p] for p in rest], [new_parents[new_pos.index(p)] for p in rest], kv, rest,
                overflow, mem, stored,
            ))
            self._overflow_bytes += len(rest) * self.layout.block_nbytes
            c.put_blocks += len(rest)
            if self._writer is not None:
                self._writer.notify()
            return overflow
        c.put_dropped += len(rest)
        return mem if mem is not None else Transfer.completed(0)

    def _submit_put_copy(
        self, kv: torch.Tensor, writes: list[tuple[MemoryTier, list[int], list[int]]],
        written: list[BlockKey], stored: int,
    ) -> Transfer[int]:
        def run(stream: torch.cuda.Stream | None) -> list:
            src = kv.reshape(kv.shape[0], -1).view(torch.uint8) if kv.is_contiguous() else None
            for tier, pos, slots in writes:
                if src is not None and pos[-1] - pos[0] == len(pos) - 1:
                    tier.slab.write(slots, src[pos[0] : pos[-1] + 1], non_blocking=stream is not None)
                else:
                    for p, s in zip(pos, slots, strict=True):
                        tier.slab.block(s).copy_(kv[p], non_blocking=stream is not None)
            if stream is None:
                return []
            ev = torch.cuda.Event()
            ev.record(stream)
            return [ev]

        def finish(ok: bool, error: BaseException | None) -> None:
            with self._lock:
                self._finish_put(written, ok)
            if ok:
                t.set_result(stored)
            else:
                log.warning("a put's copy failed; its %d blocks were not stored: %s", stored, error)
                t.set_result(0)  # a failed copy is a miss later, not an error for the engine
            if ok and self._writer is not None:
                self._writer.notify()

        t: Transfer[int] = Transfer()
        assert self._engine is not None
        return self._engine.submit("h2d", Job(t, run, finish))

    def _finish_put(self, written: list[BlockKey], ok: bool) -> None:
        cat = self._catalog
        for k in written:
            self._pending.pop(k, None)
            cat.unpin(k)
        if self._closed:
            return
        if ok:
            if self._disk is not None and self.config.admission == "always":
                for k in written:
                    cat.mark_dirty(k)
            return
        # Nothing of a failed copy may be visible: drop its blocks even if a fetch pinned them
        # meanwhile (such a fetch depends on this put and stops before them). Blocks of later
        # puts chained onto them become unreachable leaves and age out.
        dropped = 0
        for k in reversed(written):
            if k not in cat:
                continue
            for t in (self._hot, self._warm):
                if t is not None and k in t:
                    t.remove(k)
            cat.forget(k)
            dropped += 1
        self._counters.put_blocks -= dropped
        self._counters.put_dropped += dropped

    # -- shared-memory data plane (used by the sidecar daemon) -------------------------------
    def lease_warm(self, keys: Sequence[bytes]) -> tuple[list[BlockKey], list[int]]:
        """Pin the leading held run of ``keys`` *in the warm tier* and return it with its slots.

        Blocks only on disk are read into the warm tier first. The caller reads the slots
        (e.g. through a shared-memory mapping of the warm slab) and must then call
        :meth:`release_lease` with the returned keys. The run may be shorter than a lookup
        said (damage, or no room to stage a block).
        """
        ks = self._keys(keys)
        if self._warm is None:
            raise ConfigError("leases need a warm tier (cpu_capacity > 0)")
        self._fetch(ks, self._chain_parent(keys), None, want_result=False).wait()
        with self._lock:
            self._check_open()
            warm, cat = self._warm, self._catalog
            got: list[BlockKey] = []
            slots: list[int] = []
            for k in ks:
                if k not in warm or k in self._pending:
                    break
                cat.pin(k)
                got.append(k)
                slots.append(warm.slot(k))
            warm.touch(reversed(got))
            c = self._counters
            c.fetches += 1
            c.fetched_blocks += len(got)
            c.fetch_short += len(ks) - len(got)
            return got, slots

    def release_lease(self, keys: Sequence[bytes]) -> None:
        """Release what :meth:`lease_warm` pinned."""
        with self._lock:
            for k in keys:
                self._catalog.unpin(BlockKey(bytes(k)))

    @dataclass(slots=True)
    class PutGrant:
        """Warm slots reserved for the new blocks of a put, filled by someone else."""

        keys: list[BlockKey]  # the new keys, in order
        parents: list[BlockKey | None]
        positions: list[int]  # their positions in the keys the put was asked for
        slots: list[int]  # warm slots to fill, one per key
        duplicates: int

    def grant_put(self, keys: Sequence[bytes]) -> Store.PutGrant:
        """Reserve warm slots for the blocks of ``keys`` not held yet (nothing visible yet).

        Fill ``grant.slots`` with the blocks at ``grant.positions``, then call
        :meth:`commit_put` (or :meth:`abort_put`). Blocks that find no room are left out.
        """
        ks = self._keys(keys)
        parent = self._chain_parent(keys)
        if self._warm is None:
            raise ConfigError("granted puts need a warm tier (cpu_capacity > 0)")
        with self._lock:
            self._check_open()
            c = self._counters
            c.puts += 1
            on_disk = self._disk_run(ks)
            grant = Store.PutGrant([], [], [], [], 0)
            prev = parent
            for i, k in enumerate(ks):
                if i < on_disk or self._held(k) or k in self._granted:
                    grant.duplicates += 1
                elif prev is None or self._held(prev) or prev in self._granted or (
                    grant.keys and grant.keys[-1] == prev) or (i and i - 1 < on_disk):
                    grant.keys.append(k)
                    grant.parents.append(prev)
                    grant.positions.append(i)
                else:
                    c.put_dropped += len(ks) - i
                    break
                prev = k
            c.put_duplicates += grant.duplicates
            for k, par in zip(grant.keys, grant.parents, strict=True):
                self._catalog.add(k, par)  # protects the parents while we make room
            slots = self._reserve(self._warm, len(grant.keys)) if grant.keys else []
            for k in reversed(grant.keys[len(slots):]):
                self._catalog.forget(k)
            c.put_dropped += len(grant.keys) - len(slots)
            del grant.keys[len(slots):], grant.parents[len(slots):], grant.positions[len(slots):]
            grant.slots = slots
            for k in grant.keys:
                self._granted.add(k)
                self._catalog.pin(k)
            return grant

    def commit_put(self, grant: Store.PutGrant) -> int:
        """Publish a granted put whose slots were filled; returns the blocks stored."""
        with self._lock:
            if self._closed:
                return 0
            warm, cat = self._warm, self._catalog
            assert warm is not None
            for k, s in zip(grant.keys, grant.slots, strict=True):
                self._granted.discard(k)
                cat.unpin(k)
                warm.insert(k, s)
                if self._disk is not None and self.config.admission == "always":
                    cat.mark_dirty(k)
            warm.counters.puts_in += len(grant.keys)
            self._counters.put_blocks += len(grant.keys)
            self._touch_chain(grant.keys)
        if grant.keys and self._writer is not None:
            self._writer.notify()
        return len(grant.keys)

    def abort_put(self, grant: Store.PutGrant) -> None:
        """Give back a granted put's slots (a client died mid-put): nothing becomes visible."""
        with self._lock:
            if self._closed:
                return
            warm, cat = self._warm, self._catalog
            assert warm is not None
            for k, s in zip(grant.keys, grant.slots, strict=True):
                self._granted.discard(k)
                cat.unpin(k)
                if k in cat and not self._held(k):
                    cat.forget(k)
                warm.release(s)
            self._counters.put_dropped += len(grant.keys)

    @property
    def warm_slab(self) -> torch.Tensor | None:
        """The warm tier's ``[slots, block_nbytes]`` bytes (for the daemon's shared memory)."""
        return None if self._warm is None else self._warm.slab.data

    # -- room -----------------------------------------------------------------------------
    def _disk_run(self, ks: list[BlockKey]) -> int:
        """Leading ``ks`` already on disk (so a put need not keep them)."""
        if self._disk is None or not ks or self._held(ks[0]):
            return 0
        return self._disk.leading_run(ks)

    def _reserve(self, tier: MemoryTier, n: int) -> list[int]:
        """Up to ``n`` free slots of ``tier``, evicting or demoting LRU blocks as needed.

        Dirty blocks (not yet on disk) are never given up for room: when memory is full of
        them, a put sends its remaining blocks straight to disk (or drops and counts them).
        """
        slots = tier.allocate(n)
        while len(slots) < n and self._evict_one(tier):
            slots.extend(tier.allocate(n - len(slots)))
        return slots

    def _evict_one(self, tier: MemoryTier) -> bool:
        """Free one slot of ``tier``; False if no block can go.

        A victim (oldest first, never pinned) with a copy in the other memory tier just
        loses this copy; one that is on disk leaves memory; a hot block with no lower copy is
        demoted to warm; a block leaving the store must be a leaf (prefix-closure) and must
        not be waiting for the disk writer.
        """
        cat = self._catalog
        other_tier = self._warm if tier is self._hot else self._hot
        for key in tier.lru_order():
            if cat.is_pinned(key):
                continue
            if (other_tier is not None and key in other_tier) or cat.on_disk(key):
                tier.remove(key)
                tier.counters.evictions += 1
                if not self._held(key):
                    cat.forget(key)  # still on disk
                return True
            if tier is self._hot and self._warm is not None and self._demote(key):
                return True
            if cat.has_children(key) or cat.is_dirty(key):
                continue
            tier.remove(key)
            tier.counters.evictions += 1
            cat.forget(key)
            return True
        return False

    def _demote(self, key: BlockKey) -> bool:
        hot, warm = self._hot, self._warm
        assert hot is not None and warm is not None
        self._catalog.pin(key)  # keep it in hot while warm makes room
        try:
            slots = self._reserve(warm, 1)
        finally:
            self._catalog.unpin(key)
        if not slots:
            return False
        warm.slab.data[slots[0]].copy_(hot.slab.data[hot.slot(key)])
        warm.insert(key, slots[0])
        warm.counters.demotions_in += 1
        hot.remove(key)
        hot.counters.evictions += 1
        return True

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
            return PinReceipt(self, pinned)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop one pin from each of ``keys``; returns how many were pinned."""
        ks = self._keys(keys)
        with self._lock:
            if self._closed:
                return 0
            return sum(1 for k in ks if self._catalog.unpin(k))

    # -- evict ----------------------------------------------------------------------------
    def evict(self, keys: Sequence[bytes] | None = None, *, tier: str | None = None) -> int:
        """Evict ``keys`` (default: every unpinned block) and return how many left.

        ``tier=None`` removes the blocks from the store (memory and disk), together with their
        descendants held in memory, so what remains stays prefix-closed. ``tier="hot"`` /
        ``"warm"`` frees only that tier: a block with no copy elsewhere is demoted
        (hot -> warm) where there is room, else removed like ``tier=None``. ``tier="disk"``
        deletes only the disk copies. Pinned blocks (and so their ancestors) stay.
        """
        if tier not in (None, HOT, WARM, DISK):
            raise ConfigError(f"tier must be None, 'hot', 'warm' or 'disk', got {tier!r}")
        ks = None if keys is None else self._keys(keys)
        with self._lock:
            self._check_open()
            cat = self._catalog
            if tier is None:
                targets = list(cat.keys()) if ks is None else [k for k in ks if k in cat]
                removed = set(self._remove_subtrees(targets))
                if self._disk is not None:
                    on_disk = self._namespace_disk_keys() if ks is None else ks
                    doomed = [k for k in on_disk if k not in cat]
                    self._disk.delete(doomed)
                    removed.update(doomed)
                return len(removed)
            if tier == DISK:
                if self._disk is None:
                    return 0
                targets = self._namespace_disk_keys() if ks is None else ks
                doomed = [k for k in targets if not cat.is_pinned(k)]
                for k in doomed:
                    cat.clear_on_disk(k)
                return self._disk.delete(doomed)
            t = self._hot if tier == HOT else self._warm
            if t is None:
                return 0
            other = self._warm if t is self._hot else self._hot
            count = 0
            for k in list(t.keys()) if ks is None else ks:
                if k not in t or cat.is_pinned(k):
                    continue
                if (other is not None and k in other) or cat.on_disk(k):
                    t.remove(k)
                    t.counters.evictions += 1
                    if not self._held(k):
                        cat.forget(k)
                    count += 1
                elif (t is self._hot and self._warm is not None and self._demote(k)) or (
                    self._remove_subtrees([k])
                ):
                    count += 1
            return count

    def _namespace_disk_keys(self) -> list[BlockKey]:
        assert self._disk is not None
        return [BlockKey(r.key) for r in self._disk.records(self.namespace_id)]

    def _remove_subtrees(self, roots: list[BlockKey]) -> list[BlockKey]:
        """Remove ``roots`` and their memory-held descendants from memory, leaves first."""
        cat = self._catalog
        removed: list[BlockKey] = []
        for root in roots:
            if root not in cat:
                continue
            for k in cat.descendants_postorder(root):
                if k not in cat or cat.is_pinned(k) or cat.has_children(k):
                    continue
                for t in (self._hot, self._warm):
                    if t is not None and k in t:
                        t.remove(k)
                        t.counters.evictions += 1
                if cat.is_dirty(k):
                    self._counters.dirty_dropped += 1
                cat.forget(k)
                removed.append(k)
        return removed

    # -- paged engines --------------------------------------------------------------------
    def load_into(
        self, keys: Sequence[bytes], pages: Sequence[object], block_ids: object,
        *, page_size: int | None = None,
    ) -> Transfer[int]:
        """Scatter the leading held blocks of ``keys`` into an engine's KV cache.

        ``pages[l]`` is layer ``l``'s paged tensor ``[kv_planes, num_pages, page_size, H, D]``
        (vLLM flash-attention layout) or a ``(key, value)`` pair of ``[batch, heads, seq,
        head_dim]`` tensors (transformers; ``page_size`` defaults to ``block_tokens``).
        ``block_ids`` names one page per ``page_size`` tokens, ``block_tokens // page_size``
        per key, in token order. Pages not named, or past the loaded run, are never written.
        The transfer yields the number of blocks loaded; ``wait_layer(i)`` returns once layer
        ``i`` is in place.
        """
        ks = self._keys(keys)
        lay = self.layout
        geo = paged_geometry(lay, pages, page_size)
        ids = page_index(block_ids, len(ks) * geo.pages_per_block, geo)
        t: Transfer[int] = Transfer(lay.num_layers)

        def run(stream: torch.cuda.Stream | None) -> list:
            # queued by the fetch's completion: its bytes are in ``staged``
            n = plan.valid
            sel = ids[: n * geo.pages_per_block]
            events = []
            for layer in range(lay.num_layers):
                if n:
                    assert staged is not None
                    scatter_pages(lay, geo, staged[:n, layer], pages[layer], sel)
                if stream is None:
                    t.set_layers_ready(layer + 1)
                else:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events.append(ev)
            return events

        def finish(ok: bool, error: BaseException | None) -> None:
            if ok:
                t.set_result(plan.valid)
            else:
                t.set_error(error or RuntimeError("load_into failed"))

        def scatter_after_fetch(ok: bool, error: BaseException | None) -> None:
            if not ok:
                t.set_error(error or RuntimeError("load_into's fetch failed"))
                return
            try:
                assert self._engine is not None
                self._engine.submit("h2d", Job(t, run, finish))
            except BaseException as e:  # noqa: BLE001 - closing
                t.set_error(e)

        _, plan, staged = self._submit_fetch(
            ks, self._chain_parent(keys), None, want_result=True, then=scatter_after_fetch
        )
        return t

    def save_from(
        self, pages: Sequence[object], block_ids: object, keys: Sequence[bytes],
        *, page_size: int | None = None,
    ) -> Transfer[int]:
        """Gather the blocks for ``keys`` out of an engine's KV cache and ``put`` them.

        Same ``pages``/``block_ids`` conventions as :meth:`load_into`. The gather is a copy
        taken before this returns, so the engine may overwrite its pages right away.
        """
        ks = self._keys(keys)
        lay = self.layout
        geo = paged_geometry(lay, pages, page_size)
        ids = page_index(block_ids, len(ks) * geo.pages_per_block, geo)
        kv = torch.empty(lay.batch_shape(len(ks)), dtype=lay.dtype, device=geo.device)
        for layer in range(lay.num_layers):
            gather_pages(lay, geo, pages[layer], ids, kv[:, layer])
        return self.put(keys if isinstance(keys, KeyChain) else ks, kv)

    # -- prefetch / flush / stats -------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> Transfer[int]:
        """Read the leading held blocks of ``keys`` from disk into the warm tier ahead of need.

        Yields the number of leading blocks now held in memory.
        """
        ks = self._keys(keys)
        return self._fetch(ks, self._chain_parent(keys), None, want_result=False)

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

    def _write_pass(self) -> bool:
        """One batch of the background writer: dirty blocks -> one disk segment."""
        from kvstore.errors import DiskError
        from kvstore.tiers.disk import DiskWrite

        disk = self._disk
        per_batch = max(1, _WRITE_BATCH_BYTES // self.layout.block_nbytes)
        with self._lock:
            if self._closed or disk is None:
                return False
            job = self._overflow.popleft() if self._overflow else None
        if job is not None:
            self._write_overflow(disk, job)
            return True
        with self._lock:
            cat = self._catalog
            batch = cat.take_dirty(per_batch)
            if not batch:
                return False
            jobs: list[tuple[BlockKey, BlockKey | None, torch.Tensor]] = []
            for k in batch:
                warm, hot = self._warm, self._hot
                if warm is not None and k in warm:
                    data = warm.slab.data[warm.slot(k)]
                elif hot is not None and k in hot:
                    data = hot.slab.data[hot.slot(k)]
                else:
                    continue
                cat.pin(k)
                jobs.append((k, cat.parent(k), data))
        try:
            items = [
                DiskWrite(k, p, self.namespace_id, d if d.device.type == "cpu" else d.to("cpu"))
                for k, p, d in jobs
            ]
            disk.write_blocks(items)
            ok = True
        except DiskError as e:
            log.warning("disk tier write failed, %d blocks stay memory-only: %s", len(jobs), e)
            ok = False
        except Exception:
            log.exception("disk tier write failed unexpectedly; %d blocks stay memory-only", len(jobs))
            ok = False
        with self._lock:
            for k, _, _ in jobs:
                self._catalog.unpin(k)
                if ok:
                    self._catalog.set_on_disk(k)
            if not ok:
                self._counters.disk_write_dropped += len(jobs)
            cat = self._catalog
        if ok:
            try:
                disk.evict_to_budget(protect=lambda key: key in cat)
            except Exception:
                log.exception("disk tier eviction failed")
        return True

    def _write_overflow(self, disk, job: _OverflowJob) -> None:  # noqa: ANN001
        from kvstore.tiers.disk import DiskWrite

        ok = False
        base = job.base
        if job.memory is not None:
            base = job.memory.wait()
        try:
            items = [
                DiskWrite(k, par, self.namespace_id,
                          job.kv[p].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
                for k, par, p in zip(job.keys, job.parents, job.positions, strict=True)
            ]
            disk.write_blocks(items)
            ok = True
        except Exception as e:  # DiskError or worse: the blocks are lost, the engine is not
            log.warning("disk tier write failed, %d blocks of a put were dropped: %s",
                        len(job.keys), e)
        with self._lock:
            self._overflow_bytes -= len(job.keys) * self.layout.block_nbytes
            if not ok:
                self._counters.disk_write_dropped += len(job.keys)
        job.transfer.set_result(base + (len(job.keys) if ok else 0))

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
) -> Store:
    """Open (or create) a store. Sizes are ints or strings like ``"4GiB"``.

    ``gpu_capacity`` defaults to 1GiB on a CUDA device and 0 on ``cpu`` (pass a size to run
    the hot tier on the CPU, as the tests do). ``path=None`` keeps everything in memory.
    ``warm_shared_memory`` puts the warm slab in a file (under ``/dev/shm``) that other
    processes can map — the sidecar daemon's data plane.
    """
    if not isinstance(layout, KVLayout):
        raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a str or os.PathLike, got {type(path).__name__}")
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
    )
    return Store(config)
