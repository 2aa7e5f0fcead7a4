"""``open_store``: the embedded API's entry point. It checks the arguments, resolves a
:class:`~kvstore.store.config.StoreConfig` and builds the :class:`~kvstore.store.facade.Store`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore.errors import ConfigError
from kvstore.filemodes import resolve_group
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.store.config import (
    StoreConfig,
    capacity,
    resolve_admission,
    resolve_device,
    resolve_eviction,
)
from kvstore.store.facade import Store

if TYPE_CHECKING:
    from kvstore.events.sink import EventSink
from kvstore.tiers.policy import DEFAULT_EVICTION


def open_store(
    path: str | os.PathLike[str] | None = None,
    *,
    layout: KVLayout,
    model_id: str,
    model_revision: str | None = None,
    device: str | torch.device | None = None,
    gpu_capacity: int | str | None = None,
    cpu_capacity: int | str = "4GiB",
    disk_capacity: int | str = "64GiB",
    tp_rank: int = 0,
    tp_size: int = 1,
    namespace_extras: Mapping[str, object] | None = None,
    admission: str | Mapping[str, str] = "always",
    eviction: str | Mapping[str, str] = DEFAULT_EVICTION,
    disk_codec: str = "none",
    warm_shared_memory: str | None = None,
    remote: str | None = None,
    remote_budget_s: float = 0.05,
    remote_ttl_s: float | None = None,
    remote_codec: str = "zstd",
    events: EventSink | None = None,
    group: str | int | None = None,
) -> Store:
    """Open (or create) a store. Sizes are ints or strings like ``"4GiB"``.

    ``gpu_capacity`` defaults to 1GiB on a CUDA device and 0 on ``cpu`` (pass a size to run
    the hot tier on the CPU, as the tests do). ``path=None`` keeps everything in memory.
    ``warm_shared_memory`` puts the warm slab in a file (under ``/dev/shm``) that other
    processes can map — the sidecar daemon's data plane. ``remote`` adds a shared tier below
    disk on Redis (``redis://host:port``, ``rediss://`` for TLS, ``redis+cluster://host:port``);
    a lookup or read there never costs more than ``remote_budget_s`` (a slow or absent Redis
    is a miss), values expire after ``remote_ttl_s`` when set. See docs/scale-out.md.
    ``eviction`` orders each memory tier's victims (``"lru"``, ``"reuse"``, or a mapping
    ``{"hot": ..., "warm": ...}``), see :mod:`kvstore.tiers.policy`.
    ``admission``: a name (``"always"`` or ``"second-hit"``) decides when a block is written
    to the disk tier (``"second-hit"``: on its second use, so one-off prompts never reach the
    disk); a mapping ``{"hot": ..., "warm": ..., "disk": ...}`` (tiers left out: ``"always"``)
    also sets it per memory tier, where ``"second-hit"`` inserts a block the tier has not seen
    lately at the victim end of its eviction order (a one-time scan does not push out blocks
    used twice; nothing is refused), see :mod:`kvstore.tiers.admission`.
    ``events`` (a :class:`kvstore.events.EventSink`, e.g. an ``EventPublisher``'s sink) is told
    every block that joins or leaves the hot, warm and disk tiers, in order (KV events).
    ``group`` (a group name or gid) shares the store's files with that group: directories
    2750 (setgid), files 0640. Without it a new store is private (directories 0700, files
    0600) whatever the umask, and an existing one keeps the sharing it records. A store that
    other users can write is refused (:class:`~kvstore.errors.StorePermissionError`); one
    they can read is tightened, with a WARNING. See docs/operations.md, "File modes".
    """
    if not isinstance(layout, KVLayout):
        raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if path is not None:
        _check_store_path(Path(os.fspath(path)).expanduser())
    if remote is not None and not isinstance(remote, str):
        raise ConfigError("remote must be a URL string like 'redis://host:6379'")
    if remote_codec not in ("none", "zstd"):
        raise ConfigError(f"remote_codec must be 'none' or 'zstd', got {remote_codec!r}")
    if disk_codec not in ("none", "zstd"):
        raise ConfigError(f"disk_codec must be 'none' or 'zstd', got {disk_codec!r}")
    gid = resolve_group(group)  # an unknown group: before anything is allocated
    hot_admission, warm_admission, disk_admission = resolve_admission(admission)
    hot_eviction, warm_eviction = resolve_eviction(eviction)
    dev = resolve_device(device)
    ns = Namespace.create(model_id, layout, model_revision=model_revision, tp_rank=tp_rank,
                          tp_size=tp_size, extras=namespace_extras)
    if gpu_capacity is None:
        gpu_capacity = "1GiB" if dev.type == "cuda" else 0
    bn = layout.block_nbytes
    config = StoreConfig(
        path=Path(os.fspath(path)).expanduser() if path is not None else None,
        namespace=ns,
        device=dev,
        gpu_capacity=capacity(gpu_capacity, "gpu_capacity", bn),
        cpu_capacity=capacity(cpu_capacity, "cpu_capacity", bn),
        disk_capacity=capacity(disk_capacity, "disk_capacity", bn),
        admission=disk_admission,
        pin_memory=torch.cuda.is_available() and dev.type == "cuda",
        disk_codec=disk_codec,
        warm_shared_memory=warm_shared_memory,
        remote=remote,
        remote_codec=remote_codec,
        remote_budget_s=float(remote_budget_s),
        remote_ttl_s=remote_ttl_s,
        hot_eviction=hot_eviction,
        warm_eviction=warm_eviction,
        hot_admission=hot_admission,
        warm_admission=warm_admission,
        group=gid,
    )
    return Store(config, events=events)


def _check_store_path(path: Path) -> None:
    """A store path that is, or lies under, something other than a directory (a file, a
    device) is refused before anything there is created or has its mode changed."""
    for p in (path, *path.parents):
        try:
            if p.is_dir():
                return
            if not p.exists():
                continue
        except OSError:  # unreadable on the way: opening says what is wrong
            return
        where = "is" if p == path else f"lies under {p}, which is"
        raise ConfigError(f"store path {path} {where} not a directory; pass a directory "
                          "(created if missing)")
