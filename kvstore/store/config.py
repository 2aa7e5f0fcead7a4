"""What :func:`kvstore.open_store` resolves from its arguments."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.errors import ConfigError, SizeError
from kvstore.namespace import Namespace
from kvstore.sizes import parse_size
from kvstore.tiers.admission import DEFAULT_ADMISSION, check_admission
from kvstore.tiers.policy import DEFAULT_EVICTION, EVICTIONS
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
    admission: str  # the disk tier's: a block is written on its first or second use
    pin_memory: bool
    disk_codec: str = "none"
    warm_shared_memory: str | None = None  # file (e.g. under /dev/shm) backing the warm slab
    # fault the warm slab's pages in at open, in the background (kvstore.tiers.slab.Prefault)
    prefault_warm: bool = True
    remote: str | None = None  # redis://, rediss:// or redis+cluster:// URL of the remote tier
    remote_codec: str = "zstd"
    remote_budget_s: float = 0.05
    remote_ttl_s: float | None = None
    hot_eviction: str = "lru"  # kvstore.tiers.policy.EVICTIONS
    warm_eviction: str = "lru"
    hot_admission: str = "always"  # kvstore.tiers.admission.ADMISSIONS
    warm_admission: str = "always"
    # the store's files shared with this gid (directories 2750, files 0640); None: as the
    # store records it, private (0700/0600) when new (kvstore.filemodes)
    group: int | None = None


def resolve_eviction(eviction: str | Mapping[str, str]) -> tuple[str, str]:
    """``open_store(eviction=)``: one policy name for both memory tiers, or a mapping
    ``{"hot": ..., "warm": ...}`` (a tier left out gets the default) -> (hot, warm)."""
    if isinstance(eviction, str):
        pair = (eviction, eviction)
    elif isinstance(eviction, Mapping):
        unknown = set(eviction) - {"hot", "warm"}
        if unknown:
            raise ConfigError(f"eviction= names tiers {sorted(unknown)}; only 'hot' and 'warm' "
                              "have an eviction policy (disk evicts leaf-first LRU)")
        pair = (eviction.get("hot", DEFAULT_EVICTION), eviction.get("warm", DEFAULT_EVICTION))
    else:
        raise ConfigError(f"eviction must be a policy name or a mapping of tier to name, got "
                          f"{type(eviction).__name__}")
    for name in pair:
        if name not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {', '.join(map(repr, EVICTIONS))}, "
                              f"got {name!r}")
    return pair


#: the tiers ``open_store(admission={...})`` names
ADMISSION_TIERS = ("hot", "warm", "disk")


def resolve_admission(admission: str | Mapping[str, str]) -> tuple[str, str, str]:
    """``open_store(admission=)``: one name for the disk tier (the memory tiers admit every
    block, as before per-tier admission), or a mapping ``{"hot": ..., "warm": ...,
    "disk": ...}`` (a tier left out gets ``"always"``) -> (hot, warm, disk)."""
    if isinstance(admission, str):
        triple = (DEFAULT_ADMISSION, DEFAULT_ADMISSION, admission)
    elif isinstance(admission, Mapping):
        unknown = set(admission) - set(ADMISSION_TIERS)
        if unknown:
            raise ConfigError(f"admission= names tiers {sorted(unknown, key=str)}; the tiers "
                              f"with an admission are {', '.join(map(repr, ADMISSION_TIERS))}")
        hot, warm, disk = (admission.get(t, DEFAULT_ADMISSION) for t in ADMISSION_TIERS)
        triple = (hot, warm, disk)
    else:
        raise ConfigError(f"admission must be an admission name or a mapping of tier to name, "
                          f"got {type(admission).__name__}")
    for tier, name in zip(ADMISSION_TIERS, triple, strict=True):
        check_admission(name, f"admission of the {tier} tier")
    return triple


def capacity(value: int | str, what: str, block_nbytes: int) -> int:
    n = parse_size(value, what=what)
    if 0 < n < block_nbytes:
        raise SizeError(
            f"{what}={value!r} is smaller than one block ({block_nbytes} B for this layout); "
            "raise it, or pass 0 to disable the tier"
        )
    return n
