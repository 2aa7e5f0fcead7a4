"""One namespace's view of the remote tier: the :class:`~kvstore.tiers.base.LowerTier` a store
keeps. The :class:`RemoteTier` is already confined to one key space (its ``key_prefix``
names the namespace); this adds the namespace check on reads and the dtype's item size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.errors import ConfigError
from kvstore.stats import TierStats
from kvstore.tiers.base import BlockWrite, Located, ReadStatus, check_key
from kvstore.tiers.remote.config import RemoteWrite

if TYPE_CHECKING:
    import torch

    from kvstore.tiers.remote.tier import RemoteTier


class BoundRemote:
    """``remote``'s blocks of ``namespace_id``. A lookup is one round trip (a pipeline of
    ``EXISTS`` per node); a read one more (``GETRANGE``). Values may expire between the two: a
    plain miss, not damage (``volatile``)."""

    name = "remote"
    volatile = True

    def __init__(self, remote: RemoteTier, namespace_id: bytes, itemsize: int) -> None:
        self.remote = remote
        self.namespace_id = check_key(namespace_id, "namespace_id")
        self.itemsize = itemsize

    def locate(self, keys: Sequence[bytes]) -> Located:
        n = self.remote.leading_run(keys)
        return Located(tuple(keys[:n]))

    def read(self, found: Located, dsts: Sequence[torch.Tensor],
             mirrors: Sequence[torch.Tensor | None] | None = None) -> list[ReadStatus]:
        got = self.remote.read_many(list(found.keys), dsts, namespace_id=self.namespace_id)
        if mirrors is not None:
            for st, dst, m in zip(got, dsts, mirrors, strict=True):
                if st is ReadStatus.OK and m is not None:
                    m.copy_(dst)
        return got

    def write(self, items: Sequence[BlockWrite]) -> None:
        # Redis trouble is counted by the tier (``write_failures``), never raised: the
        # shared tier is a best-effort copy, the disk tier the durable one
        ns, size = self.namespace_id, self.itemsize
        self.remote.write_blocks([RemoteWrite(w.key, ns, w.data, size) for w in items])

    def delete(self, keys: Sequence[bytes] | None,
               keep: Callable[[bytes], bool] | None = None) -> list[bytes]:
        if keys is None:
            raise ConfigError("the remote tier is shared by many hosts and is not listed: "
                              "name the keys to delete (its blocks expire by TTL or Redis's "
                              "maxmemory policy)")
        if keep is not None:
            keys = [k for k in keys if not keep(k)]
        return self.remote.delete_owned(keys, self.namespace_id) if keys else []

    def touch(self, keys: Sequence[bytes]) -> None:
        """Nothing to send: Redis's LRU counts the ``GETRANGE`` of a read as the access."""

    def evict(self, protect: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Nothing to do here: Redis evicts by its ``maxmemory`` policy and TTLs."""
        return []

    def stats(self) -> TierStats:
        r = self.remote.stats()
        return TierStats(name=self.name, device=self.remote.url, capacity_bytes=0,
                         used_bytes=r.stored_bytes_written, blocks=r.blocks_written, evictions=0)

    def close(self) -> None:
        self.remote.close()

    def __repr__(self) -> str:
        return f"BoundRemote({self.remote!r}, namespace {self.namespace_id.hex()[:16]})"
