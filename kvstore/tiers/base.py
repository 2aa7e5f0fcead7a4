"""The contract of the tiers below memory (disk, remote) and what they share.

A lower tier holds verified copies of blocks outside the process's memory. The store keeps
a list of them, fastest first, and asks each in turn for the stretch the ones before it
lack. Every method below is what the store calls; bad data is never raised: a block that is
absent, unreachable or damaged is a :class:`ReadStatus`, counted by the tier.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvstore.errors import KeyFormatError, TensorMismatchError

if TYPE_CHECKING:
    import torch

KEY_BYTES = 32

__all__ = ["KEY_BYTES", "LowerTier", "ReadStatus", "as_byte_tensor", "check_key"]


class ReadStatus(enum.Enum):
    """What one block's read gave: only ``OK`` means the destination holds its bytes."""

    OK = "ok"
    MISSING = "missing"  # not held (or its file / node is gone)
    DAMAGED = "damaged"  # short read, checksum mismatch, undecodable payload or record


@runtime_checkable
class LowerTier(Protocol):
    """A tier below memory. Keys are 32-byte block keys of ``namespace_id``'s key space."""

    def leading_run(self, keys: Sequence[bytes], namespace_id: bytes | None = None) -> int:
        """How many leading ``keys`` the tier holds (one round trip / one transaction)."""
        ...

    def read_many(self, keys: Sequence[bytes], dsts: Sequence[torch.Tensor], *,
                  namespace_id: bytes | None = None) -> list[ReadStatus]:
        """Read and verify blocks into ``dsts`` (CPU uint8, one block each); a status each."""
        ...

    def delete_owned(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bytes]:
        """Remove ``namespace_id``'s blocks of ``keys``; returns the keys that went."""
        ...

    def close(self) -> None:
        ...


def check_key(k: object, what: str = "key") -> bytes:
    """``k`` as 32 bytes, or :class:`KeyFormatError` naming ``what``."""
    if isinstance(k, bytes) and len(k) == KEY_BYTES:
        return k
    if isinstance(k, (bytearray, memoryview)) and len(k) == KEY_BYTES:
        return bytes(k)
    raise KeyFormatError(f"{what} must be 32 bytes, got {type(k).__name__}"
                         + (f" of length {len(k)}" if isinstance(k, (bytes, bytearray)) else ""))


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
