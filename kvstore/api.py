"""The typed surface shared by the embedded store and the daemon client.

* :class:`KVCache`: what :class:`kvstore.Store` and the client of :func:`kvstore.connect`
  both are — engines and integrations program against it.
* :class:`ZeroCopy`: the store's in-place data plane (leased warm slots, granted puts),
  which the daemon and the vLLM connector use when the store offers it; checked with
  ``isinstance(store, ZeroCopy)``, never with ``hasattr``.
* The receipts those calls hand out: :class:`PinReceipt`, :class:`PutGrant`,
  :class:`BorrowedBlocks`; and :class:`Tier`, the names of the tiers.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvstore.hints import PutHint
from kvstore.keys import BlockKey, KeyChain

if TYPE_CHECKING:
    import torch

    from kvstore.layout import KVLayout
    from kvstore.stats import StoreStats
    from kvstore.transfer import Transfer

__all__ = ["BorrowedBlocks", "KVCache", "PinReceipt", "PutGrant", "Tier", "ZeroCopy"]


class Tier(enum.StrEnum):
    """Where a block lives; the values are the names used by ``evict(tier=...)`` and stats."""

    HOT = "hot"
    WARM = "warm"
    DISK = "disk"
    REMOTE = "remote"


class PinReceipt:
    """Pins held on some blocks; release with :meth:`release` or by leaving a ``with`` block."""

    __slots__ = ("_unpin", "keys", "_released")

    def __init__(self, unpin: Callable[[list[BlockKey]], object], keys: list[BlockKey]) -> None:
        self._unpin = unpin
        self.keys = keys
        self._released = False

    def __len__(self) -> int:
        return len(self.keys)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._unpin(self.keys)

    def __enter__(self) -> PinReceipt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class PutGrant:
    """Warm slots reserved for the new blocks of a put, filled by someone else (the daemon's
    client writes them in shared memory), then published with ``commit_put`` or given back
    with ``abort_put``."""

    keys: list[BlockKey]  # the new keys, in order
    parents: list[BlockKey | None]
    positions: list[int]  # their positions in the keys the put was asked for
    slots: list[int]  # warm slots to fill, one per key
    duplicates: int
    start: int = 0  # where the blocks start in the warm tier's order (the put's hint)


class BorrowedBlocks:
    """The leading resident run of some keys, pinned: ``blocks`` ``[n, L, P, T, H, D]`` on the
    store's device, a view of the store's slab when the run sits in consecutive slots of one
    tier (else a gathered copy). Do not write to ``blocks``; call :meth:`release` (or leave
    the ``with`` block) once done reading, after which ``blocks`` may change under you."""

    __slots__ = ("blocks", "keys", "zero_copy", "_release", "_lock")

    def __init__(self, blocks: torch.Tensor, keys: list[BlockKey], zero_copy: bool,
                 release: Callable[[list[BlockKey]], None]) -> None:
        self.blocks = blocks
        self.keys = keys
        self.zero_copy = zero_copy
        self._release: Callable[[list[BlockKey]], None] | None = release
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.keys)

    def release(self) -> None:
        """Unpin the blocks (idempotent)."""
        with self._lock:
            fn, self._release = self._release, None
        if fn is not None:
            fn(self.keys)

    def __enter__(self) -> BorrowedBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@runtime_checkable
class KVCache(Protocol):
    """The engine-facing API (docs/architecture.md "Public API")."""

    namespace_id: bytes

    @property
    def layout(self) -> KVLayout: ...

    def block_keys(self, token_ids: object, salt: str | bytes | None = None, *,
                   extras: object = None) -> KeyChain: ...

    def lookup(self, keys: Sequence[bytes]) -> int: ...

    def fetch(self, keys: Sequence[bytes], *,
              out: torch.Tensor | None = None) -> Transfer[torch.Tensor]: ...

    def put(self, keys: Sequence[bytes], kv: torch.Tensor,
            hint: PutHint | None = None) -> Transfer[int]: ...

    def prefetch(self, keys: Sequence[bytes]) -> Transfer[int]: ...

    def load_into(self, keys: Sequence[bytes], pages: Sequence[object], block_ids: object, *,
                  page_size: int | None = None) -> Transfer[int]: ...

    def save_from(self, pages: Sequence[object], block_ids: object, keys: Sequence[bytes], *,
                  page_size: int | None = None, hint: PutHint | None = None) -> Transfer[int]: ...

    def pin(self, keys: Sequence[bytes]) -> PinReceipt: ...

    def unpin(self, keys: Sequence[bytes]) -> int: ...

    def evict(self, keys: Sequence[bytes] | None = None, *, tier: str | None = None) -> int: ...

    def stats(self) -> StoreStats: ...

    def flush(self) -> None: ...

    def close(self, timeout: float | None = ...) -> None:
        """Flush and release; waits at most ``timeout`` seconds for the last writes (the
        embedded store's default: 30 s), then raises ``CloseTimeoutError``."""


@runtime_checkable
class ZeroCopy(Protocol):
    """Leased warm slots and granted puts: blocks read and written in place in the warm slab."""

    @property
    def warm_slab(self) -> torch.Tensor | None: ...

    def lease_warm(self, keys: Sequence[bytes]) -> tuple[list[BlockKey], list[int]]: ...

    def release_lease(self, keys: Sequence[bytes]) -> None: ...

    def grant_put(self, keys: Sequence[bytes], hint: PutHint | None = None) -> PutGrant: ...

    def commit_put(self, grant: PutGrant) -> int: ...

    def abort_put(self, grant: PutGrant) -> None: ...
