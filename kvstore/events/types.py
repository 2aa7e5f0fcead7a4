"""KV cache events as typed values: vLLM's schema (``vllm/distributed/kv_events.py``).

A batch (``KVEventBatch``) carries a timestamp and a list of events: ``BlockStored`` (a run of
blocks, each the parent of the next, hanging off ``parent_block_hash``), ``BlockRemoved`` and
``AllBlocksCleared``. kvstore publishes its 32-byte block keys as the block hashes and the
tier as the medium; other publishers (vLLM itself) may use 64-bit integers as hashes, which
decode here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

#: a block's hash on the wire: kvstore's 32-byte keys, or vLLM's 64-bit integers
BlockHash: TypeAlias = bytes | int

#: vLLM's medium names (``MEDIUM_GPU`` ...), which kvstore's tiers are published as
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"

#: kvstore tier -> medium: the hot tier lives on the engine's device, warm in host memory,
#: disk on storage. The remote tier has no events (Redis evicts on its own, unannounced).
TIER_MEDIUM: dict[str, str] = {"hot": MEDIUM_GPU, "warm": MEDIUM_CPU, "disk": MEDIUM_STORAGE}


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now held in ``medium``: ``block_hashes[i]`` is the parent of ``[i + 1]`` and
    ``parent_block_hash`` the parent of the first (``None``: a prompt's first block)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]  # empty from kvstore: its keys already cover the tokens
    block_size: int  # tokens per block
    medium: str | None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer held in ``medium`` (``None``: in any medium)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The publisher holds nothing (it started, or dropped everything)."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events in the order they happened, stamped with the publisher's wall clock."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = 0
