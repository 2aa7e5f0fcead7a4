"""The disk tier's admission as one rule: when the write-behind writer gets a memory block.

``"always"``: once its put has landed in memory; ``"second-hit"``: at its second use (a fetch
or lease of it), so blocks used once never cost a disk write. Without a lower tier (no writer)
nothing is written. The memory tiers' own admission (where a new block starts in their
eviction order) is :mod:`kvstore.tiers.admission`'s.
"""

from __future__ import annotations

from kvstore.tiers.admission import DEFAULT_ADMISSION, check_admission


class DiskAdmission:
    """When a block held in memory is marked dirty for the disk writer."""

    __slots__ = ("name", "on_store", "on_reuse")

    def __init__(self, name: str = DEFAULT_ADMISSION) -> None:
        self.name = check_admission(name, "admission")
        self.on_store = name == "always"  # dirty once stored in memory
        self.on_reuse = name == "second-hit"  # dirty at the second use

    def __repr__(self) -> str:
        return f"DiskAdmission({self.name!r})"
