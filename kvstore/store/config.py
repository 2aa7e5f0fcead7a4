"""What :func:`kvstore.open_store` resolves from its arguments."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.errors import SizeError
from kvstore.namespace import Namespace
from kvstore.sizes import parse_size
from kvstore.validate import resolve_device

__all__ = ["StoreConfig", "capacity", "resolve_device"]


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
    # fault the warm slab's pages in at open, in the background (kvstore.tiers.slab.Prefault)
    prefault_warm: bool = True
    # fault the warm slab's pages in at open, in the background (kvstore.tiers.slab.Prefault)
    prefault_warm: bool = True
    remote: str | None = None  # redis://, rediss:// or redis+cluster:// URL of the remote tier
    remote_codec: str = "zstd"
    remote_budget_s: float = 0.05
    remote_ttl_s: float | None = None


def capacity(value: int | str, what: str, block_nbytes: int) -> int:
    n = parse_size(value, what=what)
    if 0 < n < block_nbytes:
        raise SizeError(
            f"{what}={value!r} is smaller than one block ({block_nbytes} B for this layout); "
            "raise it, or pass 0 to disable the tier"
        )
    return n
