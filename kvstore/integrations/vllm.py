"""vLLM KV connector: kvstore as vLLM's external prefix cache (``KVConnectorBase_V1``).

Turn it on with one configuration switch::

    from vllm.config import KVTransferConfig
    LLM(model=..., enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"store_path": "~/.cache/kvstore-vllm"}))

Two modes, chosen by ``kv_connector_extra_config`` (see docs/vllm.md):

- **embedded** (``store_path``, ``cpu_capacity``, ``disk_capacity``, ...): the engine
  process opens the store itself. Scheduler and worker connectors living in one process share
  one :class:`~kvstore.store.Store`; when vLLM splits them into processes each opens the store
  directory and the scheduler sees what the worker wrote once it is on disk.
- **daemon** (``socket``): scheduler and worker each :func:`kvstore.client.connect` to a
  ``kvstore serve`` daemon; the cache outlives every engine and is shared by all of them.

How it works. The scheduler side keys each request's prompt with kvstore's content keys
(``salt`` = the request's ``cache_salt``; a LoRA adapter's name and path are the first block's
extra bytes), asks the store for the longest cached run beyond what vLLM's own prefix cache
already has, and claims whole blocks only, never the whole prompt (vLLM computes at least
one token). It then plans, per step, which blocks the worker loads (the claimed ones, into
the pages vLLM allocated for them) and which full prompt blocks it saves once computed.
With an embedded store and vLLM's CPU pages the worker side copies
straight between the store's warm slots and vLLM's pages (``lease_warm`` for loads,
``grant_put``/``commit_put`` for saves), on the engine's thread, before the forward; otherwise
(daemon mode, CUDA pages) it fetches into a staging buffer and scatters it (layer by layer in
``wait_for_layer_load`` on CUDA) and saves through ``save_from`` (an asynchronous ``put``).
A load that comes back short (a block evicted, damaged or deleted since the lookup) reports
its missing blocks through ``get_block_ids_with_load_errors``: with
``kv_load_failure_policy="recompute"`` vLLM recomputes them. Blocks computed in a step whose
load failed are never saved, so a failure never turns into wrong KV later.

Page layout. vLLM's CPU backend keeps, per layer, ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` where each (block, head) holds ``block_size`` K rows then ``block_size`` V
rows. The connector copies whole pages as opaque bytes: the store's layout is
``KVLayout(num_layers=L, num_kv_heads=H, head_dim=2 * head_size, kv_planes=1,
block_tokens=block_size)`` so one store block is exactly one vLLM page per layer, and a
layer's cache is copied through the byte-identical view ``[num_blocks, block_size, H,
2 * head_size]`` (page ``i`` = vLLM block ``i``). Because the bytes keep vLLM's interior order
(not kvstore's ``[T, H, D]``), the page layout is part of the namespace
(``namespace_extras["page_layout"]``): blocks written this way are only ever read back by the
same engine layout. On CUDA platforms (flash layout ``[2, num_blocks, block_size, H, D]``)
the store layout is the regular ``kv_planes=2`` one; that path is untested here.

Limits: one KV-cache group of full attention (no sliding window, no hybrid/Mamba models),
tensor and pipeline parallel size 1, token prompts (requests with multimodal inputs or
prompt embeddings are neither looked up nor saved), prompt blocks only (generated tokens are
not saved).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.api import ZeroCopy
from kvstore.errors import ConfigError
from kvstore.kernels import scatter_pages
from kvstore.keys import KeyChain
from kvstore.layout import KVLayout
from kvstore.paged import page_index, paged_geometry

try:  # vLLM >= 0.11 labels external hits by tier
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    _CacheHitSource = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "ConnectorConfig",
    "engine_layout",
    "weights_fingerprint",
]

log = logging.getLogger("vllm.kvstore")

#: written into every namespace this connector opens (bumped if the mapping ever changes)
PAGE_LAYOUT_CPU = "vllm-cpu/v1 [num_kv_heads, block_size, 2*head_size] per layer, opaque bytes"
PAGE_LAYOUT_FLASH = "vllm-flash/v1 [2, num_blocks, block_size, num_kv_heads, head_size]"

_EXTRA_KEYS = {
    "store_path", "cpu_capacity", "disk_capacity", "gpu_capacity", "admission", "disk_codec",
    "socket", "warm_capacity", "salt_policy", "model_id", "model_revision", "stats_path",
    "timeout", "prefault", "layerwise",
}


# -- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, validated.

    Embedded mode: ``store_path`` (None = memory only), ``cpu_capacity``, ``disk_capacity``,
    ``gpu_capacity``, ``admission``, ``disk_codec`` (as :func:`kvstore.open_store`).
    Daemon mode: ``socket`` (and optionally ``warm_capacity``, ``salt_policy``, ``timeout``).
    ``prefault`` (embedded, default ``"1GiB"``, ``0`` = off): how much of the warm tier to
    fault in at start, so the first loads after a restart do not pay page faults.
    ``layerwise``: scatter each layer when the forward reaches it (overlapping the rest of
    the load with compute) instead of before the forward. Default: on for GPUs, off on the
    CPU, where the copy threads would compete with the forward's OpenMP threads for cores
    (measured: slower on 2 cores).
    Both: ``model_id`` / ``model_revision`` override what is derived from vLLM's model config;
    ``stats_path`` (a directory) makes each connector write its counters there as JSON.
    """

    socket: str | None = None
    store_path: str | None = None
    cpu_capacity: int | str | None = None
    disk_capacity: int | str | None = None
    gpu_capacity: int | str | None = None
    admission: str | None = None
    disk_codec: str | None = None
    warm_capacity: int | str | None = None
    salt_policy: str | None = None
    timeout: float | None = None
    model_id: str | None = None
    model_revision: str | None = None
    stats_path: str | None = None
    prefault: int | str | None = None
    layerwise: bool | None = None

    @property
    def mode(self) -> str:
        return "daemon" if self.socket else "embedded"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}; known: "
                f"{sorted(_EXTRA_KEYS)}"
            )
        if extra.get("socket") and extra.get("store_path"):
            raise ConfigError(
                "kv_connector_extra_config: give either 'socket' (daemon mode) or 'store_path' "
                "(embedded mode), not both"
            )
        return cls(**extra)


def _fingerprint_file(h: Any, path: Path, full_limit: int = 64 << 20, chunks: int = 64,
                      chunk: int = 64 << 10) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}|{size}|".encode())
    with open(path, "rb") as f:
        if size <= full_limit:
            for part in iter(lambda: f.read(1 << 20), b""):
                h.update(part)
            return
        head = f.read(8)
        h.update(head)
        if path.suffix == ".safetensors" and len(head) == 8:
            # the safetensors header names every tensor, dtype, shape and offset
            h.update(f.read(min(int.from_bytes(head, "little"), 100 << 20)))
        step = max(1, (size - chunk) // (chunks - 1))
        for i in range(chunks):
            f.seek(min(i * step, size - chunk))
            h.update(f.read(chunk))


_FINGERPRINTS: dict[tuple[str, tuple], str] = {}


def weights_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """A digest of a local checkpoint directory: config, and the weight files (whole files up
    to 64 MiB, else their headers plus 64 evenly spaced 64 KiB samples).

    Cheap enough to run in every engine process; two checkpoints that differ anywhere a
    sample falls (random or trained weights differ everywhere) get different digests. Pass
    ``model_revision`` explicitly when that is not good enough.
    """
    d = Path(model_dir)
    files = sorted(
        p for p in d.iterdir()
        if p.is_file() and (p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf")
                            or p.name in ("config.json", "generation_config.json"))
    )
    sig = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    cache_key = (str(d.resolve()), sig)
    got = _FINGERPRINTS.get(cache_key)
    if got is None:
        h = hashlib.sha256(b"kvstore-vllm-weights/1")
        for p in files:
            _fingerprint_file(h, p)
        got = _FINGERPRINTS[cache_key] = h.hexdigest()
    return got


def _model_identity(vllm_config: VllmConfig, cfg: ConnectorConfig) -> tuple[str, str]:
    mc = vllm_config.model_config
    model_id = cfg.model_id or str(mc.model)
    revision = cfg.model_revision
    if revision is None:
        parts = []
        if getattr(mc, "revision", None):
            parts.append(f"rev={mc.revision}")
        if os.path.isdir(str(mc.model)):
            parts.append(f"weights={weights_fingerprint(str(mc.model))}")
        else:
            commit = getattr(getattr(mc, "hf_config", None), "_commit_hash", None)
            if commit:
                parts.append(f"commit={commit}")
        revision = ";".join(parts)
    return model_id, revision


def _config_digest(vllm_config: VllmConfig) -> str:
    """Digest of what, beyond the weights, changes the KV a model computes."""
    mc = vllm_config.model_config
    try:
        hf = mc.hf_text_config.to_dict() if hasattr(mc, "hf_text_config") else mc.hf_config.to_dict()
    except Exception:  # noqa: BLE001 - an exotic config: fall back to its repr
        hf = repr(getattr(mc, "hf_config", None))
    volatile = {"transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype"}
    if isinstance(hf, dict):
        hf = {k: v for k, v in hf.items() if k not in volatile}
    doc = {
        "hf_config": hf,
        "quantization": str(getattr(mc, "quantization", None)),
        "model_dtype": str(getattr(mc, "dtype", None)),
        "hf_overrides": repr(getattr(mc, "hf_overrides", None)),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _single_group_spec(kv_cache_config: KVCacheConfig | None) -> tuple[Any, list[str]]:
    if kv_cache_config is None:
        raise ConfigError("KVStoreConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"KVStoreConnector supports models with one KV-cache group; this one has "
            f"{len(groups)} (hybrid attention / Mamba models are not supported)"
        )
    spec = groups[0].kv_cache_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not isinstance(spec, FullAttentionSpec) or getattr(spec, "sliding_window", None):
        raise ConfigError(
            f"KVStoreConnector supports full attention only, got {type(spec).__name__} "
            "(sliding-window and chunked-local layers drop blocks the prefix cache needs)"
        )
    return spec, list(groups[0].layer_names)


def _layer_order(names: Sequence[str]) -> list[str]:
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return sorted(names, key=extract_layer_index)
    except Exception:  # noqa: BLE001 - names without an index: keep vLLM's order
        return list(names)


def engine_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> tuple[KVLayout, dict[str, object], str]:
    """The store layout that holds one vLLM page per layer, the namespace extras that pin the
    engine's page layout, and the page kind (``"cpu"`` or ``"flash"``)."""
    spec, names = _single_group_spec(kv_cache_config)
    pc = vllm_config.parallel_config
    if pc.tensor_parallel_size * pc.pipeline_parallel_size != 1:
        raise ConfigError(
            "KVStoreConnector supports tensor_parallel_size == pipeline_parallel_size == 1 "
            f"(got TP={pc.tensor_parallel_size}, PP={pc.pipeline_parallel_size})"
        )
    head_v = getattr(spec, "head_size_v", spec.head_size) or spec.head_size
    if head_v != spec.head_size:
        raise ConfigError("KVStoreConnector needs equal K and V head sizes")
    from vllm.platforms import current_platform

    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    extras: dict[str, object] = {
        "engine": "vllm",
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", "")),
        "cache_dtype": cache_dtype,
        "config": _config_digest(vllm_config),
    }
    if current_platform.is_cpu():
        kind = "cpu"
        extras["page_layout"] = PAGE_LAYOUT_CPU
        layout = KVLayout(num_layers=len(names), num_kv_heads=spec.num_kv_heads,
                          head_dim=2 * spec.head_size, dtype=spec.dtype,
                          block_tokens=spec.block_size, kv_planes=1)
    else:
        kind = "flash"
        extras["page_layout"] = PAGE_LAYOUT_FLASH
        layout = KVLayout(num_layers=len(names), num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_size, dtype=spec.dtype,
                          block_tokens=spec.block_size, kv_planes=2)
    return layout, extras, kind


# -- one store per process per (mode, place, namespace) -------------------------------------------
_shared_lock = threading.Lock()
_shared: dict[tuple, list] = {}  # key -> [store, refcount]


def _acquire_store(key: tuple, opener, *, reuse_only: bool = False) -> tuple[Any, bool]:  # noqa: ANN001
    """The process's store for ``key`` (opened by ``opener`` if there is none yet) and whether
    this call opened it. ``reuse_only``: return ``(None, False)`` instead of opening."""
    with _shared_lock:
        entry = _shared.get(key)
        opened = False
        if entry is None:
            if reuse_only:
                return None, False
            entry = _shared[key] = [opener(), 0]
            opened = True
        entry[1] += 1
        return entry[0], opened


def _release_store(key: tuple) -> None:
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _shared[key]
    try:
        entry[0].close()
    except Exception:  # noqa: BLE001
        log.exception("kvstore: closing the store failed")


@atexit.register
def _close_all() -> None:
    """Flush and close what is still open when the engine process exits."""
    with _shared_lock:
        entries = list(_shared.values())
        _shared.clear()
    for store, _ in entries:
        with contextlib.suppress(Exception):
            store.close()


def _runs(a: Sequence[int], b: Sequence[int]):
    """``(a_first, b_first, length)`` runs where both ``a`` and ``b`` are consecutive."""
    i, n = 0, len(a)
    while i < n:
        j = i + 1
        while j < n and a[j] == a[j - 1] + 1 and b[j] == b[j - 1] + 1:
            j += 1
        yield a[i], b[i], j - i
        i = j


# -- metadata (scheduler -> worker) ---------------------------------------------------------------
@dataclass(slots=True)
class BlockRun:
    """Consecutive blocks of one request: their keys and the vLLM pages that hold them."""

    req_id: str
    keys: list[bytes]
    parent: bytes | None  # key of the block before keys[0] (None: the chain's root)
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    namespace_id: bytes = b""
    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side bookkeeping for one request."""

    keys: KeyChain | None  # prompt's full blocks (None: not cacheable)
    prompt_len: int
    store_hit: int = 0  # leading blocks the store held at the last lookup
    local_blocks: int = 0  # blocks vLLM's own prefix cache had at the last lookup
    saved_upto: int = 0  # blocks [0, saved_upto) are in the store or queued to be saved
    block_ids: list[int] = field(default_factory=list)  # vLLM pages, group 0
    load: BlockRun | None = None  # planned by update_state_after_alloc, sent once


@dataclass(slots=True)
class _Load:
    """Worker-side: one request's fetch in flight this step."""

    run: BlockRun
    transfer: Any  # Transfer -> tensor of the blocks fetched (n <= planned)
    out: torch.Tensor  # [planned, L, P, T, H, D] staging slice the fetch writes
    ids: torch.Tensor  # vLLM page ids, one per planned block
    scattered: set[int] = field(default_factory=set)  # layers already in vLLM's pages


# -- the connector ---------------------------------------------------------------------------------
class KVStoreConnector(KVConnectorBase_V1):
    """kvstore as a vLLM v1 KV connector (see the module docstring and docs/vllm.md)."""

    if _CacheHitSource is not None:
        _cache_hit_source = _CacheHitSource.DISK

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(getattr(ktc, "kv_connector_extra_config", None))
        self.layout, self._ns_extras, self._page_kind = engine_layout(vllm_config, kv_cache_config)
        self.block_size = self.layout.block_tokens
        if vllm_config.cache_config.block_size != self.block_size:
            raise ConfigError(
                f"cache_config.block_size={vllm_config.cache_config.block_size} differs from the "
                f"KV cache spec's block size {self.block_size}"
            )
        self.model_id, self.model_revision = _model_identity(vllm_config, self.config)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kvstore: kv_load_failure_policy=%r: a block that cannot be loaded (evicted or "
                "damaged since the lookup) fails its request instead of being recomputed; set "
                "kv_load_failure_policy='recompute' in KVTransferConfig",
                getattr(ktc, "kv_load_failure_policy", None),
            )
        self._is_scheduler = role == KVConnectorRole.SCHEDULER
        self._store_key: tuple | None = None
        self.store = self._open_store()
        self.namespace_id: bytes = bytes(self.store.namespace_id)
        self.counters: dict[str, int] = {
            "lookups": 0, "lookup_tokens": 0, "hit_tokens": 0, "hit_requests": 0,
            "loads": 0, "load_blocks": 0, "loaded_blocks": 0, "failed_blocks": 0,
            "saves": 0, "save_blocks": 0, "save_errors": 0, "skipped_saves": 0,
            "layer_waits": 0,
            # microseconds spent on the engine's critical path
            "lookup_us": 0, "load_submit_us": 0, "load_wait_us": 0, "save_us": 0,
        }
        self._stats_dirty = False
        self._closed = False
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        # worker side
        self._pages: list[torch.Tensor] | None = None
        self._layer_index: dict[str, int] = {}
        self._loading: list[_Load] = []  # this step's fetches
        self._buf: torch.Tensor | None = None
        self._geo: Any = None
        lw = self.config.layerwise
        self._layerwise = (self._page_kind != "cpu") if lw is None else bool(lw)
        self._direct = False  # set by register_kv_caches
        self._blocks: torch.Tensor | None = None  # the warm slab as [slots, L, P, T, H, D]
        self._failed_reqs: set[str] = set()
        self._load_errors: set[int] = set()
        self._puts: list[Any] = []  # transfers of recent puts (errors are logged)
        log.info(
            "kvstore connector (%s, %s mode) for %s: layout %s, namespace %s",
            "scheduler" if self._is_scheduler else "worker", self.config.mode, self.model_id,
            self.layout, self.namespace_id.hex()[:16],
        )

    # -- store ----------------------------------------------------------------------------------
    def _open_store(self) -> Any:
        c = self.config
        kw = dict(layout=self.layout, model_id=self.model_id, model_revision=self.model_revision,
                  namespace_extras=self._ns_extras)
        if c.mode == "daemon":
            from kvstore.client import connect

            device = "cpu" if self._is_scheduler or self._page_kind == "cpu" else None
            ckw: dict[str, Any] = {}
            for name in ("warm_capacity", "salt_policy", "timeout"):
                if getattr(c, name) is not None:
                    ckw[name] = getattr(c, name)
            key = ("daemon", os.path.abspath(os.path.expanduser(c.socket or "")),
                   self.layout, self.model_id, self.model_revision,
                   tuple(sorted(self._ns_extras.items())), device)
            self._store_key = key
            return _acquire_store(key, lambda: connect(c.socket, device=device, **kw, **ckw))[0]
        from kvstore.store import open_store

        okw: dict[str, Any] = {}
        for name in ("cpu_capacity", "disk_capacity", "admission", "disk_codec"):
            if getattr(c, name) is not None:
                okw[name] = getattr(c, name)
        if self._page_kind == "cpu" or self._is_scheduler:
            device = "cpu"
            # a scheduler-only store answers lookups: memory, then the shared disk index
        else:
            device = None
            if c.gpu_capacity is not None:
                okw["gpu_capacity"] = c.gpu_capacity
        path = os.path.abspath(os.path.expanduser(c.store_path)) if c.store_path else None
        key = ("embedded", path, self.layout, self.model_id, self.model_revision,
               tuple(sorted(self._ns_extras.items())))
        if self._is_scheduler:
            # In one process with the worker (vLLM creates the worker's connector first):
            # share its store. Alone (vLLM's scheduler/worker process split) the scheduler only
            # answers lookups, from the disk index the worker's process writes: a warm tier of
            # a few blocks is all it needs.
            store, _ = _acquire_store(key, None, reuse_only=True)
            if store is not None:
                self._store_key = key
                return store
            key = (*key, "lookup-only")
            if path is not None:
                okw["cpu_capacity"] = 16 * self.layout.block_nbytes
        self._store_key = key
        store, opened = _acquire_store(key, lambda: open_store(path, device=device, **kw, **okw))
        if opened and not self._is_scheduler:
            self._prefault(store)
        return store

    def _prefault(self, store: Any) -> None:
        """Touch the first ``prefault`` bytes of a freshly opened store's warm tier.

        Its slab is allocated lazily: the first copy into each page faults it in (about
        17 ms per 32 MiB here), which would land on the first loads after a restart. Slots
        are handed out from the start of the slab, and nothing uses a store that was just
        opened, so zeroing its first rows now is safe.
        """
        from kvstore.sizes import parse_size

        want = parse_size(self.config.prefault if self.config.prefault is not None else "1GiB",
                          what="prefault")
        slab = getattr(store, "warm_slab", None)
        if not want or slab is None or not slab.numel():
            return
        rows = min(slab.shape[0], -(-want // slab.shape[1]))
        t0 = time.perf_counter()
        slab[:rows].zero_()
        log.info("kvstore: pre-faulted %d MiB of the warm tier in %.0f ms",
                 rows * slab.shape[1] >> 20, (time.perf_counter() - t0) * 1e3)

    def _count(self, **inc: int) -> None:
        for k, v in inc.items():
            self.counters[k] += v
        self._stats_dirty = True

    def _write_stats(self, force: bool = False) -> None:
        if not self.config.stats_path or not (self._stats_dirty or force):
            return
        self._stats_dirty = False
        role = "scheduler" if self._is_scheduler else "worker"
        d = Path(self.config.stats_path)
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".{role}-{os.getpid()}.json.tmp"
            tmp.write_text(json.dumps({"role": role, "pid": os.getpid(),
                                       "mode": self.config.mode, **self.counters}))
            os.replace(tmp, d / f"{role}-{os.getpid()}.json")
        except OSError as e:  # stats are a diagnostic, never a failure
            log.debug("kvstore: could not write stats: %s", e)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finish_puts(wait=True)
        self._write_stats(force=True)
        if self._store_key is not None:
            _release_store(self._store_key)
            self._store_key = None

    # ============================== scheduler side ==============================================
    def _request_keys(self, request: Request) -> KeyChain | None:
        tokens = getattr(request, "prompt_token_ids", None)
        if tokens is None or getattr(request, "prompt_embeds", None) is not None:
            return None
        if getattr(request, "mm_features", None):
            return None  # multimodal inputs are not part of the key: never share their KV
        extras = None
        lora = getattr(request, "lora_request", None)
        n_full = len(tokens) // self.block_size
        if lora is not None and n_full:
            tag = (f"lora\0{getattr(lora, 'lora_name', '')}\0{getattr(lora, 'lora_path', '')}"
                   f"\0{getattr(lora, 'lora_int_id', '')}").encode()
            extras = [tag] + [None] * (n_full - 1)
        salt = getattr(request, "cache_salt", None) or None
        return self.store.block_keys(tokens, salt, extras=extras)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        t0 = time.perf_counter()
        try:
            return self._match(request, num_computed_tokens)
        finally:
            self._count(lookup_us=int((time.perf_counter() - t0) * 1e6))

    def _match(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            try:
                keys = self._request_keys(request)
            except Exception:  # noqa: BLE001 - a request we cannot key is just not cached
                log.exception("kvstore: could not key request %s", request.request_id)
                keys = None
            prompt = getattr(request, "prompt_token_ids", None) or []
            st = self._reqs[request.request_id] = _ReqState(keys, len(prompt))
        st.load = None
        if st.keys is None:
            return 0, False
        bs = self.block_size
        # never the whole prompt: vLLM must compute at least its last token
        claimable = max(0, (st.prompt_len - 1) // bs)
        try:
            n = self.store.lookup(st.keys[:claimable]) if claimable else 0
        except Exception:  # noqa: BLE001 - the store failing is a miss, not an engine error
            log.exception("kvstore: lookup failed")
            n = 0
        st.store_hit = n
        st.saved_upto = n
        st.local_blocks = num_computed_tokens // bs
        self._count(lookups=1, lookup_tokens=st.prompt_len)
        if num_computed_tokens % bs:
            return 0, False
        ext = n * bs - num_computed_tokens
        if ext <= 0:
            return 0, False
        return ext, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.keys is None:
            return
        st.load = None
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        first = st.local_blocks  # vLLM's own hit, as passed to get_num_new_matched_tokens
        count = num_external_tokens // bs
        if num_external_tokens % bs or first + count > min(len(block_ids), len(st.keys)):
            log.warning("kvstore: request %s: load plan does not fit its blocks; skipped",
                        request.request_id)
            return
        st.load = BlockRun(
            request.request_id, list(st.keys[first:first + count]),
            st.keys[first - 1] if first else None, block_ids[first:first + count],
        )
        self._count(hit_requests=1, hit_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(namespace_id=self.namespace_id)
        nsched = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None or st.keys is None:
                continue
            st.block_ids = list(new.block_ids[0]) if new.block_ids else []
            if st.load is not None:
                meta.loads.append(st.load)
                st.load = None
            self._plan_save(meta, new.req_id, st, new.num_computed_tokens + nsched.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None or st.keys is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            if st.load is not None:
                meta.loads.append(st.load)
                st.load = None
            self._plan_save(meta, req_id, st, cached.num_computed_tokens[i] + nsched.get(req_id, 0))
        self._skip_zeroing(scheduler_output, meta)
        self._write_stats()
        return meta

    @staticmethod
    def _skip_zeroing(scheduler_output: SchedulerOutput, meta: KVStoreConnectorMetadata) -> None:
        """vLLM zeroes every newly allocated page before the step; the pages this step loads
        are overwritten whole (a page that fails to load is reported and recomputed whole),
        so they need no zeroing. vLLM allows a synchronous loader this one edit."""
        zero = getattr(scheduler_output, "new_block_ids_to_zero", None)
        if not zero or not meta.loads:
            return
        loaded = {b for run in meta.loads for b in run.block_ids}
        scheduler_output.new_block_ids_to_zero = [b for b in zero if b not in loaded] or None

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, st: _ReqState,
                   done_tokens: int) -> None:
        assert st.keys is not None
        done = min(done_tokens, st.prompt_len) // self.block_size
        done = min(done, len(st.keys), len(st.block_ids))
        start = st.saved_upto
        if done <= start:
            return
        meta.saves.append(BlockRun(req_id, list(st.keys[start:done]),
                                   st.keys[start - 1] if start else None,
                                   st.block_ids[start:done]))
        st.saved_upto = done

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        # blocks that failed to load are recomputed by vLLM: save them again afterwards
        for st in self._reqs.values():
            for i, b in enumerate(st.block_ids):
                if b in bad:
                    st.saved_upto = min(st.saved_upto, i)
                    st.store_hit = min(st.store_hit, i)
                    break

    def request_finished(
        self, request: Request, block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    # ============================== worker side =================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = _layer_order(list(kv_caches))
        if len(names) != self.layout.num_layers:
            raise ConfigError(
                f"vLLM registered {len(names)} KV-cache layers, the layout has "
                f"{self.layout.num_layers}"
            )
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._pages = [self._page_view(n, kv_caches[n]) for n in names]
        self._geo = paged_geometry(self.layout, self._pages)
        slab = self.store.warm_slab if isinstance(self.store, ZeroCopy) else None
        self._direct = self._page_kind == "cpu" and slab is not None and slab.numel() > 0
        if self._direct:
            lay = self.layout
            self._blocks = slab.view(lay.dtype).view(slab.shape[0], *lay.block_shape)
            return
        # fault the staging buffer in now, not on the first load: up to max_model_len tokens
        # of blocks, at most 256 MiB (it grows on demand past that)
        max_len = int(getattr(self._vllm_config.model_config, "max_model_len", 0) or 0)
        blocks = min(max_len // self.block_size, (256 << 20) // self.layout.block_nbytes)
        if blocks > 0:
            self._staging(blocks).zero_()

    def _page_view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if t.dtype != lay.dtype:
            raise ConfigError(f"KV cache {name} has dtype {t.dtype}, the layout {lay.dtype}")
        if self._page_kind == "cpu":
            H, bs, D2 = lay.num_kv_heads, lay.block_tokens, lay.head_dim
            if t.dim() != 4 or tuple(t.shape[1:]) != (H, bs, D2):
                raise ConfigError(
                    f"KV cache {name} has shape {tuple(t.shape)}; the vllm-cpu page layout is "
                    f"[num_blocks, {H}, {bs}, {D2}]"
                )
            if t.stride()[1:] != (bs * D2, D2, 1):
                raise ConfigError(f"KV cache {name}: pages are not contiguous {t.stride()}")
            # the same bytes, relabelled [num_blocks, block_size, H, 2*D]: pages stay whole
            return t.as_strided((t.shape[0], bs, H, D2), (t.stride(0), H * D2, D2, 1))
        H, bs, D = lay.num_kv_heads, lay.block_tokens, lay.head_dim
        if t.dim() != 5 or t.shape[0] != 2 or tuple(t.shape[2:]) != (bs, H, D):
            raise ConfigError(
                f"KV cache {name} has shape {tuple(t.shape)}; expected the flash layout "
                f"[2, num_blocks, {bs}, {H}, {D}]"
            )
        return t

    def _chain(self, run: BlockRun) -> KeyChain:
        return KeyChain(run.keys, self.namespace_id, run.parent)

    def _staging(self, nblocks: int) -> torch.Tensor:
        """A reusable host buffer for this step's fetched blocks (grown on demand)."""
        lay = self.layout
        buf = self._buf
        if buf is None or buf.shape[0] < nblocks:
            dev = self._pages[0].device if self._pages else torch.device("cpu")
            buf = self._buf = torch.empty(lay.batch_shape(max(nblocks, 8)), dtype=lay.dtype,
                                          device=dev)
        return buf

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._start_loads()
        finally:
            self._count(load_submit_us=int((time.perf_counter() - t0) * 1e6))

    def _start_loads(self) -> None:
        meta = self._meta()
        if meta is None or not meta.loads or self._pages is None:
            return
        if meta.namespace_id and meta.namespace_id != self.namespace_id:
            log.error("kvstore: scheduler and worker namespaces differ (%s vs %s); not loading",
                      meta.namespace_id.hex()[:16], self.namespace_id.hex()[:16])
            for run in meta.loads:
                self._fail(run, 0)
            return
        if self._direct:
            for run in meta.loads:
                self._load_direct(run)
            return
        # One fetch per request into a slice of the staging buffer: the copy engine reads
        # disk blocks straight into it and copies memory blocks layer by layer; each layer is
        # scattered into vLLM's pages when the forward reaches it (wait_for_layer_load).
        buf = self._staging(sum(len(r.keys) for r in meta.loads))
        off = 0
        for run in meta.loads:
            n = len(run.keys)
            out = buf[off:off + n]
            off += n
            try:
                ids = page_index(run.block_ids, n, self._geo)
                t = self.store.fetch(self._chain(run), out=out)
            except Exception:  # noqa: BLE001 - never raise into the engine: recompute instead
                log.exception("kvstore: fetch failed for request %s", run.req_id)
                self._fail(run, 0)
                continue
            self._loading.append(_Load(run, t, out, ids))
            self._count(loads=1, load_blocks=n)
        if not self._layerwise:  # everything in place before the forward starts
            for ld in self._loading:
                with contextlib.suppress(Exception):  # a failure is reported in _finish_loads
                    ld.transfer.wait()
                for layer in range(self.layout.num_layers):
                    self._scatter(ld, layer)

    # -- direct path: an embedded store and vLLM's CPU pages ---------------------------------------
    # The store's warm slab and vLLM's pages are both host memory: a load leases the blocks'
    # warm slots (disk blocks are read into them first) and copies each layer straight into
    # the pages; a save reserves warm slots (grant_put), gathers the pages into them and
    # commits. One copy each way, all on this thread: the store's copy threads stay idle, so
    # they never compete with the forward's OpenMP threads (on 2 cores a torch copy on a second
    # thread gives OpenMP a second thread pool, and every parallel region of the forward then
    # pays for waking its threads: measured ~4 ms per step here).
    def _copy_blocks(self, slots: Sequence[int], page_ids: Sequence[int], *, load: bool) -> None:
        blocks, pages, L = self._blocks, self._pages, self.layout.num_layers
        assert pages is not None
        runs = list(_runs(slots, page_ids))
        if len(runs) <= 8:
            for layer in range(L):
                pg = pages[layer]
                for s0, p0, k in runs:
                    if load:
                        pg[p0:p0 + k].copy_(blocks[s0:s0 + k, layer, 0])
                    else:
                        blocks[s0:s0 + k, layer, 0].copy_(pg[p0:p0 + k])
            return
        st = torch.tensor(list(slots), dtype=torch.int64)
        pt = torch.tensor(list(page_ids), dtype=torch.int64)
        for layer in range(L):
            pg = pages[layer]
            if load:
                pg.index_copy_(0, pt, blocks[st, layer, 0])
            else:
                blocks[st, layer, 0] = pg.index_select(0, pt)

    def _load_direct(self, run: BlockRun) -> None:
        got: list = []
        n = 0
        try:
            got, slots = self.store.lease_warm(self._chain(run))
            n = len(got)
            if n:
                self._copy_blocks(slots, run.block_ids[:n], load=True)
        except Exception:  # noqa: BLE001 - never raise into the engine: recompute instead
            log.exception("kvstore: loading request %s failed", run.req_id)
            n = 0
        finally:
            if got:
                self.store.release_lease(got)
        self._count(loads=1, load_blocks=len(run.keys), loaded_blocks=n)
        if n < len(run.keys):
            self._fail(run, n)

    def _save_direct(self, run: BlockRun) -> None:
        chain = self._chain(run)
        grant = self.store.grant_put(chain)
        if grant.keys:
            try:
                self._copy_blocks(grant.slots, [run.block_ids[p] for p in grant.positions],
                                  load=False)
            except BaseException:
                self.store.abort_put(grant)
                raise
            self.store.commit_put(grant)
        elif grant.duplicates < len(run.keys):
            # nothing granted: no room, or the chain's parent is only on disk (grant_put
            # accepts a parent held in memory only); the regular put handles both
            self._puts.append(self.store.save_from(self._pages, run.block_ids, chain))
        self._count(saves=1, save_blocks=len(grant.keys))

    def _meta(self) -> KVStoreConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVStoreConnectorMetadata) else None

    def _fail(self, run: BlockRun, loaded: int) -> None:
        bad = run.block_ids[loaded:]
        self._load_errors.update(bad)
        self._failed_reqs.add(run.req_id)
        self._count(failed_blocks=len(bad))
        log.warning("kvstore: request %s: %d of %d blocks could not be loaded; vLLM recomputes "
                    "them", run.req_id, len(bad), len(run.block_ids))

    def _scatter(self, ld: _Load, layer: int) -> None:
        if layer in ld.scattered:
            return
        ld.scattered.add(layer)
        try:
            ld.transfer.wait_layer(layer)
        except Exception:  # noqa: BLE001 - the fetch failed: reported in _finish_loads
            return
        n = len(ld.run.keys)
        if ld.transfer.done():
            try:
                n = int(ld.transfer.wait().shape[0])
            except Exception:  # noqa: BLE001
                return
        # While the fetch is still running its final length is unknown: every planned page of
        # this layer is written then, and pages past the valid run (a short fetch) are
        # reported as load errors, so vLLM recomputes them before anything reads them.
        if n:
            scatter_pages(self.layout, self._geo, ld.out[:n, layer], self._pages[layer],
                          ld.ids[:n])

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loading:
            return
        t0 = time.perf_counter()
        i = self._layer_index.get(layer_name)
        if i is None:  # not a layer we know: make sure everything is in place
            for ld in self._loading:
                for layer in range(self.layout.num_layers):
                    self._scatter(ld, layer)
        else:
            for ld in self._loading:
                self._scatter(ld, i)
        self._count(layer_waits=1, load_wait_us=int((time.perf_counter() - t0) * 1e6))

    def _finish_loads(self) -> None:
        loading, self._loading = self._loading, []
        for ld in loading:
            for layer in range(self.layout.num_layers):  # layers the forward did not wait for
                self._scatter(ld, layer)
            try:
                n = int(ld.transfer.wait().shape[0])
            except Exception:  # noqa: BLE001
                log.exception("kvstore: a load failed for request %s", ld.run.req_id)
                n = 0
            self._count(loaded_blocks=n)
            if n < len(ld.run.keys):
                self._fail(ld.run, n)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Saving gathers whole blocks of every layer once the step's forward is done
        # (wait_for_save): the pages hold them then, and one gather + one put per request
        # costs less than per-layer bookkeeping on the forward's critical path.
        return

    def wait_for_save(self) -> None:
        t0 = time.perf_counter()
        if self._loading:
            self._finish_loads()  # a load must be complete (or reported) before anything else
            t1 = time.perf_counter()
            self._count(load_wait_us=int((t1 - t0) * 1e6))
            t0 = t1
        self._save()
        self._count(save_us=int((time.perf_counter() - t0) * 1e6))
        self._write_stats()

    def _save(self) -> None:
        meta = self._meta()
        if meta is not None and meta.saves and self._pages is not None:
            for run in meta.saves:
                if run.req_id in self._failed_reqs:
                    # this step attended over blocks that did not load: its KV is wrong
                    self._count(skipped_saves=1)
                    continue
                try:
                    if self._direct:
                        self._save_direct(run)
                        continue
                    self._puts.append(self.store.save_from(self._pages, run.block_ids,
                                                           self._chain(run)))
                    self._count(saves=1, save_blocks=len(run.keys))
                except Exception:  # noqa: BLE001 - a lost save is a later miss, not an error
                    log.exception("kvstore: saving %d blocks of request %s failed",
                                  len(run.keys), run.req_id)
                    self._count(save_errors=1)
        self._failed_reqs.clear()
        self._finish_puts(wait=False)

    def _finish_puts(self, wait: bool) -> None:
        keep = []
        for t in self._puts:
            if not wait and not t.done():
                keep.append(t)
                continue
            try:
                t.wait()
            except Exception as e:  # noqa: BLE001
                self._count(save_errors=1)
                log.warning("kvstore: a put failed: %s", e)
        self._puts = keep

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # loads are waited for layer by layer inside the forward

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The connector's counters (also written to ``stats_path`` when configured)."""
        return dict(self.counters)
