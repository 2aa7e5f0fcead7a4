"""One namespace's view of the disk tier: the :class:`~kvstore.tiers.base.LowerTier` a store
keeps. The :class:`DiskTier` serves every namespace of a path; this binds the key space."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.errors import StoreClosedError
from kvstore.ratelog import Every
from kvstore.stats import TierStats
from kvstore.tiers.base import BlockWrite, Located, ReadStatus, check_key
from kvstore.tiers.disk.records import DiskWrite

if TYPE_CHECKING:
    import torch

    from kvstore.tiers.disk.tier import DiskTier

log = logging.getLogger("kvstore.disk")
#: a lookup failing again and again is logged at most this often
_WARN_EVERY_S = 10.0


class BoundDisk:
    """``disk``'s blocks of ``namespace_id``: one LMDB read transaction per ``locate``, and
    ``read`` reads with the records ``locate`` found (no second transaction)."""

    name = "disk"
    volatile = False

    def __init__(self, disk: DiskTier, namespace_id: bytes) -> None:
        self.disk = disk
        self.namespace_id = check_key(namespace_id, "namespace_id")
        self._warned = Every(_WARN_EVERY_S)  # failures to read the index, logged
        self._last_stats: TierStats | None = None

    def locate(self, keys: Sequence[bytes]) -> Located:
        """The leading run on disk. An index that cannot be read now (damaged since it was
        opened, LMDB in a fatal state after a failed write, no reader slot free) is a miss,
        logged: a ``put``, ``lookup`` or ``fetch`` never raises for it (they did)."""
        try:
            recs = self.disk.locate(keys, self.namespace_id)
        except StoreClosedError:
            raise
        except Exception as e:
            self._warn("a lookup (served as a miss)", e)
            return Located(())
        return Located(tuple(keys[: len(recs)]), tuple(recs))

    def read(self, found: Located, dsts: Sequence[torch.Tensor],
             mirrors: Sequence[torch.Tensor | None] | None = None) -> list[ReadStatus]:
        recs = found.handles
        return self.disk.read_many(list(found.keys), dsts, mirrors=mirrors,
                                   namespace_id=self.namespace_id,
                                   records=list(recs) if recs is not None else None)

    def write(self, items: Sequence[BlockWrite]) -> None:
        ns = self.namespace_id
        self.disk.write_blocks([DiskWrite(w.key, w.parent, ns, w.data) for w in items])

    def stage(self, items: Sequence[BlockWrite]) -> object:
        ns = self.namespace_id
        return self.disk.stage_blocks([DiskWrite(w.key, w.parent, ns, w.data) for w in items])

    def commit(self, staged: Sequence[object]) -> None:
        self.disk.commit_staged(staged)  # type: ignore[arg-type]

    def abort(self, staged: Sequence[object]) -> None:
        self.disk.abort_staged(staged)  # type: ignore[arg-type]

    def delete(self, keys: Sequence[bytes] | None,
               keep: Callable[[bytes], bool] | None = None) -> list[bytes]:
        if keys is None:
            keys = [r.key for r in self.disk.records(self.namespace_id)]
        if keep is not None:
            keys = [k for k in keys if not keep(k)]
        if not keys:
            return []
        return self.disk.delete_owned(keys, self.namespace_id)

    def touch(self, keys: Sequence[bytes]) -> None:
        self.disk.touch(keys, self.namespace_id)

    def evict(self, protect: Callable[[bytes], bool] | None = None) -> list[bytes]:
        return self.disk.evict_to_budget(protect=protect)

    def stats(self) -> TierStats:
        """The tier's occupancy; while the index cannot be read (see :meth:`locate`), the
        last one read (zeros before any), logged: ``Store.stats()`` raised."""
        try:
            d = self.disk.stats()
        except StoreClosedError:
            raise
        except Exception as e:
            self._warn("reading its totals", e)
            return self._last_stats or TierStats(name=self.name, device=str(self.disk.path),
                                                 capacity_bytes=self.disk.capacity_bytes,
                                                 used_bytes=0, blocks=0, evictions=0)
        self._last_stats = TierStats(name=self.name, device=str(self.disk.path),
                                     capacity_bytes=d.capacity_bytes, used_bytes=d.stored_bytes,
                                     blocks=d.blocks, evictions=d.evictions)
        return self._last_stats

    def _warn(self, what: str, e: BaseException) -> None:
        if self._warned.due():
            log.warning("disk tier %s: %s failed (%s: %s)", self.disk.path, what,
                        type(e).__name__, e)

    def close(self) -> None:
        self.disk.close()

    def __repr__(self) -> str:
        return f"BoundDisk({self.disk!r}, namespace {self.namespace_id.hex()[:16]})"
