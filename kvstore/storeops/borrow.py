"""Blocks read in place: a pinned view of the store's own memory instead of a copy.

A caller that only reads the blocks once (the transformers bridge relayouts them into its
cache during the model's first update) saves the whole fetch copy this way: the blocks stay
pinned in their slots until it calls ``release()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.api import BorrowedBlocks
from kvstore.keys import BlockKey
from kvstore.tiers.slab import paired_runs


class BorrowOps:
    """``borrow_blocks`` (mixin of :class:`kvstore.store.Store`)."""

    def borrow_blocks(self, keys: Sequence[bytes]) -> BorrowedBlocks:
        """Pin the leading run of ``keys`` held in memory on the store's device and return it
        in place (see :class:`BorrowedBlocks`). Blocks elsewhere (disk, another device, a put
        still copying) end the run: ``fetch`` the rest. A miss is an empty result."""
        ks = self._keys(keys)
        lay = self.layout
        tiers = [t for t in (self._hot, self._warm)
                 if t is not None and t.slab.data.device == self.device]
        with self._lock:
            self._check_open()
            where: list[tuple[int, int]] = []  # (tier index, slot)
            pending = self._pending
            for k in ks:
                if pending and k in pending:
                    break
                for ti, t in enumerate(tiers):
                    s = t._slots.get(k)
                    if s is not None:
                        where.append((ti, s))
                        break
                else:
                    break
            got = ks[: len(where)]
            self._catalog.pin_many(got)
            self._touch_chain(got)
            c = self._counters
            c.fetches += 1
            c.fetched_blocks += len(got)
            c.fetch_short += len(ks) - len(got)
        n = len(got)
        try:
            zero_copy = n > 0 and all(ti == where[0][0] for ti, _ in where) and all(
                s == where[0][1] + i for i, (_, s) in enumerate(where))
            if zero_copy:
                first = where[0][1]
                rows = tiers[where[0][0]].slab.data[first : first + n]
                blocks = rows.view(lay.dtype).view(lay.batch_shape(n))
            elif n == 0:
                blocks = torch.empty(lay.batch_shape(0), dtype=lay.dtype, device=self.device)
            else:
                blocks = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device=self.device)
                flat = blocks.view(n, -1).view(torch.uint8)
                for ti, t in enumerate(tiers):
                    mine = [(p, s) for p, (tj, s) in enumerate(where) if tj == ti]
                    for d, s, m in paired_runs(mine):
                        flat[d : d + m].copy_(t.slab.data[s : s + m])
        except BaseException:
            self._unpin_borrowed(got)
            raise
        return BorrowedBlocks(blocks, got, zero_copy, self._unpin_borrowed)

    def _unpin_borrowed(self, keys: list[BlockKey]) -> None:
        with self._lock:
            if not self._closed:
                self._catalog.unpin_many(keys)
