"""What the scheduler side sends the worker side each step (vLLM's connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["BlockRun", "KVStoreConnectorMetadata"]


@dataclass(slots=True)
class BlockRun:
    """Consecutive blocks of one request: their keys and the vLLM pages that hold them."""

    req_id: str
    keys: list[bytes]
    parent: bytes | None  # key of the block before keys[0] (None: the chain's root)
    block_ids: list[int]


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan: the runs to load into vLLM's pages before the forward, the runs to
    load in the background (their requests wait in ``WAITING_FOR_REMOTE_KVS`` until the worker
    reports them in ``get_finished``) and the runs to save once the forward is done, in the
    scheduler's namespace (the worker refuses another). ``idle``: the step runs no tokens
    (only background loads are in flight), so the worker may wait a little for them."""

    namespace_id: bytes = b""
    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)
    async_loads: list[BlockRun] = field(default_factory=list)
    idle: bool = False
