"""Namespaces: everything that changes a block's bytes, hashed into 32 bytes.

The namespace id seeds every key chain, so a different model, revision, dtype, layout,
tensor-parallel shard or format version can never produce a hit on another's blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgpack

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

#: Version of the block byte format and key scheme. Changing it changes every namespace.
FORMAT_VERSION = 1
_NAMESPACE_TAG = "kvstore-namespace/1"


def _canonical_extras(extras: Mapping[str, object] | None) -> tuple[tuple[str, str], ...]:
    if not extras:
        return ()
    out = []
    for k, v in extras.items():
        if not isinstance(k, str):
            raise ConfigError(f"namespace extras keys must be str, got {k!r}")
        if isinstance(v, bytes):
            v = v.hex()
        elif not isinstance(v, (str, int, float, bool)) or v is None:
            raise ConfigError(
                f"namespace extra {k!r} must be str, bytes, int, float or bool, "
                f"got {type(v).__name__}"
            )
        out.append((k, repr(v) if not isinstance(v, str) else v))
    return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class Namespace:
    """Identity of a family of compatible blocks. ``id`` is its 32-byte fingerprint."""

    model_id: str
    layout: KVLayout
    model_revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    extras: tuple[tuple[str, str], ...] = field(default=())
    format_version: int = FORMAT_VERSION
    _id: bytes = field(init=False, repr=False, compare=False)  # computed once: id is hot

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError("model_id must be a non-empty string naming the model")
        if not isinstance(self.model_revision, str):
            raise ConfigError("model_revision must be a string (a revision or weights digest)")
        for name in ("tp_rank", "tp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {v!r}")
        if self.tp_size < 1 or self.tp_rank >= self.tp_size:
            raise ConfigError(
                f"tp_rank must be in [0, tp_size); got tp_rank={self.tp_rank}, tp_size={self.tp_size}"
            )
        object.__setattr__(self, "_id", hashlib.sha256(self.canonical_bytes()).digest())

    @classmethod
    def create(
        cls,
        model_id: str,
        layout: KVLayout,
        *,
        model_revision: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        extras: Mapping[str, object] | None = None,
    ) -> Namespace:
        return cls(
            model_id=model_id,
            layout=layout,
            model_revision=model_revision or "",
            tp_rank=tp_rank,
            tp_size=tp_size,
            extras=_canonical_extras(extras),
        )

    def canonical_bytes(self) -> bytes:
        """Deterministic encoding hashed into :attr:`id` (msgpack of a fixed-order array)."""
        lay = self.layout
        return msgpack.packb(
            [
                _NAMESPACE_TAG,
                self.format_version,
                self.model_id,
                self.model_revision,
                lay.dtype_name,
                [lay.num_layers, lay.kv_planes, lay.block_tokens, lay.num_kv_heads, lay.head_dim],
                [self.tp_rank, self.tp_size],
                [list(kv) for kv in self.extras],
            ],
            use_bin_type=True,
        )

    @property
    def id(self) -> bytes:
        return self._id
