"""The embedded store: keys, longest-prefix lookup, fetch, put, pins, eviction, stats.

Locking: one lock guards the catalog, the tiers' maps and the counters. Fetch copies run
outside it; the blocks being copied are pinned, so they cannot be evicted mid-copy.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.errors import (
    ConfigError,
    NamespaceMismatchError,
    SizeError,
    StoreClosedError,
    TensorMismatchError,
)
from kvstore.index import Catalog
from kvstore.keys import BlockKey, KeyChain, check_key
from kvstore.keys import block_keys as _block_keys
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.paged import gather_layer, page_index, paged_geometry, scatter_layer
from kvstore.sizes import parse_size
from kvstore.stats import Counters, StoreStats, TierStats
from kvstore.tiers.memory import MemoryTier
from kvstore.transfer import Transfer

HOT, WARM = "hot", "warm"


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
        self._catalog = Catalog()
        self._counters = Counters()
        self._hot: MemoryTier | None = None
        self._warm: MemoryTier | None = None
        if config.gpu_capacity:
            self._hot = MemoryTier(HOT, self.layout, config.gpu_capacity, config.device)
        if config.cpu_capacity:
            self._warm = MemoryTier(
                WARM, self.layout, config.cpu_capacity, torch.device("cpu"),
                pin_memory=config.pin_memory,
            )
        if self._hot is None and self._warm is None:
            raise ConfigError(
                "gpu_capacity and cpu_capacity are both 0: give at least one memory tier room"
            )

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush and release every tier. Idempotent; any later call raises StoreClosedError."""
        with self._lock:
            if self._closed:
                return
            self.flush()
            self._closed = True
            self._hot = self._warm = None
            self._catalog = Catalog()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
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
        return (self._hot is not None and key in self._hot) or (
            self._warm is not None and key in self._warm
        )

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
            n = 0
            for k in ks:
                if not self._held(k):
                    break
                n += 1
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
        first miss or damaged block. Blocks fetched from a lower tier are promoted.
        """
        ks = self._keys(keys)
        lay = self.layout
        if out is not None:
            self._check_out(out, len(ks))
        with self._lock:
            self._check_open()
            plan = self._plan_fetch(ks)
        n = len(plan.keys)
        try:
            if out is None:
                out = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device=self.device)
            result = out[:n]
            self._copy_fetch(plan, result)
        except BaseException as e:
            with self._lock:
                self._finish_fetch(plan, ok=False)
            t: Transfer[torch.Tensor] = Transfer(lay.num_layers)
            t.set_error(e)
            return t
        with self._lock:
            self._finish_fetch(plan, ok=True)
            c = self._counters
            c.fetches += 1
            c.fetched_blocks += n
            c.fetch_short += len(ks) - n
        return Transfer.completed(result, lay.num_layers)

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
        keys: list[BlockKey]
        hot_pos: list[int]  # positions in the result served from hot
        hot_slots: list[int]
        warm_pos: list[int]
        warm_slots: list[int]
        promote_slots: list[int]  # hot slots reserved for warm_pos[:len(promote_slots)]

    def _plan_fetch(self, ks: list[BlockKey]) -> Store._FetchPlan:
        hot, warm = self._hot, self._warm
        plan = Store._FetchPlan([], [], [], [], [], [])
        for i, k in enumerate(ks):
            if hot is not None and k in hot:
                plan.hot_pos.append(i)
                plan.hot_slots.append(hot.slot(k))
            elif warm is not None and k in warm:
                plan.warm_pos.append(i)
                plan.warm_slots.append(warm.slot(k))
            else:
                break
            plan.keys.append(k)
            self._catalog.pin(k)
        self._touch_chain(plan.keys)
        if hot is not None and plan.warm_pos:
            plan.promote_slots = self._reserve(hot, len(plan.warm_pos))
        return plan

    def _copy_fetch(self, plan: Store._FetchPlan, result: torch.Tensor) -> None:
        flat = result.view(result.shape[0], -1).view(torch.uint8) if result.numel() else None
        if flat is None:
            return
        for tier, pos, slots in (
            (self._hot, plan.hot_pos, plan.hot_slots),
            (self._warm, plan.warm_pos, plan.warm_slots),
        ):
            if not pos:
                continue
            assert tier is not None
            if pos[-1] - pos[0] == len(pos) - 1:  # contiguous positions: copy straight in
                tier.slab.read(slots, flat[pos[0] : pos[-1] + 1])
            else:
                for p, s in zip(pos, slots, strict=True):
                    tier.slab.read([s], flat[p : p + 1])
        if plan.promote_slots:
            assert self._hot is not None
            m = len(plan.promote_slots)
            src_pos = plan.warm_pos[:m]
            src = flat[src_pos[0] : src_pos[-1] + 1] if src_pos[-1] - src_pos[0] == m - 1 else (
                flat[torch.tensor(src_pos, device=flat.device)]
            )
            self._hot.slab.write(plan.promote_slots, src)

    def _finish_fetch(self, plan: Store._FetchPlan, *, ok: bool) -> None:
        hot = self._hot
        if hot is not None and plan.promote_slots:
            promoted = [plan.keys[p] for p in plan.warm_pos[: len(plan.promote_slots)]]
            for k, slot in zip(promoted, plan.promote_slots, strict=True):
                if ok and k not in hot and self._held(k):
                    hot.insert(k, slot)
                    hot.counters.promotions_in += 1
                else:
                    hot.release(slot)
            hot.touch(reversed(plan.keys))
        for k in plan.keys:
            self._catalog.unpin(k)

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
            stored = self._put_locked(ks, parent, kv)
        return Transfer.completed(stored)

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

    def _put_locked(self, ks: list[BlockKey], parent: BlockKey | None, kv: torch.Tensor) -> int:
        c = self._counters
        c.puts += 1
        cat = self._catalog
        new_pos: list[int] = []
        new_parents: list[BlockKey | None] = []
        prev = parent
        for i, k in enumerate(ks):
            if self._held(k):
                c.put_duplicates += 1
            elif prev is None or self._held(prev) or (new_pos and ks[new_pos[-1]] == prev):
                new_pos.append(i)
                new_parents.append(prev)
            else:
                # its prefix is no longer cached: lookup could never reach these blocks
                c.put_dropped += len(ks) - i
                break
            prev = k
        if not new_pos:
            self._touch_chain(ks)
            return 0
        tier = self._hot if self._hot is not None else self._warm
        assert tier is not None
        src = kv.reshape(kv.shape[0], -1).view(torch.uint8) if kv.is_contiguous() else None
        done = 0
        while done < len(new_pos):
            # Link the next block to its parent before making room, so the parent counts as
            # having a child: it may be demoted, but not evicted as a leaf for its own child.
            first = ks[new_pos[done]]
            cat.add(first, new_parents[done])
            try:
                slots = self._reserve(tier, len(new_pos) - done)
            except BaseException:
                cat.forget(first)
                raise
            if not slots:
                cat.forget(first)
                break
            take = len(slots)
            pos = new_pos[done : done + take]
            if src is not None and pos[-1] - pos[0] == take - 1:
                tier.slab.write(slots, src[pos[0] : pos[-1] + 1])
            else:
                for p, s in zip(pos, slots, strict=True):
                    tier.slab.block(s).copy_(kv[p])
            for p, s, par in zip(pos, slots, new_parents[done : done + take], strict=True):
                k = ks[p]
                cat.add(k, par)
                tier.insert(k, s)
            done += take
        # a block is admitted only if every new block before it was (prefix-closure)
        c.put_dropped += len(new_pos) - done
        tier.counters.puts_in += done
        c.put_blocks += done
        take = done
        self._touch_chain(ks)
        return take

    # -- room -----------------------------------------------------------------------------
    def _reserve(self, tier: MemoryTier, n: int) -> list[int]:
        """Up to ``n`` free slots of ``tier``, evicting or demoting LRU blocks as needed."""
        slots = tier.allocate(n)
        while len(slots) < n:
            if not self._evict_one(tier):
                break
            slots.extend(tier.allocate(n - len(slots)))
        return slots

    def _other_copy(self, tier: MemoryTier, key: BlockKey) -> bool:
        other = self._warm if tier is self._hot else self._hot
        return other is not None and key in other

    def _evict_one(self, tier: MemoryTier) -> bool:
        """Free one slot of ``tier``; False if every block is pinned or has cached children."""
        cat = self._catalog
        for key in tier.lru_order():
            if cat.is_pinned(key):
                continue
            if self._other_copy(tier, key):
                tier.remove(key)
                tier.counters.evictions += 1
                return True
            if tier is self._hot and self._warm is not None and self._demote(key):
                return True
            if cat.has_children(key):
                continue  # leaving the last tier: leaves first
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

        ``tier=None`` removes the blocks from the store, together with their cached
        descendants (so what remains stays prefix-closed). ``tier="hot"``/``"warm"`` frees only
        that tier: a block with no copy elsewhere is demoted (hot -> warm) where there is room,
        else removed like ``tier=None``. Pinned blocks (and so their ancestors) stay.
        """
        if tier not in (None, HOT, WARM):
            raise ConfigError(f"tier must be None, 'hot' or 'warm', got {tier!r}")
        with self._lock:
            self._check_open()
            if keys is None:
                targets = list(self._catalog.keys())
            else:
                targets = [k for k in self._keys(keys) if k in self._catalog]
            if tier is None:
                return self._remove_subtrees(targets)
            t = self._hot if tier == HOT else self._warm
            if t is None:
                return 0
            count = 0
            for k in targets:
                if k not in t or self._catalog.is_pinned(k):
                    continue
                if self._other_copy(t, k):
                    t.remove(k)
                    t.counters.evictions += 1
                    count += 1
                elif t is self._hot and self._warm is not None and self._demote(k) or self._remove_subtrees([k]):
                    count += 1
            return count

    def _remove_subtrees(self, roots: list[BlockKey]) -> int:
        cat = self._catalog
        removed = 0
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
                cat.forget(k)
                removed += 1
        return removed

    # -- paged engines --------------------------------------------------------------------
    def load_into(
        self, keys: Sequence[bytes], pages: Sequence[torch.Tensor], block_ids: object
    ) -> Transfer[int]:
        """Scatter the leading held blocks of ``keys`` into an engine's paged KV cache.

        ``pages[l]`` is layer ``l``'s ``[kv_planes, num_pages, page_size, H, D]`` tensor;
        ``block_ids`` names one page per ``page_size`` tokens, ``block_tokens // page_size``
        per key, in token order. Pages not named (or past the loaded run) are never written.
        The transfer yields the number of blocks loaded.
        """
        ks = self._keys(keys)
        geo = paged_geometry(self.layout, pages)
        num_pages = pages[0].shape[1] if geo.planes_axis else pages[0].shape[0]
        ids = page_index(block_ids, len(ks) * geo.pages_per_block, num_pages, pages[0].device)
        staged = self.fetch(ks).wait()
        n = staged.shape[0]
        t: Transfer[int] = Transfer(self.layout.num_layers)
        ids = ids[: n * geo.pages_per_block]
        for layer in range(self.layout.num_layers):
            if n:
                scatter_layer(self.layout, geo, staged[:, layer], pages[layer], ids)
            t.set_layers_ready(layer + 1)
        t.set_result(n)
        return t

    def save_from(
        self, pages: Sequence[torch.Tensor], block_ids: object, keys: Sequence[bytes]
    ) -> Transfer[int]:
        """Gather blocks for ``keys`` out of an engine's paged cache and ``put`` them."""
        ks = self._keys(keys)
        geo = paged_geometry(self.layout, pages)
        num_pages = pages[0].shape[1] if geo.planes_axis else pages[0].shape[0]
        ids = page_index(block_ids, len(ks) * geo.pages_per_block, num_pages, pages[0].device)
        lay = self.layout
        kv = torch.empty(lay.batch_shape(len(ks)), dtype=lay.dtype, device=pages[0].device)
        for layer in range(lay.num_layers):
            gather_layer(lay, geo, pages[layer], ids, kv[:, layer])
        return self.put(keys if isinstance(keys, KeyChain) else ks, kv)

    # -- prefetch / flush / stats -------------------------------------------------------------
    def prefetch(self, keys: Sequence[bytes]) -> Transfer[int]:
        """Warm the leading held blocks of ``keys`` into memory ahead of a fetch.

        Yields the number of leading blocks now held in memory.
        """
        ks = self._keys(keys)
        with self._lock:
            self._check_open()
            n = 0
            for k in ks:
                if not self._held(k):
                    break
                n += 1
            self._touch_chain(ks[:n])
        return Transfer.completed(n)

    def flush(self) -> None:
        """Return once every earlier ``put`` is complete (and durable where a disk tier exists)."""
        self._check_open()

    def stats(self) -> StoreStats:
        """A frozen snapshot of the counters and the tiers' occupancy."""
        with self._lock:
            self._check_open()
            c = self._counters
            tiers = tuple(
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
            )
            return StoreStats(
                lookups=c.lookups, hits=c.hits, misses=c.misses, fetches=c.fetches,
                fetched_blocks=c.fetched_blocks, fetch_short=c.fetch_short, puts=c.puts,
                put_blocks=c.put_blocks, put_duplicates=c.put_duplicates,
                put_dropped=c.put_dropped, damaged=c.damaged, dirty_dropped=c.dirty_dropped,
                disk_write_dropped=c.disk_write_dropped,
                pinned_blocks=self._catalog.pinned_count, blocks=len(self._catalog),
                block_nbytes=self.layout.block_nbytes, tiers=tiers,
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
) -> Store:
    """Open (or create) a store. Sizes are ints or strings like ``"4GiB"``.

    ``gpu_capacity`` defaults to 1GiB on a CUDA device and 0 on ``cpu`` (pass a size to run
    the hot tier on the CPU, as the tests do). ``path=None`` keeps everything in memory.
    """
    if not isinstance(layout, KVLayout):
        raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a str or os.PathLike, got {type(path).__name__}")
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
    )
    return Store(config)
