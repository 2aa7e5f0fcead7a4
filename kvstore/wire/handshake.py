"""The first exchange of a connection: :class:`Hello` (who the client is, for which
namespace) and :class:`HelloReply` (the namespace id, its warm slab to map, the daemon's
limits)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kvstore.wire.errors import BadRequest
from kvstore.wire.fields import KEY_BYTES, check_args, check_int, check_str

__all__ = ["Hello", "HelloReply"]


@dataclass(frozen=True, slots=True)
class Hello:
    """First request of a connection: who the client is, for which namespace."""

    OP: ClassVar[str] = "hello"
    version: int
    model_id: str
    model_revision: str
    dtype: str
    block_shape: tuple[int, int, int, int, int]  # num_layers, kv_planes, block_tokens, heads, head_dim
    tp_rank: int
    tp_size: int
    extras: tuple[tuple[str, str | int | float | bool | bytes], ...]
    salt_policy: str  # "shared" or "per-uid"
    warm_capacity: int | None  # bytes the client would like its namespace's warm tier to have
    client: str  # free text for logs, e.g. "vllm pid 1234"

    def to_wire(self) -> list:
        return [self.version, self.model_id, self.model_revision, self.dtype,
                list(self.block_shape), [self.tp_rank, self.tp_size], dict(self.extras),
                self.salt_policy, self.warm_capacity, self.client]

    @classmethod
    def from_wire(cls, args: object) -> Hello:
        a = check_args(args, 10, "hello")
        shape = a[4]
        if not isinstance(shape, list) or len(shape) != 5:
            raise BadRequest("hello: block_shape must be [num_layers, kv_planes, block_tokens, "
                             "num_kv_heads, head_dim]")
        tp = a[5]
        if not isinstance(tp, list) or len(tp) != 2:
            raise BadRequest("hello: tp must be [tp_rank, tp_size]")
        extras = a[6]
        if not isinstance(extras, dict):
            raise BadRequest("hello: extras must be a map")
        for k, v in extras.items():
            check_str(k, "hello: extras key", 256)
            if isinstance(v, float) and not math.isfinite(v):
                raise BadRequest("hello: extras values must be finite")
            if not isinstance(v, (str, int, float, bool, bytes)) or (
                isinstance(v, (str, bytes)) and len(v) > 4096):
                raise BadRequest("hello: extras values must be str, bytes, int, float or bool")
        cap = a[8]
        return cls(
            version=check_int(a[0], "version"),
            model_id=check_str(a[1], "hello: model_id"),
            model_revision=check_str(a[2], "hello: model_revision"),
            dtype=check_str(a[3], "hello: dtype", 32),
            block_shape=tuple(check_int(x, "hello: block_shape entry", 1, 1 << 20) for x in shape),  # type: ignore[arg-type]
            tp_rank=check_int(tp[0], "hello: tp_rank", 0, 1 << 16),
            tp_size=check_int(tp[1], "hello: tp_size", 1, 1 << 16),
            extras=tuple(sorted(extras.items())),
            salt_policy=check_str(a[7], "hello: salt_policy", 32),
            warm_capacity=None if cap is None else check_int(cap, "hello: warm_capacity"),
            client=check_str(a[9], "hello: client", 256),
        )


@dataclass(frozen=True, slots=True)
class HelloReply:
    version: int
    namespace_id: bytes
    shm_path: str  # the namespace's warm slab: map it read-write, [slots, block_nbytes] bytes
    slots: int
    block_nbytes: int
    max_frame: int
    max_keys: int
    max_leases: int
    server: str  # e.g. "kvstore 0.1.0 pid 1234"
    instance: bytes = b""  # random per daemon start (b"": a daemon that does not say)
    #: earlier daemons on this store path that stopped with every committed put on disk
    flushed_instances: tuple[bytes, ...] = ()
    #: non-empty when nothing is stored under the namespace yet: its fields, and any stored
    #: namespace differing in one field only (a typo'd model id gets an empty cache)
    new_namespace: str = ""

    def to_wire(self) -> list:
        return [self.version, self.namespace_id, self.shm_path, self.slots, self.block_nbytes,
                self.max_frame, self.max_keys, self.max_leases, self.server, self.instance,
                list(self.flushed_instances), self.new_namespace]

    @classmethod
    def from_wire(cls, body: object) -> HelloReply:
        if not isinstance(body, list) or not 9 <= len(body) <= 64:
            raise BadRequest("hello reply must be an array of at least 9 fields")
        a = body  # fields after the ones known here are a newer daemon's: ignored
        nsid = a[1]
        if not isinstance(nsid, bytes) or len(nsid) != KEY_BYTES:
            raise BadRequest("hello reply: namespace_id must be 32 bytes")
        instance = a[9] if len(a) > 9 else b""
        flushed = a[10] if len(a) > 10 else []
        if not isinstance(instance, bytes) or len(instance) > 64:
            raise BadRequest("hello reply: instance must be bytes")
        if not isinstance(flushed, list) or not all(
                isinstance(x, bytes) and len(x) <= 64 for x in flushed):
            raise BadRequest("hello reply: flushed_instances must be an array of bytes")
        return cls(check_int(a[0], "version"), nsid, check_str(a[2], "shm_path", 4096),
                   check_int(a[3], "slots"), check_int(a[4], "block_nbytes", 1),
                   check_int(a[5], "max_frame", 64), check_int(a[6], "max_keys", 1),
                   check_int(a[7], "max_leases", 1), check_str(a[8], "server"), instance,
                   tuple(flushed), check_str(a[11], "new_namespace", 4096) if len(a) > 11 else "")
