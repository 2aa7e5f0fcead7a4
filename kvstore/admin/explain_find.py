"""The look-ups behind ``kvstore explain``, each on the disk tier's public surface (one
read-only :class:`~kvstore.tiers.disk.DiskTier`): the chain's index records, whether a
record's bytes are usable, the tombstones of the blocks that are gone, and the other
namespaces and salts under which the prompt's blocks are stored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.keys import block_keys
from kvstore.tiers import codec as _codec
from kvstore.tiers.disk import (
    NOT_KEPT,
    SEGMENT_READ_FLAGS,
    DiskTier,
    NamespaceInfo,
    Rec,
    RecordError,
    block_checksum,
    decode_record,
    segment_name,
)

__all__ = ["Elsewhere", "chain_records", "damage_of", "elsewhere", "other_salts", "tombstones_of"]

#: keys per ``locate`` call: a miss costs one short read transaction, never a copy of the
#: rest of the chain
_WINDOW = 512


def chain_records(t: DiskTier, keys: Sequence[bytes], namespace_id: bytes) -> list[Rec | None]:
    """The index record of every key (None: not on disk; an undecodable record is damage
    the tier drops on the next read, so it is None here too). ``locate`` answers a leading
    run, so after a miss the window restarts at one key and grows while keys are found: a
    stretch of misses costs one short transaction per key, a stretch of hits a few."""
    n = len(keys)
    out: list[Rec | None] = [None] * n
    i, window = 0, _WINDOW
    while i < n:
        chunk = keys[i : i + window]
        found = t.locate(chunk, namespace_id)
        for j, raw in enumerate(found):
            try:
                out[i + j] = decode_record(raw)
            except RecordError:
                out[i + j] = None
        missed = len(found) < len(chunk)
        i += len(found) + missed  # past the miss that ended the run
        window = 1 if missed else min(_WINDOW, window * 4)
    return out


def leading(t: DiskTier, keys: Sequence[bytes], namespace_id: bytes) -> int:
    """Leading keys on disk (a window at a time, so a long chain costs few transactions)."""
    i = 0
    while i < len(keys):
        chunk = keys[i : i + _WINDOW * 8]
        m = len(t.locate(chunk, namespace_id))
        i += m
        if m < len(chunk):
            break
    return i


class _Segments:
    """Sizes of segment files, stat'ed once each."""

    def __init__(self, segdir: str) -> None:
        self.segdir = segdir
        self._size: dict[int, int | None] = {}

    def size(self, sid: int) -> int | None:
        if sid not in self._size:
            try:
                self._size[sid] = os.stat(os.path.join(self.segdir, segment_name(sid))).st_size
            except OSError:
                self._size[sid] = None
        return self._size[sid]


def damage_of(t: DiskTier, key: bytes, rec: Rec, segs: _Segments, *, verify: bool) -> str:
    """Why the bytes of a record cannot be served ("" when they can): its segment file is
    missing or too short (a ``stat``), or — with ``verify`` — its payload does not match
    its checksum (a read; nothing is changed, the store is open read-only)."""
    size = segs.size(rec.segment)
    if size is None:
        return "missing_segment"
    if rec.offset + rec.stored_nbytes > size:
        return "short_segment"
    if not verify:
        return ""
    path = os.path.join(segs.segdir, segment_name(rec.segment))
    try:
        fd = os.open(path, SEGMENT_READ_FLAGS)
    except OSError:
        return "missing_segment"
    try:
        payload = os.pread(fd, rec.stored_nbytes, rec.offset)
    except OSError:
        return "read_error"
    finally:
        os.close(fd)
    if len(payload) != rec.stored_nbytes:
        return "short_segment"
    raw: object = payload
    if rec.codec != _codec.CODEC_NONE:
        import numpy as np

        out = np.empty(rec.raw_nbytes, dtype=np.uint8)
        try:
            _codec.decompress_into(rec.codec, payload, out)
        except _codec.CodecError:
            return "checksum_mismatch"
        raw = out
    if block_checksum(key, rec.namespace_id, raw) != rec.checksum:
        return "checksum_mismatch"
    return ""


def tombstones_of(t: DiskTier, namespace_id: bytes, keys: Sequence[bytes]):
    """Tombstones of ``keys`` (or ``tombstones.NOT_KEPT``)."""
    if not keys:
        return [] if t.tombstones_kept() else NOT_KEPT
    return t.tombstones(namespace_id, keys)


@dataclass(frozen=True, slots=True)
class Elsewhere:
    """Tokens of the prompt held, as a leading run, under another namespace or salt."""

    namespace: NamespaceInfo
    salt: str | None  # the salt tried (None: no salt)
    tokens: int  # the leading tokens covered (whole blocks of that namespace)


def elsewhere(t: DiskTier, tokens: Sequence[int], salt: str | bytes | None,
              infos: Sequence[NamespaceInfo], wanted_id: bytes) -> list[Elsewhere]:
    """For every other registered namespace: how many leading tokens of the prompt it holds
    (its own block size; its first key is tried before the whole chain is hashed)."""
    out = []
    for info in infos:
        if info.namespace_id == wanted_id:
            continue
        bt = info.block_tokens
        if len(tokens) < bt:
            continue
        first = list(block_keys(info.namespace_id, list(tokens[:bt]), bt, salt=salt))
        if not t.locate(first, info.namespace_id):
            continue
        keys = list(block_keys(info.namespace_id, tokens, bt, salt=salt))
        out.append(Elsewhere(info, _salt_text(salt), leading(t, keys, info.namespace_id) * bt))
    return out


def other_salts(t: DiskTier, tokens: Sequence[int], info: NamespaceInfo,
                salts: Sequence[str | None]) -> list[Elsewhere]:
    """How many leading tokens of the prompt the namespace holds under each of ``salts``."""
    out = []
    bt = info.block_tokens
    for s in salts:
        if len(tokens) < bt:
            break
        first = list(block_keys(info.namespace_id, list(tokens[:bt]), bt, salt=s))
        if not t.locate(first, info.namespace_id):
            continue
        keys = list(block_keys(info.namespace_id, tokens, bt, salt=s))
        out.append(Elsewhere(info, s, leading(t, keys, info.namespace_id) * bt))
    return out


def _salt_text(salt: str | bytes | None) -> str | None:
    if salt is None:
        return None
    return salt if isinstance(salt, str) else salt.hex()


def segments_of(t: DiskTier) -> _Segments:
    return _Segments(os.path.join(t.path, "segments"))
