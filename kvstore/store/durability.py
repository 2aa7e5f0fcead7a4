"""What ``flush`` must not vouch for: puts the durable tier failed to write.

A put is acknowledged when it lands in memory (or is queued for disk); ``flush`` promises
every earlier put is durable. When the disk tier refuses a write (disk full, I/O error) the
writer records it here instead of dropping it silently:

- blocks still held in memory are *unwritten*: the next ``flush`` marks them dirty again, so
  the writer retries them, and raises only if they still fail;
- blocks gone from memory before they reached disk (an overflowing put that failed, an
  unwritten block evicted for room) are *lost*: the next ``flush`` reports them once.

An explicit ``evict`` forgets its keys here: the caller asked for them to go.
All methods run under the store's lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstore.errors import NotDurableError
from kvstore.keys import BlockKey
from kvstore.store.catalog import Catalog


@dataclass(slots=True)
class Durability:
    """The writer's failures since the last ``flush`` that reported them."""

    unwritten: dict[BlockKey, None] = field(default_factory=dict)  # in memory, not on disk
    lost: int = 0  # acknowledged, gone from memory, never on disk; reported once
    reason: str = ""  # the last failure, as the disk tier said it

    def failed(self, keys: Iterable[BlockKey], catalog: Catalog, reason: str) -> None:
        """The durable tier could not write ``keys``."""
        self.reason = reason
        for k in keys:
            if k in catalog:
                self.unwritten[k] = None
            else:
                self.lost += 1

    def dropped(self, n: int, reason: str) -> None:
        """``n`` blocks that were only in flight to disk (an overflowing put) failed."""
        self.reason = reason
        self.lost += n

    def left_memory(self, key: BlockKey) -> None:
        """``key`` left memory for room: if it never reached disk, it is lost."""
        if key in self.unwritten:
            del self.unwritten[key]
            self.lost += 1

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """``keys`` were evicted on purpose: nothing to report for them."""
        for k in keys:
            self.unwritten.pop(k, None)

    def retry(self, catalog: Catalog) -> int:
        """Mark every unwritten block still in memory dirty again; returns how many."""
        n = 0
        for k in self.unwritten:
            if k not in catalog:
                self.lost += 1
            elif not catalog.on_disk(k):
                catalog.mark_dirty(k)
                n += 1
        self.unwritten.clear()
        return n

    def report(self) -> NotDurableError | None:
        """The error ``flush`` raises now (lost blocks are reported once), or None."""
        n = len(self.unwritten) + self.lost
        if not n:
            return None
        reason = self.reason or "the disk tier could not write them"
        kept = len(self.unwritten)
        self.lost = 0
        # the advice follows the cause: "free space" for a file that vanished or a directory
        # made read-only sent operators to the wrong fix
        full = any(s in reason for s in ("No space left", "disk full", "ENOSPC"))
        todo = ("free space on the disk (or lower --disk-capacity)" if full
                else "fix what the reason above says")
        return NotDurableError(
            f"flush: {n} block(s) put before this flush are not on disk: {reason}. "
            f"{kept} of them are still served from memory and are written again by the next "
            f"flush; {todo} and flush again; the rest left memory and must be put again if "
            "they matter",
            n, reason)
