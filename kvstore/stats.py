"""Counters and the frozen snapshots ``Store.stats()`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier at the moment of the snapshot."""

    name: str  # "hot", "warm", "disk" or "remote"
    device: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    evictions: int
    demotions_in: int = 0
    promotions_in: int = 0
    hits: int = 0  # blocks a fetch or lease was served from this tier
    hit_bytes: int = 0  # their raw bytes
    policy: str = ""  # a memory tier's eviction policy ("adaptive", "reuse", "lru")
    policy_state: str = ""  # what it has chosen lately ("scale 2, second-hit"; EvictionPolicy.state)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store was opened (blocks, not requests, unless named so)."""

    lookups: int  # lookup calls
    hits: int  # blocks lookup found
    misses: int  # blocks lookup asked for and did not find
    fetches: int  # fetch calls
    fetched_blocks: int
    fetch_short: int  # blocks a fetch asked for but could not return (miss or damage)
    puts: int  # put calls
    put_blocks: int  # blocks stored by put
    put_duplicates: int  # blocks skipped because the key was already held
    put_dropped: int  # blocks not stored: no room (all pinned) or parent no longer cached
    damaged: int  # blocks whose bytes are corrupt or gone (bad checksum, short read, missing
    # segment file): misses, and their index entries dropped
    dirty_dropped: int  # blocks evicted from memory before they reached disk
    disk_write_dropped: int  # disk writes dropped because the writer could not keep up or failed
    pinned_blocks: int
    blocks: int  # distinct blocks held by the memory tiers (the disk tier's are in tiers)
    dirty_blocks: int  # blocks in memory still waiting for the disk writer
    block_nbytes: int
    tiers: tuple[TierStats, ...]
    # blocks a lower tier held at lookup but did not give to the read, not damage: removed
    # meanwhile (evicted by another process, expired), or a read the process cannot make now
    # (out of file descriptors, EACCES, no index reader slot); misses, entries kept
    read_misses: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def tier(self, name: str) -> TierStats | None:
        for t in self.tiers:
            if t.name == name:
                return t
        return None


@dataclass(slots=True)
class Counters:
    """Mutable counters behind :class:`StoreStats`; updated under the store's lock."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    fetches: int = 0
    fetched_blocks: int = 0
    fetch_short: int = 0
    puts: int = 0
    put_blocks: int = 0
    put_duplicates: int = 0
    put_dropped: int = 0
    damaged: int = 0
    read_misses: int = 0
    dirty_dropped: int = 0
    disk_write_dropped: int = 0
    served: dict[str, int] = field(default_factory=dict)  # tier name -> blocks served from it

    # each counter of a call is counted in one place: the store's jobs call these
    def looked_up(self, asked: int, found: int, *, calls: int = 1) -> None:
        """``calls`` lookups asked for ``asked`` blocks and found ``found`` of them."""
        self.lookups += calls
        self.hits += found
        self.misses += asked - found

    def fetched(self, asked: int, got: int) -> None:
        """One fetch (or lease, or borrow) asked for ``asked`` blocks and returned ``got``."""
        self.fetches += 1
        self.fetched_blocks += got
        self.fetch_short += asked - got

    def put_called(self, duplicates: int, dropped: int) -> None:
        """One put (or granted put): ``duplicates`` already held, ``dropped`` cut off."""
        self.puts += 1
        self.put_duplicates += duplicates
        self.put_dropped += dropped
