"""Requests about a namespace's blocks that the daemon answers itself (no slot changes hands:
for those see :mod:`kvstore.wire.zero_copy`) and the two plain replies, :class:`Count` and
:class:`Empty`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstore.wire.errors import BadRequest
from kvstore.wire.fields import KEY_BYTES, KeysRequest, check_args, check_int, check_keys

__all__ = [
    "TIERS",
    "Count",
    "Empty",
    "Evict",
    "Flush",
    "Lookup",
    "Pin",
    "Ping",
    "Prefetch",
    "Unpin",
]

TIERS = ("hot", "warm", "disk")


@dataclass(frozen=True, slots=True)
class Lookup(KeysRequest):
    """Leading keys held by any tier -> :class:`Count`."""

    OP: ClassVar[str] = "lookup"


@dataclass(frozen=True, slots=True)
class Prefetch(KeysRequest):
    """Read the leading blocks from disk into the warm tier -> :class:`Count`."""

    OP: ClassVar[str] = "prefetch"


@dataclass(frozen=True, slots=True)
class Pin(KeysRequest):
    """Pin the leading held blocks for this connection -> :class:`Count`."""

    OP: ClassVar[str] = "pin"


@dataclass(frozen=True, slots=True)
class Unpin:
    """Drop one of this connection's pins from each key -> :class:`Count`."""

    OP: ClassVar[str] = "unpin"
    keys: bytes

    def to_wire(self) -> list:
        return [self.keys]

    @classmethod
    def from_wire(cls, args: object) -> Unpin:
        return cls(check_keys(check_args(args, 1, cls.OP)[0]))

    @property
    def count(self) -> int:
        return len(self.keys) // KEY_BYTES


@dataclass(frozen=True, slots=True)
class Evict:
    """Evict ``keys`` (nil: every unpinned block of the namespace) -> :class:`Count`."""

    OP: ClassVar[str] = "evict"
    keys: bytes | None
    tier: str | None

    def to_wire(self) -> list:
        return [self.keys, self.tier]

    @classmethod
    def from_wire(cls, args: object) -> Evict:
        a = check_args(args, 2, cls.OP)
        tier = a[1]
        if tier is not None and tier not in TIERS:
            raise BadRequest(f"evict: tier must be nil or one of {', '.join(TIERS)}")
        return cls(None if a[0] is None else check_keys(a[0]), tier)

    @property
    def count(self) -> int:
        return 0 if self.keys is None else len(self.keys) // KEY_BYTES


@dataclass(frozen=True, slots=True)
class Flush:
    """Return once earlier puts are durable on disk -> :class:`Empty`."""

    OP: ClassVar[str] = "flush"
    timeout: float | None = None

    def to_wire(self) -> list:
        return [self.timeout]

    @classmethod
    def from_wire(cls, args: object) -> Flush:
        t = check_args(args, 1, cls.OP)[0]
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0 <= t <= 86400):
            raise BadRequest("flush: timeout must be nil or seconds in [0, 86400]")
        return cls(None if t is None else float(t))


@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness check -> :class:`Empty`."""

    OP: ClassVar[str] = "ping"

    def to_wire(self) -> list:
        return []

    @classmethod
    def from_wire(cls, args: object) -> Ping:
        check_args(args, 0, cls.OP)
        return cls()


@dataclass(frozen=True, slots=True)
class Count:
    n: int

    def to_wire(self) -> list:
        return [self.n]

    @classmethod
    def from_wire(cls, body: object) -> Count:
        return cls(check_int(check_args(body, 1, "count reply")[0], "n"))


@dataclass(frozen=True, slots=True)
class Empty:
    def to_wire(self) -> list:
        return []

    @classmethod
    def from_wire(cls, body: object) -> Empty:
        check_args(body, 0, "empty reply")
        return cls()
