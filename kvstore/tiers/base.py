"""The contract of the tiers below memory (disk, remote) and what they share.

A lower tier holds verified copies of blocks outside the process's memory. The store keeps
a list of them, fastest first, and asks each in turn for the stretch the ones before it
lack. Every method below is what the store calls; bad data is never raised: a block that is
absent, unreachable or damaged is a :class:`ReadStatus`, counted by the tier. Disk and remote
tiers serve many namespaces; ``bind(namespace_id)`` gives the view of one that the store keeps.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvstore.errors import TensorMismatchError
from kvstore.keys import KEY_BYTES, check_key
from kvstore.stats import TierStats

if TYPE_CHECKING:
    import torch


__all__ = ["KEY_BYTES", "BlockWrite", "Located", "LowerTier", "ReadStatus", "StagedWrites",
           "as_byte_tensor", "check_key"]


class ReadStatus(enum.Enum):
    """What one block's read gave: only ``OK`` means the destination holds its bytes."""

    OK = "ok"
    MISSING = "missing"  # not held (or its file / node is gone)
    DAMAGED = "damaged"  # short read, checksum mismatch, undecodable payload or record


@dataclass(frozen=True, slots=True)
class Located:
    """The leading run of keys a lower tier holds, with what it found for reading them.

    ``handles`` are the tier's own (the disk's index records; nothing for the remote tier),
    so ``read(locate(keys))`` needs no second index transaction.
    """

    keys: tuple[bytes, ...]
    handles: tuple[object, ...] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def pick(self, idx: Sequence[int]) -> Located:
        """The blocks at positions ``idx`` of this run, in that order."""
        keys = tuple(self.keys[i] for i in idx)
        if self.handles is None:
            return Located(keys)
        return Located(keys, tuple(self.handles[i] for i in idx))


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """One block for a lower tier: its key, its parent in the chain, its raw bytes."""

    key: bytes
    parent: bytes | None
    data: torch.Tensor  # CPU uint8, one block's raw bytes


@runtime_checkable
class LowerTier(Protocol):
    """A tier below memory, bound to one namespace's key space (see docs/architecture.md).

    ``name`` is the tier's :class:`kvstore.api.Tier` value; ``volatile`` tiers may lose a
    block between ``locate`` and ``read`` without that being damage (a Redis TTL), and are
    never the store's durable copy.
    """

    name: str
    volatile: bool

    def locate(self, keys: Sequence[bytes]) -> Located:
        """The leading ``keys`` the tier holds (one transaction / one round trip)."""
        ...

    def read(self, found: Located, dsts: Sequence[torch.Tensor],
             mirrors: Sequence[torch.Tensor | None] | None = None) -> list[ReadStatus]:
        """Read and verify ``found``'s blocks into ``dsts`` (CPU uint8, one block each; the
        disk tier also takes, per block, a sequence of host buffers that receive its bytes in
        order, e.g. one engine page per layer), and into ``mirrors[i]`` too where given; one
        status each."""
        ...

    def write(self, items: Sequence[BlockWrite]) -> None:
        """Store ``items`` (raises :class:`kvstore.errors.KVStoreError` if not done)."""
        ...

    def delete(self, keys: Sequence[bytes] | None,
               keep: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Remove ``keys`` (``None``: all of the namespace's) except those ``keep`` names;
        returns the keys that went."""
        ...

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` used now (the tier's eviction order)."""
        ...

    def evict(self, protect: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Bring the tier within its byte budget, never removing what ``protect`` names;
        returns the keys that went."""
        ...

    def stats(self) -> TierStats:
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class StagedWrites(Protocol):
    """A lower tier whose ``write`` can be taken apart (the disk): ``stage`` writes the bytes
    without making them durable or visible, ``commit`` makes any number of staged batches
    durable and visible together (one commit), ``abort`` drops them. Each staged batch is
    committed or aborted exactly once; both raise nothing for an empty list."""

    def stage(self, items: Sequence[BlockWrite]) -> object:
        """Raises :class:`kvstore.errors.KVStoreError` with nothing left behind."""
        ...

    def commit(self, staged: Sequence[object]) -> None:
        """Raises :class:`kvstore.errors.KVStoreError` with nothing of ``staged`` visible."""
        ...

    def abort(self, staged: Sequence[object]) -> None:
        ...


def as_byte_tensor(t: object, what: str) -> torch.Tensor:
    """``t`` checked to be a CPU, contiguous, 1-D uint8 tensor (a block's raw bytes)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TensorMismatchError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise TensorMismatchError(
            f"{what} must be a CPU, contiguous, 1-D torch.uint8 tensor; got device={t.device}, "
            f"dtype={t.dtype}, shape={tuple(t.shape)}, contiguous={t.is_contiguous()}")
    return t.detach()
