"""``KVStoreConnector``: vLLM's ``KVConnectorBase_V1`` interface over kvstore.

vLLM makes one connector per role: in the scheduler (``KVConnectorRole.SCHEDULER``) and in
each worker (``KVConnectorRole.WORKER``). Both derive the same configuration, layout and
namespace and get the process's store (:mod:`.store_registry`); the role's calls go to a
:class:`~.scheduler.SchedulerSide` or a :class:`~.worker.WorkerSide`. Calling a method of the
other role is a programming error (vLLM never does) and raises ``RuntimeError``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.api import KVCache
from kvstore.errors import ConfigError
from kvstore.namespace import Namespace

from .config import ConnectorConfig, engine_layout, model_identity, tp_rank_size
from .metadata import KVStoreConnectorMetadata, KVStoreWorkerMetadata
from .scheduler import SchedulerSide, kv_role_sides
from .stats import ConnectorStats
from .store_registry import open_connector_store, release_store
from .worker import WorkerSide

try:  # vLLM >= 0.11 labels external hits by tier
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    _CacheHitSource = None

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector"]

log = logging.getLogger("vllm.kvstore")


class KVStoreConnector(KVConnectorBase_V1):
    """kvstore as a vLLM v1 KV connector (see :mod:`kvstore.integrations.vllm` and
    docs/vllm.md)."""

    if _CacheHitSource is not None:
        _cache_hit_source = _CacheHitSource.DISK

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(getattr(ktc, "kv_connector_extra_config", None))
        self.layout, ns_extras, page_kind = engine_layout(vllm_config, kv_cache_config)
        self.block_size = self.layout.block_tokens
        if vllm_config.cache_config.block_size != self.block_size:
            raise ConfigError(
                f"cache_config.block_size={vllm_config.cache_config.block_size} differs from the "
                f"KV cache spec's block size {self.block_size}"
            )
        self.model_id, self.model_revision = model_identity(vllm_config, self.config)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kvstore: kv_load_failure_policy=%r: a block that cannot be loaded (evicted or "
                "damaged since the lookup) fails its request instead of being recomputed; set "
                "kv_load_failure_policy='recompute' in KVTransferConfig",
                getattr(ktc, "kv_load_failure_policy", None),
            )
        is_scheduler = role == KVConnectorRole.SCHEDULER
        role_name = "scheduler" if is_scheduler else "worker"
        self.tp_rank, self.tp_size = tp_rank_size(vllm_config, is_scheduler)
        if self.tp_size > 1 and self.config.mode == "embedded" and not self.config.store_path:
            raise ConfigError(
                f"KVStoreConnector with tensor_parallel_size={self.tp_size} needs a store the "
                "scheduler and every rank's worker process reach: set 'store_path' or 'socket' "
                "in kv_connector_extra_config (a memory-only store is per process)"
            )
        self.store: KVCache
        self.store, key = open_connector_store(
            self.config, layout=self.layout, model_id=self.model_id,
            model_revision=self.model_revision, ns_extras=ns_extras, page_kind=page_kind,
            is_scheduler=is_scheduler, tp_rank=self.tp_rank, tp_size=self.tp_size,
        )
        self._store_key: tuple | None = key
        self.namespace_id: bytes = bytes(self.store.namespace_id)
        # the scheduler keys requests in rank 0's namespace; every worker checks the plan's
        # namespace against it and maps the keys to its own rank's (config.rank_keys)
        self.plan_namespace_id: bytes = bytes(Namespace.create(
            self.model_id, self.layout, model_revision=self.model_revision, tp_rank=0,
            tp_size=self.tp_size, extras=ns_extras).id)
        self._stats = ConnectorStats(role_name, self.config.mode, self.config.stats_path)
        self.counters: dict[str, int] = self._stats.counters
        self._closed = False
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if is_scheduler:
            self._scheduler = SchedulerSide(
                self.store, block_size=self.block_size, namespace_id=self.namespace_id,
                stats=self._stats, save_decode_blocks=self.config.save_decode_blocks,
                load_async=self.config.load_async, **kv_role_sides(ktc))
        else:
            lw = self.config.layerwise
            self._worker = WorkerSide(
                self.store, layout=self.layout, namespace_id=self.namespace_id,
                plan_namespace_id=self.plan_namespace_id, tp_rank=self.tp_rank,
                page_kind=page_kind, layerwise=(page_kind != "cpu") if lw is None else bool(lw),
                max_model_len=int(getattr(vllm_config.model_config, "max_model_len", 0) or 0),
                stats=self._stats, load_timeout=self.config.load_timeout,
            )
        log.info(
            "kvstore connector (%s, %s mode) for %s: layout %s, namespace %s%s",
            role_name, self.config.mode, self.model_id, self.layout, self.namespace_id.hex()[:16],
            f" (TP rank {self.tp_rank} of {self.tp_size})" if self.tp_size > 1 else "",
        )

    # -- the role objects ------------------------------------------------------------------------
    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker's KVStoreConnector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call on the scheduler's KVStoreConnector")
        return self._worker

    def _meta(self) -> KVStoreConnectorMetadata | None:
        """The metadata vLLM bound for this step, if it is ours."""
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVStoreConnectorMetadata) else None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.close()
        self._stats.write(force=True)
        if self._store_key is not None:
            release_store(self._store_key)
            self._store_key = None

    # ============================== scheduler side ==============================================
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int,
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int],
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    # ============================== worker side =================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # Saving gathers whole blocks of every layer once the step's forward is done
        # (wait_for_save): the pages hold them then, and one gather + one put per request
        # costs less than per-layer bookkeeping on the forward's critical path.
        return

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._meta())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVStoreWorkerMetadata | None:
        # this step's loads from below memory, for the scheduler's LoadCost (load_cost.py)
        samples = self.worker_side.load_samples
        if not samples:
            return None
        out = [samples.popleft() for _ in range(len(samples))]  # the loader thread appends
        return KVStoreWorkerMetadata(out)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # saves finish within the step (nothing to report); background loads that are done
        # (or failed: their blocks are in get_block_ids_with_load_errors this same step)
        return None, self.worker_side.get_finished(self._meta())

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
