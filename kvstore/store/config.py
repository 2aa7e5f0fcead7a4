"""What :func:`kvstore.open_store` resolves from its arguments."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.errors import ConfigError, SizeError
from kvstore.namespace import Namespace
from kvstore.sizes import parse_size


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
    remote: str | None = None  # redis://, rediss:// or redis+cluster:// URL of the remote tier
    remote_codec: str = "zstd"
    remote_budget_s: float = 0.05
    remote_ttl_s: float | None = None


def resolve_device(device: str | torch.device | None) -> torch.device:
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


def capacity(value: int | str, what: str, block_nbytes: int) -> int:
    n = parse_size(value, what=what)
    if 0 < n < block_nbytes:
        raise SizeError(
            f"{what}={value!r} is smaller than one block ({block_nbytes} B for this layout); "
            "raise it, or pass 0 to disable the tier"
        )
    return n
