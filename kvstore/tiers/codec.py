"""Block codecs of the disk tier: ``none`` and zstd with an optional byte shuffle.

A codec id is one byte in the index record (``docs/format.md``):

====  ==================  ============================================================
id    name                stored bytes
====  ==================  ============================================================
0     ``none``            the raw block bytes
1     ``zstd``            one zstd frame of the raw bytes
2     ``zstd+shuffle2``   one zstd frame of the raw bytes byte-shuffled with width 2
3     ``zstd+shuffle4``   ... width 4
4     ``zstd+shuffle8``   ... width 8
====  ==================  ============================================================

Byte shuffle of width ``w`` (``len(raw) % w == 0``, ``n = len(raw) // w`` elements): the
output is ``w`` planes of ``n`` bytes, plane ``j`` holding byte ``w - 1 - j`` of every element.
For the little-endian 16-bit dtypes (bf16, fp16) that is every element's high byte (sign,
exponent) first, then every low byte — the layout zstd compresses best.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a block is (de)compressed: listing a store needs neither
    import numpy as np
    import zstandard

CODEC_NONE = 0
CODEC_ZSTD = 1
CODEC_ZSTD_SHUFFLE2 = 2
CODEC_ZSTD_SHUFFLE4 = 3
CODEC_ZSTD_SHUFFLE8 = 4

CODEC_NAMES: dict[int, str] = {
    CODEC_NONE: "none",
    CODEC_ZSTD: "zstd",
    CODEC_ZSTD_SHUFFLE2: "zstd+shuffle2",
    CODEC_ZSTD_SHUFFLE4: "zstd+shuffle4",
    CODEC_ZSTD_SHUFFLE8: "zstd+shuffle8",
}
CODEC_IDS: dict[str, int] = {v: k for k, v in CODEC_NAMES.items()}
_SHUFFLE_WIDTH = {CODEC_NONE: 1, CODEC_ZSTD: 1, CODEC_ZSTD_SHUFFLE2: 2,
                  CODEC_ZSTD_SHUFFLE4: 4, CODEC_ZSTD_SHUFFLE8: 8}
_SHUFFLE_CODEC = {1: CODEC_ZSTD, 2: CODEC_ZSTD_SHUFFLE2, 4: CODEC_ZSTD_SHUFFLE4,
                  8: CODEC_ZSTD_SHUFFLE8}

#: Tier-level codec settings accepted by ``DiskTier(codec=...)``.
TIER_CODECS = ("none", "zstd")


class CodecError(ValueError):
    """Stored bytes could not be decoded (corrupt frame, wrong size, unknown codec)."""


def shuffle(raw: np.ndarray, width: int) -> np.ndarray:
    """Byte-shuffle ``raw`` (1-D uint8, length a multiple of ``width``), MSB plane first."""
    import numpy as np
    if width == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, width)[:, ::-1].T).reshape(-1)


def unshuffle_into(shuffled: np.ndarray, dst: np.ndarray, width: int) -> None:
    """Inverse of :func:`shuffle`, written into ``dst`` (1-D uint8 of the same length)."""
    import numpy as np
    if width == 1:
        np.copyto(dst, shuffled)
        return
    dst.reshape(-1, width)[:, ::-1] = shuffled.reshape(width, -1).T


_local = threading.local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    import zstandard

    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    import zstandard

    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def compress(raw: memoryview | np.ndarray, itemsize: int, level: int = 3) -> tuple[int, bytes | None]:
    """Compress one block. Returns ``(codec_id, payload)``; ``(CODEC_NONE, None)`` when
    compression would not save at least 1/64 of the bytes (store it raw then)."""
    import numpy as np
    arr = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    width = itemsize if itemsize in (2, 4, 8) and arr.size % itemsize == 0 else 1
    payload = _cctx(level).compress(shuffle(arr, width))
    if len(payload) >= arr.size - arr.size // 64:
        return CODEC_NONE, None
    return _SHUFFLE_CODEC[width], payload


def decompress_into(codec_id: int, payload: bytes | bytearray | memoryview, dst: np.ndarray) -> None:
    """Decode ``payload`` into ``dst`` (1-D uint8, exactly the raw size). Raises CodecError."""
    import numpy as np
    import zstandard
    if codec_id == CODEC_NONE:
        if len(payload) != dst.size:
            raise CodecError(f"raw payload has {len(payload)} bytes, expected {dst.size}")
        np.copyto(dst, np.frombuffer(payload, dtype=np.uint8))
        return
    width = _SHUFFLE_WIDTH.get(codec_id)
    if width is None:
        raise CodecError(f"unknown codec id {codec_id}")
    try:
        out = _dctx().decompress(payload, max_output_size=dst.size)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd frame does not decode: {e}") from None
    if len(out) != dst.size:
        raise CodecError(f"zstd frame decodes to {len(out)} bytes, expected {dst.size}")
    unshuffle_into(np.frombuffer(out, dtype=np.uint8), dst, width)
