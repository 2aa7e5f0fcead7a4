"""The remote shared tier: KV blocks in Redis or a Redis Cluster (``docs/scale-out.md``).

| module | holds |
| --- | --- |
| ``tier`` | :class:`RemoteTier`: lookups, reads, writes, deletes over node pipelines |
| ``bound`` | :class:`BoundRemote`: one namespace's :class:`~kvstore.tiers.base.LowerTier` |
| ``config`` | ``RemoteConfig``, ``RemoteWrite``, ``RemoteStats`` |
| ``conn`` | URLs, nodes, cluster topology, the circuit breaker |
| ``format`` | the value format: header, codec, checksums |
| ``local_server`` | ``RedisProcess``: a local ``redis-server`` (benchmarks, tests); the tier never imports it |
"""

from kvstore.tiers.base import ReadStatus
from kvstore.tiers.remote.config import ADMISSIONS, RemoteConfig, RemoteStats, RemoteWrite
from kvstore.tiers.remote.tier import RemoteTier

__all__ = ["ADMISSIONS", "ReadStatus", "RemoteConfig", "RemoteStats", "RemoteTier", "RemoteWrite"]
