"""Checked decoding of wire arrays: each field's type and bounds (a bad one raises
:class:`~kvstore.wire.errors.BadRequest`, naming the field), and the two argument shapes most
requests share (``[keys, parent]`` and ``[id]``)."""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import ClassVar

from kvstore.keys import KEY_BYTES
from kvstore.wire.errors import BadRequest

__all__ = [
    "KEY_BYTES",
    "MAX_ID",
    "IdRequest",
    "KeysRequest",
    "check_args",
    "check_int",
    "check_int_list",
    "check_keys",
    "check_opt_key",
    "check_str",
    "split_keys",
]

MAX_ID = 2**63 - 1


def check_int(v: object, name: str, lo: int = 0, hi: int = MAX_ID) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"{name} must be an int in [{lo}, {hi}], got {v!r:.60}")
    return v


def check_str(v: object, name: str, max_len: int = 1024) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise BadRequest(f"{name} must be a str of at most {max_len} characters")
    return v


def check_keys(v: object, name: str = "keys") -> bytes:
    if not isinstance(v, bytes) or len(v) % KEY_BYTES:
        raise BadRequest(f"{name} must be bytes holding whole {KEY_BYTES}-byte keys")
    return v


def check_opt_key(v: object, name: str = "parent") -> bytes | None:
    if v is None:
        return None
    if not isinstance(v, bytes) or len(v) != KEY_BYTES:
        raise BadRequest(f"{name} must be nil or a {KEY_BYTES}-byte key")
    return v


def check_args(args: object, n: int, op: str) -> list:
    if not isinstance(args, list) or len(args) != n:
        raise BadRequest(f"{op} takes an array of {n} arguments")
    return args


def check_int_list(v: object, name: str) -> list[int]:
    if not isinstance(v, list):
        raise BadRequest(f"{name} must be an array of ints")
    for x in v:
        if type(x) is not int or x < 0:
            raise BadRequest(f"{name} must be an array of non-negative ints")
    return v


@functools.lru_cache(maxsize=256)
def _key_struct(n: int) -> struct.Struct:
    return struct.Struct(f"{KEY_BYTES}s" * n)


def split_keys(blob: bytes) -> list[bytes]:
    """``n * 32`` bytes -> ``n`` keys (one C call: 4x faster than slicing in a loop)."""
    return list(_key_struct(len(blob) // KEY_BYTES).unpack(blob))


@dataclass(frozen=True, slots=True)
class KeysRequest:
    """``[keys, parent]``: ``n * 32`` bytes of keys and the key before the first (or nil)."""

    OP: ClassVar[str] = ""
    keys: bytes
    parent: bytes | None = None

    def to_wire(self) -> list:
        return [self.keys, self.parent]

    @classmethod
    def from_wire(cls, args: object):
        a = check_args(args, 2, cls.OP)
        return cls(check_keys(a[0]), check_opt_key(a[1]))

    @property
    def count(self) -> int:
        return len(self.keys) // KEY_BYTES


@dataclass(frozen=True, slots=True)
class IdRequest:
    """``[id]``: a lease or grant id."""

    OP: ClassVar[str] = ""
    id: int

    def to_wire(self) -> list:
        return [self.id]

    @classmethod
    def from_wire(cls, args: object):
        return cls(check_int(check_args(args, 1, cls.OP)[0], f"{cls.OP}: id"))
