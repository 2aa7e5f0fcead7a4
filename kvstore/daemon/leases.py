"""What one connection holds in its namespace's store: leases, granted puts and pins.

Everything is given back when the connection ends, however it ends (the client closed it,
crashed, was killed): leases are released, granted puts aborted (their slots freed, nothing
visible), pins dropped. Counts are bounded by :class:`kvstore.daemon.security.Limits`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.api import PutGrant
from kvstore.keys import BlockKey
from kvstore.wire.errors import BadRequest, ErrorCode


@dataclass(slots=True)
class Holdings:
    """One connection's leases (id -> keys), grants (id -> store grant) and pins."""

    max_leases: int
    max_pins: int
    leases: dict[int, list[BlockKey]] = field(default_factory=dict)
    grants: dict[int, PutGrant] = field(default_factory=dict)
    pins: Counter = field(default_factory=Counter)  # key -> pins this connection holds
    _next_id: int = 1

    def _new_id(self) -> int:
        i = self._next_id
        self._next_id += 1
        return i

    def check_room(self) -> None:
        """Raise LIMIT before asking the store for another lease or grant."""
        if len(self.leases) + len(self.grants) >= self.max_leases:
            raise BadRequest(
                f"this connection already holds {self.max_leases} leases and granted puts; "
                "release leases (and commit or abort puts) before asking for more",
                ErrorCode.LIMIT,
            )

    def add_lease(self, keys: list[BlockKey]) -> int:
        i = self._new_id()
        self.leases[i] = keys
        return i

    def pop_lease(self, lease_id: int) -> list[BlockKey]:
        try:
            return self.leases.pop(lease_id)
        except KeyError:
            raise BadRequest(f"lease {lease_id} is not held by this connection",
                             ErrorCode.UNKNOWN_ID) from None

    def add_grant(self, grant: object) -> int:
        i = self._new_id()
        self.grants[i] = grant
        return i

    def pop_grant(self, grant_id: int) -> object:
        try:
            return self.grants.pop(grant_id)
        except KeyError:
            raise BadRequest(f"granted put {grant_id} is not held by this connection",
                             ErrorCode.UNKNOWN_ID) from None

    def check_pins(self, n: int) -> None:
        if self.pinned + n > self.max_pins:
            raise BadRequest(f"this connection would hold more than {self.max_pins} pins",
                             ErrorCode.LIMIT)

    def add_pins(self, keys: Sequence[BlockKey]) -> None:
        self.pins.update(keys)

    def take_pins(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Of ``keys``, those this connection has a pin on (one pin each is given up)."""
        out = []
        for k in keys:
            if self.pins[k] > 0:
                self.pins[k] -= 1
                if not self.pins[k]:
                    del self.pins[k]
                out.append(k)
        return out

    @property
    def pinned(self) -> int:
        return sum(self.pins.values())

    @property
    def leased_blocks(self) -> int:
        return sum(len(v) for v in self.leases.values())

    @property
    def granted_blocks(self) -> int:
        return sum(len(g.keys) for g in self.grants.values())  # type: ignore[attr-defined]

    def release_all(self, store: object) -> None:
        """Give everything back to ``store`` (blocking: run it off the event loop)."""
        leases, grants, pins = self.leases, self.grants, self.pins
        self.leases, self.grants, self.pins = {}, {}, Counter()
        if getattr(store, "closed", True):
            return
        for keys in leases.values():
            store.release_lease(keys)  # type: ignore[attr-defined]
        for g in grants.values():
            store.abort_put(g)  # type: ignore[attr-defined]
        if pins:
            store.unpin(list(pins.elements()))  # type: ignore[attr-defined]
