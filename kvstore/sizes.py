"""Byte sizes: parse ``"4GiB"``-style strings, format bytes for people."""

from __future__ import annotations

import re

from kvstore.errors import SizeError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}
# a sign is matched so that "-1GiB" is refused as negative, not as "not a size"
_SIZE_RE = re.compile(r"^\s*([+-]?)\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Return ``value`` in bytes: an int, or a string like ``"512MiB"``, ``"4GiB"``, ``"1.5GB"``.

    Negative sizes are refused (:class:`~kvstore.errors.SizeError`), whatever their spelling.
    """
    if isinstance(value, bool):
        raise SizeError(f"{what} must be a byte count or a string like '4GiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"{what} must be >= 0 bytes, got {value} (0 disables the tier)")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None or m.group(3).lower() not in _UNITS:
            raise SizeError(
                f"{what}={value!r} is not a size; write an int or a string like "
                "'512MiB', '4GiB' or '1.5GB'"
            )
        n = int(float(m.group(2)) * _UNITS[m.group(3).lower()])
        if m.group(1) == "-" and n:
            raise SizeError(f"{what}={value.strip()!r} is negative; sizes are >= 0 (0 disables "
                            "the tier)")
        return n
    raise SizeError(f"{what} must be an int or a string like '4GiB', not {type(value).__name__}")


def format_size(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def plural(n: int, word: str, many: str | None = None) -> str:
    """``plural(1, "file")`` -> ``'1 file'``; ``plural(3, "file")`` -> ``'3 files'``."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"
