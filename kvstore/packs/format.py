"""The prefix pack format (``docs/format.md`` "Prefix packs"): one safetensors file holding
the blocks of one namespace and a manifest (keys, parents, checksums), self-describing
(the namespace record is in its metadata) and checked end to end.

Every byte of a pack is determined by its blocks: the header is canonical (re-encoded and
compared byte for byte), the manifest has a checksum in the header, each block has its
block checksum (bound to its key and namespace) in the manifest, and the file length is
exact. So a truncated or altered pack — any byte — is refused before anything is imported.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import xxhash

from kvstore.admin.common import AdminError
from kvstore.admin.nsmatch import NamespaceFields
from kvstore.errors import HeaderFormatError
from kvstore.header_json import load_header
from kvstore.tiers.disk import ST_DTYPES, RecordError, decode_namespace, namespace_record_id

__all__ = ["PACK_VERSION", "PackError", "PackHeader", "encode_header", "manifest_checksum",
           "parse_header"]

#: the pack format's version (``"kvstore.pack"`` in the metadata)
PACK_VERSION = "1"
KEYS, PARENTS, CHECKSUMS, BLOCKS = ("kvstore.keys", "kvstore.parents", "kvstore.checksums",
                                    "kvstore.blocks")
#: manifest bytes per block: key (32), parent index (i64), checksum (u64)
MANIFEST_BYTES = 48
#: a header longer than this is not a pack's (its own is well under 300 KiB)
MAX_HEADER_BYTES = 4 << 20
_U64 = struct.Struct("<Q")
_ALIGN = 8


class PackError(AdminError):
    """A pack cannot be used; ``kind`` says why (``not_a_pack``, ``version``, ``truncated``,
    ``altered``, ``wrong_namespace``, ``missing``, ``exists``, ``empty``) and the message
    what to do."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class PackHeader:
    """What a pack's header says (checked canonical by :func:`parse_header`)."""

    namespace_id: bytes
    namespace_record: bytes  # the disk index's namespace record (msgpack)
    namespace: NamespaceFields
    blocks: int
    manifest_xxh3: int
    data_start: int  # 8 + header length
    block_nbytes: int

    @property
    def manifest_start(self) -> int:
        return self.data_start

    @property
    def blocks_start(self) -> int:
        return self.data_start + MANIFEST_BYTES * self.blocks

    @property
    def file_bytes(self) -> int:
        return self.blocks_start + self.blocks * self.block_nbytes


def manifest_checksum(manifest: bytes | memoryview) -> int:
    """xxh3_64 (seed 0) of the manifest bytes: keys ‖ parents ‖ checksums."""
    return xxhash.xxh3_64_intdigest(manifest)


def encode_header(namespace_record: bytes, blocks: int, manifest_xxh3: int) -> bytes:
    """The first ``8 + N`` bytes of a pack of ``blocks`` blocks of this namespace."""
    fields = _fields(namespace_record)
    nid = namespace_record_id(fields.record_fields())
    if nid is None:
        raise PackError("altered", "the namespace record names no valid namespace")
    n = blocks
    shape = [n, *fields.block_shape]
    meta = {"kvstore.pack": PACK_VERSION, "kvstore.namespace_id": nid.hex(),
            "kvstore.namespace": namespace_record.hex(), "kvstore.blocks": str(n),
            "kvstore.manifest_xxh3": f"{manifest_xxh3:016x}"}
    tensors = [(KEYS, "U8", [n, 32], 32 * n), (PARENTS, "I64", [n], 8 * n),
               (CHECKSUMS, "U64", [n], 8 * n),
               (BLOCKS, ST_DTYPES[fields.dtype], shape, n * fields.block_nbytes)]
    parts = ['"__metadata__":' + json.dumps(meta, separators=(",", ":"))]
    begin = 0
    for name, dtype, shp, size in tensors:
        parts.append(json.dumps(name) + ":" + json.dumps(
            {"dtype": dtype, "shape": shp, "data_offsets": [begin, begin + size]},
            separators=(",", ":")))
        begin += size
    body = ("{" + ",".join(parts) + "}").encode("ascii")
    body += b" " * ((-(8 + len(body))) % _ALIGN)
    return _U64.pack(len(body)) + body


def _fields(record: bytes) -> NamespaceFields:
    try:
        (model, rev, dtype, L, P, T, H, D, rank, size, fv, extras) = decode_namespace(record)
    except RecordError as e:
        raise PackError("altered", f"the pack's namespace record does not decode ({e})") from None
    return NamespaceFields(model, rev, dtype, L, P, T, H, D, rank, size, fv, tuple(extras))


def read_header_length(first8: bytes, file_bytes: int, path: str) -> int:
    """N from the first 8 bytes, checked against the file size."""
    if len(first8) < 8:
        raise PackError("truncated", f"{path} is {file_bytes} bytes long: not a pack (a pack "
                        "starts with an 8-byte header length)")
    (n,) = _U64.unpack(first8)
    if n > MAX_HEADER_BYTES or (8 + n) % _ALIGN:
        raise PackError("not_a_pack", f"{path} is not a kvstore pack (its header length {n} "
                        "is not a pack's)")
    if 8 + n > file_bytes:
        raise PackError("truncated", f"{path} is truncated: {file_bytes} bytes, shorter than "
                        f"its own {8 + n}-byte header")
    return n


def parse_header(header: bytes, path: str) -> PackHeader:
    """Parse and check the ``8 + N`` header bytes of a pack: the metadata must describe a
    valid namespace whose id it names, and the bytes must be exactly what
    :func:`encode_header` writes for it."""
    try:  # bounded in size and depth: a hostile header is refused, never a RecursionError
        obj = load_header(header[8:], what="its safetensors header", max_bytes=MAX_HEADER_BYTES)
    except HeaderFormatError as e:
        raise PackError("not_a_pack", f"{path} is not a kvstore pack ({e})") from None
    try:
        meta = obj["__metadata__"]
        version = meta["kvstore.pack"]
    except (KeyError, TypeError):
        raise PackError("not_a_pack", f"{path} is not a kvstore pack (no kvstore.pack "
                        "metadata in its safetensors header)") from None
    if version != PACK_VERSION:
        raise PackError("version", f"{path} is a pack of format {version!r}; this kvstore "
                        f"reads format {PACK_VERSION} (use a kvstore release that reads it)")
    try:
        record = bytes.fromhex(meta["kvstore.namespace"])
        nid = bytes.fromhex(meta["kvstore.namespace_id"])
        blocks = int(meta["kvstore.blocks"])
        mxxh = int(meta["kvstore.manifest_xxh3"], 16)
    except (KeyError, TypeError, ValueError, OverflowError):  # (int(1e999): OverflowError)
        raise PackError("altered", f"{path}: the pack's metadata is incomplete or malformed") from None
    fields = _fields(record)
    if namespace_record_id(fields.record_fields()) != nid:
        raise PackError("altered", f"{path}: the namespace record does not hash to the "
                        "namespace id the pack names")
    if blocks < 1 or mxxh >= 1 << 64:
        raise PackError("altered", f"{path}: the pack's metadata has out-of-range values")
    if encode_header(record, blocks, mxxh) != header:
        raise PackError("altered", f"{path}: the pack's header is not the one its metadata "
                        "gives (altered, or written by something else)")
    return PackHeader(nid, record, fields, blocks, mxxh, len(header), fields.block_nbytes)
