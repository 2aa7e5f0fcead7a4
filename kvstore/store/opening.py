"""Opening a store's tiers: the memory tiers, then disk and remote below them."""

from __future__ import annotations

import torch

from kvstore.errors import ConfigError
from kvstore.memcheck import check_memory
from kvstore.store.config import StoreConfig
from kvstore.store.copy_engine import CopyEngine
from kvstore.store.state import HOT, WARM, StoreState
from kvstore.tiers.memory import MemoryTier


def open_state(config: StoreConfig) -> StoreState:
    """The memory tiers, then the lower tiers below them: disk, then remote."""
    lay = config.namespace.layout
    check_memory(config.device, hot=config.gpu_capacity,  # numbers before any allocation
                 host=0 if config.warm_shared_memory else config.cpu_capacity)
    hot = (MemoryTier(HOT, lay, config.gpu_capacity, config.device, eviction=config.hot_eviction,
                      admission=config.hot_admission)
           if config.gpu_capacity else None)
    warm = None
    if config.cpu_capacity:
        warm = MemoryTier(WARM, lay, config.cpu_capacity, torch.device("cpu"),
                          pin_memory=config.pin_memory, shared_path=config.warm_shared_memory,
                          prefault=config.prefault_warm, eviction=config.warm_eviction,
                          admission=config.warm_admission)
    if hot is None and warm is None:
        raise ConfigError("gpu_capacity and cpu_capacity are both 0: give at least one memory "
                          "tier room")
    st = StoreState(config, hot, warm, engine=CopyEngine(config.device))
    if warm is not None and warm.slab.prefault is not None and st.engine is not None:
        warm.slab.prefault.pace(st.engine.busy)  # behind the store's own fetches and puts
    if config.path is not None and config.disk_capacity:
        if warm is None:
            raise ConfigError("a disk tier stages reads and writes in the warm tier: set "
                              "cpu_capacity > 0 or disk_capacity=0")
        from kvstore.tiers.disk import DiskTier
        from kvstore.tiers.disk.bound import BoundDisk

        disk = DiskTier(config.path, capacity_bytes=config.disk_capacity,
                        codec=config.disk_codec, group=config.group)
        try:
            disk.register_namespace(config.namespace)
        except BaseException:
            disk.close()
            raise
        st.lower.append(BoundDisk(disk, config.namespace.id))
    if config.remote is not None:
        if warm is None:
            raise ConfigError("a remote tier stages blocks in the warm tier: set cpu_capacity > 0")
        from kvstore.tiers.remote import RemoteConfig, RemoteTier
        from kvstore.tiers.remote.bound import BoundRemote

        itemsize = lay.itemsize
        remote = RemoteTier(
            RemoteConfig(config.remote, codec=config.remote_codec, ttl_s=config.remote_ttl_s,
                         budget_s=config.remote_budget_s,
                         # one key space per namespace: no tenant can shadow or delete
                         # another's blocks, whatever keys it sends
                         key_prefix=f"kvstore:{config.namespace.id.hex()}:"),
            itemsize_for=lambda _ns: itemsize,
        )
        st.lower.append(BoundRemote(remote, config.namespace.id, itemsize))
    return st
