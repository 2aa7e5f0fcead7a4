"""msgpack bodies with bounded buffers. Plain data only: no pickle, no extension types."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack


class CodecError(Exception):
    """A frame body is not one valid, bounded msgpack object."""


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Bounds every decoded object must respect (each checked while decoding)."""

    max_buffer: int  # bytes of one body (the frame cap)
    max_bin: int  # bytes of one bin (keys travel as one bin of n * 32 bytes)
    max_str: int = 64 << 10
    max_array: int = 1 << 17  # elements of one array (slot lists: one per block)
    max_map: int = 256  # entries of one map (namespace extras, stats)

    @classmethod
    def for_frames(cls, max_frame: int, max_keys: int) -> CodecLimits:
        return cls(max_buffer=max_frame, max_bin=max_frame,
                   max_array=max(1024, max_keys + 16))


def pack(obj: object) -> bytes:
    """Encode plain data (None, bool, int, float, str, bytes, list, dict); anything else raises."""
    try:
        return msgpack.packb(obj, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as e:
        raise CodecError(f"cannot encode {type(obj).__name__}: {e}") from e


def unpack(body: bytes, limits: CodecLimits) -> object:
    """Decode exactly one object from ``body`` within ``limits``."""
    if len(body) > limits.max_buffer:
        raise CodecError(f"body of {len(body)} bytes exceeds the {limits.max_buffer}-byte buffer")
    u = msgpack.Unpacker(
        None,
        raw=False,
        strict_map_key=True,
        use_list=True,
        max_buffer_size=max(limits.max_buffer, 1),
        max_bin_len=limits.max_bin,
        max_str_len=limits.max_str,
        max_array_len=limits.max_array,
        max_map_len=limits.max_map,
        max_ext_len=0,  # no extension types (and so no timestamps) at all
    )
    try:
        u.feed(body)
        obj = u.unpack()
    except msgpack.OutOfData:
        raise CodecError("truncated msgpack body") from None
    except Exception as e:  # FormatError, StackError, ValueError (limits), UnicodeDecodeError...
        raise CodecError(f"undecodable msgpack body: {type(e).__name__}: {e}") from None
    if u.tell() != len(body):
        raise CodecError(f"{len(body) - u.tell()} trailing bytes after the msgpack object")
    return obj
