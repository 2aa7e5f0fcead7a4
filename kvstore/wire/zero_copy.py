"""Requests and replies that hand warm-tier slots to a client, which copies through its own
mapping of the slab: a fetch's :class:`Lease` (read, then ``release``) and a put's
:class:`Grant` (write, then ``commit`` or ``abort``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstore.hints import MAX_PRIORITY, MAX_SESSION_CHARS, MIN_PRIORITY, PutHint, hint_of
from kvstore.wire.errors import BadRequest
from kvstore.wire.fields import (
    IdRequest,
    KeysRequest,
    check_args,
    check_int,
    check_int_list,
    check_keys,
    check_opt_key,
    check_str,
)

__all__ = ["Abort", "Commit", "Fetch", "Grant", "Lease", "Put", "Release"]


@dataclass(frozen=True, slots=True)
class Fetch(KeysRequest):
    """Lease the leading held blocks in the warm tier -> :class:`Lease`."""

    OP: ClassVar[str] = "fetch"


@dataclass(frozen=True, slots=True)
class Put(KeysRequest):
    """Reserve warm slots for the new blocks -> :class:`Grant`. ``[keys, parent]``, or with
    the put's hint ``[keys, parent, session, priority]`` (:class:`~kvstore.hints.PutHint`;
    session nil or a str)."""

    OP: ClassVar[str] = "put"
    session: str | None = None
    priority: int = 0

    @property
    def hint(self) -> PutHint | None:
        return hint_of(self.session, self.priority)

    def to_wire(self) -> list:
        if self.session is None and not self.priority:
            return [self.keys, self.parent]  # what daemons before hints read
        return [self.keys, self.parent, self.session, self.priority]

    @classmethod
    def from_wire(cls, args: object) -> Put:
        if not isinstance(args, list) or len(args) not in (2, 4):
            raise BadRequest("put takes an array of 2 arguments (keys, parent) or 4 (keys, "
                             "parent, session, priority)")
        keys, parent = check_keys(args[0]), check_opt_key(args[1])
        if len(args) == 2:
            return cls(keys, parent)
        s = args[2]
        if s is not None and (not check_str(s, "session", MAX_SESSION_CHARS)):
            raise BadRequest("session must be nil or a non-empty str")
        return cls(keys, parent, s, check_int(args[3], "priority", MIN_PRIORITY, MAX_PRIORITY))


@dataclass(frozen=True, slots=True)
class Release(IdRequest):
    """Give back a lease -> :class:`~kvstore.wire.data_ops.Empty` (clients need not wait
    for it)."""

    OP: ClassVar[str] = "release"


@dataclass(frozen=True, slots=True)
class Commit(IdRequest):
    """Publish a granted put whose slots were written -> :class:`~kvstore.wire.data_ops.Count`
    (blocks stored)."""

    OP: ClassVar[str] = "commit"


@dataclass(frozen=True, slots=True)
class Abort(IdRequest):
    """Give back a granted put's slots; nothing becomes visible ->
    :class:`~kvstore.wire.data_ops.Empty`."""

    OP: ClassVar[str] = "abort"


@dataclass(frozen=True, slots=True)
class Lease:
    """Warm slots of the leading held blocks, pinned until ``release(lease_id)``."""

    lease_id: int  # 0 when no block was leased (nothing to release)
    slots: list[int]

    def to_wire(self) -> list:
        return [self.lease_id, self.slots]

    @classmethod
    def from_wire(cls, body: object) -> Lease:
        a = check_args(body, 2, "fetch reply")
        return cls(check_int(a[0], "lease_id"), check_int_list(a[1], "slots"))


@dataclass(frozen=True, slots=True)
class Grant:
    """Warm slots to fill with the blocks at ``positions`` of the put, then ``commit``."""

    grant_id: int  # 0 when nothing was granted (nothing to commit)
    positions: list[int]
    slots: list[int]
    duplicates: int

    def to_wire(self) -> list:
        return [self.grant_id, self.positions, self.slots, self.duplicates]

    @classmethod
    def from_wire(cls, body: object) -> Grant:
        a = check_args(body, 4, "put reply")
        g = cls(check_int(a[0], "grant_id"), check_int_list(a[1], "positions"),
                check_int_list(a[2], "slots"), check_int(a[3], "duplicates"))
        if len(g.positions) != len(g.slots):
            raise BadRequest("put reply: positions and slots differ in length")
        return g
