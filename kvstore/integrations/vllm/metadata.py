"""What the scheduler side sends the worker side each step (vLLM's connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.hints import PutHint, hint_of

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    except ImportError:  # no vLLM (the main test interpreter): the plan is plain data still
        KVConnectorMetadata = object
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    except ImportError:  # no vLLM, or one without the worker -> scheduler channel
        KVConnectorWorkerMetadata = object

__all__ = ["BlockRun", "KVStoreConnectorMetadata", "KVStoreWorkerMetadata", "Located"]


#: where the scheduler found a load's blocks below memory, relative to ``BlockRun.keys``:
#: (first position, tier name, the tier's handles: the disk's index records), plain data
Located = list[tuple[int, str, list[bytes]]]


@dataclass(slots=True)
class BlockRun:
    """Consecutive blocks of one request: their keys and the vLLM pages that hold them; for
    a load, what the scheduler's lookup located below memory (the worker reads with it
    instead of locating the blocks again; empty: the worker locates them)."""

    req_id: str
    keys: list[bytes]
    parent: bytes | None  # key of the block before keys[0] (None: the chain's root)
    block_ids: list[int]
    located: Located = field(default_factory=list)
    # a save: the pages loaded before this step's forward that the request's blocks attend
    # over (its own, or another request's shared through vLLM's prefix cache in the same
    # step); the worker drops the save when any of them failed to load
    attends: list[int] = field(default_factory=list)
    # a save's put hint (kvstore.hints.PutHint), from the request's kv_transfer_params
    session: str | None = None
    priority: int = 0

    @property
    def hint(self) -> PutHint | None:
        """The put hint of a save (None: none)."""
        return hint_of(self.session, self.priority)


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


@dataclass
class KVStoreWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker side sends the scheduler side after a step: ``loads``, the step's
    loads that read blocks below memory as (seconds, such blocks), which the scheduler's
    :class:`~kvstore.integrations.vllm.load_cost.LoadCost` weighs the next hits with. vLLM
    aggregates the TP ranks' metadata into one (their samples, side by side)."""

    loads: list[tuple[float, int]] = field(default_factory=list)

    def aggregate(self, other: KVStoreWorkerMetadata) -> KVStoreWorkerMetadata:
        return KVStoreWorkerMetadata(self.loads + list(getattr(other, "loads", ())))
