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

One module per part:

- :mod:`.connector`: :class:`KVStoreConnector`, vLLM's interface; it hands each call to the
  object of its role;
- :mod:`.scheduler`: ``SchedulerSide``: request keys, matching against the store, the
  per-step load and save plan (:mod:`.metadata`: :class:`KVStoreConnectorMetadata`);
- :mod:`.worker`: ``WorkerSide``: vLLM's pages, loads (direct from warm slots, or fetched and
  scattered), saves, load errors;
- :mod:`.config`: :class:`ConnectorConfig` (``kv_connector_extra_config``), the model's
  identity and :func:`engine_layout`, the store layout of vLLM's pages;
- :mod:`.store_registry`: one store per process per namespace, shared and reference counted;
- :mod:`.stats`: the counters a connector writes under ``stats_path`` and :func:`read_stats`.

Limits: one KV-cache group of full attention (no sliding window, no hybrid/Mamba models),
tensor and pipeline parallel size 1, token prompts (requests with multimodal inputs or
prompt embeddings are neither looked up nor saved), prompt blocks only (generated tokens are
not saved).

Importing this package does not import vLLM; the names that need it
(:class:`KVStoreConnector`, :class:`KVStoreConnectorMetadata`, :class:`BlockRun`) load it on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    PAGE_LAYOUT_CPU,
    PAGE_LAYOUT_FLASH,
    ConnectorConfig,
    engine_layout,
    kvstore_transfer,
    weights_fingerprint,
)
from .stats import flush_stats, read_stats

if TYPE_CHECKING:
    from .connector import KVStoreConnector
    from .metadata import BlockRun, KVStoreConnectorMetadata

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "PAGE_LAYOUT_CPU",
    "PAGE_LAYOUT_FLASH",
    "BlockRun",
    "ConnectorConfig",
    "KVStoreConnector",
    "KVStoreConnectorMetadata",
    "engine_layout",
    "flush_stats",
    "kvstore_transfer",
    "read_stats",
    "weights_fingerprint",
]

#: names that import vLLM, and the submodule each comes from
_LAZY = {
    "KVStoreConnector": ".connector",
    "KVStoreConnectorMetadata": ".metadata",
    "BlockRun": ".metadata",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
