"""The one parser of the JSON headers kvstore reads from files (segments, packs): bounded in
size and in nesting depth, so a hostile or damaged header is a :class:`HeaderFormatError`
(a counted finding, a refused pack) and never a ``RecursionError`` or a huge allocation.

The depth is checked before anything is decoded, at C speed (numpy, in chunks of bounded
memory): brackets inside strings do not count, and the deepest nesting is the largest running
sum of openers (+1) and closers (-1). ``json.loads`` recurses no deeper than that (it stops at
the first bracket that does not match). A kvstore header is 3 levels deep (object, tensor
entry, shape list).
"""

from __future__ import annotations

import json

import numpy as np

from kvstore.errors import HeaderFormatError

__all__ = ["MAX_DEPTH", "HeaderFormatError", "load_header", "nesting_depth"]

#: deepest nesting accepted: kvstore's own headers are 3 deep, safetensors' are too
MAX_DEPTH = 64

_CHUNK = 1 << 20  # bytes per numpy pass: bounded memory (~30 MiB) whatever the header


def nesting_depth(data: bytes, stop_past: int | None = None) -> int:
    """How deep the JSON text ``data`` nests (brackets inside strings do not count); once
    past ``stop_past`` it stops counting and returns a depth past it."""
    if b"\\" in data:  # escapes (left to right, as JSON reads them): no quote is escaped now
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    # every quote opens or closes a string: a byte is inside one when an odd number of
    # quotes precedes it (an unmatched quote: json.loads stops there)
    depth = deepest = quotes = 0
    for off in range(0, len(data), _CHUNK):
        a = np.frombuffer(data, dtype=np.uint8, count=min(_CHUNK, len(data) - off), offset=off)
        qpos = np.flatnonzero(a == 0x22)
        bpos = np.flatnonzero((a == 0x5B) | (a == 0x5D) | (a == 0x7B) | (a == 0x7D))
        if bpos.size:
            bpos = bpos[((np.searchsorted(qpos, bpos) + quotes) & 1) == 0]  # outside strings
            v = a[bpos]
            run = np.cumsum(np.where((v == 0x5B) | (v == 0x7B), 1, -1), dtype=np.int64) + depth
            if run.size:
                deepest = max(deepest, int(run.max()))
                depth = int(run[-1])
        quotes += qpos.size
        if stop_past is not None and deepest > stop_past:
            break
    return deepest


def load_header(data: bytes | bytearray | memoryview, *, what: str, max_bytes: int,
                max_depth: int = MAX_DEPTH) -> dict:
    """The JSON object in ``data`` (ASCII), checked to be at most ``max_bytes`` long and
    ``max_depth`` deep; :class:`HeaderFormatError` naming ``what`` (e.g. "segment header")
    and the problem otherwise."""
    data = bytes(data)
    if len(data) > max_bytes:
        raise HeaderFormatError(f"{what} is {len(data)} bytes, more than the {max_bytes} a "
                                "kvstore header may have")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise HeaderFormatError(f"{what} is not ASCII JSON: {e}") from None
    if nesting_depth(data, stop_past=max_depth) > max_depth:
        raise HeaderFormatError(f"{what} nests more than {max_depth} levels deep: not a "
                                "kvstore header")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # (RecursionError: cannot happen past the check)
        raise HeaderFormatError(f"{what} is not ASCII JSON: {e}") from None
    if not isinstance(obj, dict):
        raise HeaderFormatError(f"{what} is not a JSON object")
    return obj
