"""Requests of an admin connection: sent instead of ``hello`` (an admin connection has no
namespace of its own), by the daemon's uid or root only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstore.wire.errors import BadRequest
from kvstore.wire.fields import KEY_BYTES, check_args, check_keys

__all__ = ["ADMIN_OPS", "Remove"]


@dataclass(frozen=True, slots=True)
class Remove:
    """Admin: delete blocks of any namespace from the daemon's memory and disk ->
    :class:`~kvstore.wire.data_ops.Count`.

    Sent instead of ``hello`` (an admin connection has no namespace of its own), by the
    daemon's uid or root only. ``keys`` nil: every block of the namespace."""

    OP: ClassVar[str] = "remove"
    namespace_id: bytes
    keys: bytes | None = None

    def to_wire(self) -> list:
        return [self.namespace_id, self.keys]

    @classmethod
    def from_wire(cls, args: object) -> Remove:
        a = check_args(args, 2, cls.OP)
        nsid = a[0]
        if not isinstance(nsid, bytes) or len(nsid) != KEY_BYTES:
            raise BadRequest(f"remove: namespace_id must be {KEY_BYTES} bytes")
        return cls(nsid, None if a[1] is None else check_keys(a[1]))

    @property
    def count(self) -> int:
        return 0 if self.keys is None else len(self.keys) // KEY_BYTES


#: ops of an admin connection: sent instead of hello, by the daemon's uid or root only
ADMIN_OPS = frozenset({Remove.OP})
