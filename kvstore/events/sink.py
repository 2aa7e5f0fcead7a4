"""What a store tells about its blocks: the :class:`EventSink` protocol.

The store (or the daemon on its behalf) calls a sink whenever a tier gains or loses blocks.
Calls come from the store's threads, usually under its lock: a sink only records them and
returns (the publisher queues them for its own thread), never blocks, never calls back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvstore.events.types import TIER_MEDIUM
from kvstore.keys import BlockKey


class EventSink(Protocol):
    """Receives one namespace's tier changes. ``tier``: ``"hot"``, ``"warm"`` or ``"disk"``."""

    def stored(self, tier: str, keys: Sequence[BlockKey],
               parents: Sequence[BlockKey | None]) -> None:
        """``keys`` are now held in ``tier``; ``parents[i]`` is the parent of ``keys[i]``
        (``None`` for a prompt's first block). Keys already announced there are skipped."""

    def removed(self, tier: str | None, keys: Sequence[BlockKey]) -> None:
        """``keys`` left ``tier`` (``None``: every tier). Keys not held there are skipped."""

    def cleared(self, tier: str | None = None) -> None:
        """Everything left ``tier`` (``None``: every tier of this namespace)."""


def check_tier(tier: str | None, *, optional: bool) -> None:
    """``tier`` is one a sink reports (``None`` too where ``optional``); ValueError if not."""
    if tier not in TIER_MEDIUM and not (optional and tier is None):
        raise ValueError(f"tier must be one of {', '.join(TIER_MEDIUM)}, got {tier!r}")


def check_stored(tier: str, keys: Sequence[BlockKey], parents: Sequence[BlockKey | None]) -> None:
    """The arguments of :meth:`EventSink.stored`: a known tier, one parent per key."""
    check_tier(tier, optional=False)
    if len(keys) != len(parents):
        raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
