"""The disk tier's records: what callers hand it (:class:`DiskWrite`) and get back
(:class:`DiskRecord`, :class:`NamespaceInfo`, :class:`DiskStats`, :class:`Finding`,
:class:`CompactResult`), plus the per-process namespace cache entry and counters the
tier's modules share.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.tiers import codec as _codec
from kvstore.tiers.base import as_byte_tensor
from kvstore.tiers.disk import segments as _seg
from kvstore.tiers.disk.index import Rec

if TYPE_CHECKING:  # torch is imported by whoever hands us tensors: listing needs none
    import torch

    from kvstore.namespace import Namespace


@dataclass(frozen=True, slots=True)
class DiskWrite:
    """One block to write. ``data`` is CPU, contiguous, uint8, 1-D, ``block_nbytes`` long; it may
    be a view into a (pinned) slab — the tier keeps no reference after ``write_blocks``."""

    key: bytes
    parent: bytes | None
    namespace_id: bytes
    data: torch.Tensor


@dataclass(frozen=True, slots=True)
class DiskRecord:
    key: bytes
    namespace_id: bytes
    parent: bytes | None
    segment: int
    offset: int
    stored_nbytes: int
    raw_nbytes: int
    codec: str
    checksum: int
    created: float  # seconds since the epoch (microsecond resolution)
    last_access: float
    hits: int


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    namespace_id: bytes
    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    kv_planes: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int
    tp_size: int
    format_version: int
    extras: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, ns: Namespace) -> NamespaceInfo:
        """The record the disk tier keeps of ``ns``."""
        from kvstore.layout import dtype_name

        lay = ns.layout
        return cls(ns.id, ns.model_id, ns.model_revision, dtype_name(lay.dtype), lay.num_layers,
                   lay.kv_planes, lay.block_tokens, lay.num_kv_heads, lay.head_dim, ns.tp_rank,
                   ns.tp_size, ns.format_version, tuple(ns.extras))

    @property
    def fields(self) -> tuple:
        """Every field but the id, in :func:`~kvstore.tiers.disk.index.encode_namespace`'s
        order."""
        return (self.model_id, self.model_revision, self.dtype, self.num_layers,
                self.kv_planes, self.block_tokens, self.num_kv_heads, self.head_dim,
                self.tp_rank, self.tp_size, self.format_version, self.extras)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv_planes, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return _seg.DTYPE_SIZES[self.dtype]

    @property
    def block_nbytes(self) -> int:
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # orphan_segment | temp_file | missing_segment | short_segment |
    #            checksum_mismatch | bad_record | bad_header | bad_index | unknown_file
    path: str
    key: bytes | None
    detail: str
    fixed: bool


@dataclass(frozen=True, slots=True)
class DiskStats:
    blocks: int
    stored_bytes: int
    raw_bytes: int
    capacity_bytes: int
    segments: int
    segment_bytes: int
    dead_bytes: int
    reads_ok: int
    read_missing: int
    read_damaged: int
    blocks_written: int
    write_errors: int
    evictions: int
    compactions: int


@dataclass(frozen=True, slots=True)
class CompactResult:
    segments_rewritten: int
    bytes_before: int
    bytes_after: int
    blocks_moved: int


@dataclass(slots=True)
class NsCache:
    """A registered namespace with what reads and writes need of it, precomputed."""

    info: NamespaceInfo
    nbytes: int
    itemsize: int
    st_dtype: str
    shape: list[int]


def ns_cache_entry(info: NamespaceInfo) -> NsCache:
    return NsCache(info, info.block_nbytes, info.itemsize,
                   _seg.ST_DTYPES.get(info.dtype, "U8"), list(info.block_shape))


class Counters:
    """The tier's counters (per process), for :class:`DiskStats`."""

    __slots__ = ("reads_ok", "read_missing", "read_damaged", "blocks_written", "write_errors",
                 "evictions", "compactions", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads_ok = self.read_missing = self.read_damaged = 0
        self.blocks_written = self.write_errors = self.evictions = self.compactions = 0

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)


def as_buffer(t: torch.Tensor, what: str) -> memoryview:
    """The bytes of a CPU uint8 contiguous 1-D tensor (``what`` names it in errors)."""
    return memoryview(as_byte_tensor(t, what).numpy())


def disk_record(key: bytes, r: Rec) -> DiskRecord:
    """The public record of block ``key`` (the block key, not its dbkey)."""
    return DiskRecord(
        key=key, namespace_id=r.namespace_id, parent=r.parent, segment=r.segment, offset=r.offset,
        stored_nbytes=r.stored_nbytes, raw_nbytes=r.raw_nbytes,
        codec=_codec.CODEC_NAMES.get(r.codec, f"unknown({r.codec})"), checksum=r.checksum,
        created=r.created_us / 1e6, last_access=r.last_access_us / 1e6, hits=r.hits,
    )
