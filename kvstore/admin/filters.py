"""Filter and sort expressions of ``kvstore ls`` (``size>1GB``, ``accessed>7d``, ``model~llama``,
``--sort accessed:asc``): parsing with messages that name the valid keys and operators, and
applying them to :class:`~kvstore.admin.inventory.NamespaceEntry` /
:class:`~kvstore.admin.inventory.BlockEntry` items.

Grammar: ``KEY OP VALUE`` with no quoting; ``OP`` is one of ``= == != ~ !~ > >= < <=``.
Which operators a key takes depends on its type:

====== ============================ =================================================
type   operators                    value
====== ============================ =================================================
text   ``= != ~ !~``                ``=`` exact, ``~`` case-insensitive substring
id     ``= !=``                     hex prefix (``parent=none``: no parent)
size   ``= != > >= < <=``           bytes: ``1GB``, ``512MiB``, ``1.5GiB``, ``4096``
count  ``= != > >= < <=``           an integer
age    ``= != > >= < <=``           a duration: ``30s``, ``10m``, ``1h``, ``7d``, ``2w``, ``1y``;
                                    ``accessed>7d`` = last accessed more than 7 days ago
tiers  ``= !=``                     ``hot``, ``warm`` or ``disk``: held in that tier
====== ============================ =================================================
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError, SizeError
from kvstore.sizes import parse_size

__all__ = [
    "BLOCK_FIELDS",
    "NAMESPACE_FIELDS",
    "OPERATORS",
    "TIERS",
    "FieldSpec",
    "Filter",
    "FilterError",
    "SortSpec",
    "apply",
    "parse_duration",
    "parse_filter",
    "parse_sort",
]

OPERATORS = ("=", "!=", "~", "!~", ">", ">=", "<", "<=")
TIERS = ("hot", "warm", "disk")
_OPS_BY_TYPE = {
    "text": ("=", "!=", "~", "!~"),
    "id": ("=", "!="),
    "size": ("=", "!=", ">", ">=", "<", "<="),
    "count": ("=", "!=", ">", ">=", "<", "<="),
    "age": ("=", "!=", ">", ">=", "<", "<="),
    "tiers": ("=", "!="),
}
_TYPE_WORDS = {"text": "text", "id": "a hex id", "size": "a size", "count": "a count",
               "age": "an age", "tiers": "a tier"}
_FILTER_RE = re.compile(r"^\s*([A-Za-z_]+)\s*(==|!=|>=|<=|!~|=|~|>|<)\s*(.*?)\s*$")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {
    "": 1, "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "w": 7 * 86400, "week": 7 * 86400, "weeks": 7 * 86400,
    "mo": 30 * 86400, "month": 30 * 86400, "months": 30 * 86400,
    "y": 365 * 86400, "year": 365 * 86400, "years": 365 * 86400,
}
_HEX = set("0123456789abcdef")


class FilterError(ConfigError):
    """A filter or sort expression does not parse; the message names the valid keys and
    operators."""


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """A filterable/sortable field: its name in expressions, its type and the attribute of
    the entry dataclass it reads."""

    name: str
    type: str  # text | id | size | count | age | tiers
    attr: str
    help: str


def _fields(*specs: tuple[str, str, str, str]) -> dict[str, FieldSpec]:
    return {s[0]: FieldSpec(*s) for s in specs}


#: keys of ``kvstore ls`` (namespaces)
NAMESPACE_FIELDS = _fields(
    ("id", "id", "namespace_id", "namespace id (hex prefix)"),
    ("model", "text", "model_id", "model id"),
    ("revision", "text", "model_revision", "model revision / weights digest"),
    ("dtype", "text", "dtype", "KV dtype (bfloat16, float16, ...)"),
    ("layout", "text", "layout", "layout string, e.g. 'bfloat16 L32 P2 T16 H8 D128'"),
    ("blocks", "count", "blocks", "number of blocks"),
    ("size", "size", "stored_bytes", "bytes stored (after the codec)"),
    ("raw", "size", "raw_bytes", "raw bytes of the blocks"),
    ("hits", "count", "hits", "persisted hit count (sum over its blocks)"),
    ("accessed", "age", "last_accessed", "time since the last access"),
    ("created", "age", "created", "time since the oldest block was written"),
    ("tier", "tiers", "tiers", "a tier holding its blocks"),
)

#: keys of ``kvstore ls --blocks``
BLOCK_FIELDS = _fields(
    ("key", "id", "key", "block key (hex prefix)"),
    ("namespace", "id", "namespace_id", "namespace id (hex prefix)"),
    ("model", "text", "model_id", "model id of its namespace"),
    ("parent", "id", "parent", "parent key (hex prefix; 'none' for a first block)"),
    ("size", "size", "stored_bytes", "bytes stored (after the codec)"),
    ("raw", "size", "raw_bytes", "raw bytes"),
    ("codec", "text", "codec", "codec (none, zstd, zstd+shuffle2, ...)"),
    ("segment", "count", "segment", "segment id"),
    ("hits", "count", "hits", "persisted hit count"),
    ("accessed", "age", "last_accessed", "time since the last access"),
    ("created", "age", "created", "time since it was written"),
    ("tier", "tiers", "tiers", "a tier holding it"),
)


def _fields_for(kind: str) -> dict[str, FieldSpec]:
    if kind == "namespaces":
        return NAMESPACE_FIELDS
    if kind == "blocks":
        return BLOCK_FIELDS
    raise ValueError(f"kind must be 'namespaces' or 'blocks', got {kind!r}")


def _key_list(kind: str) -> str:
    return ", ".join(_fields_for(kind))


def parse_duration(text: str) -> float:
    """``"7d"`` -> seconds. Units: s, m/min, h, d, w, mo, y (no unit: seconds)."""
    m = _DURATION_RE.match(text)
    if m is None or m.group(2).lower() not in _DURATION_UNITS:
        raise FilterError(f"{text!r} is not a duration; write a number and a unit: "
                          "30s, 10m, 1h, 7d, 2w, 3mo, 1y")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


@dataclass(frozen=True, slots=True)
class Filter:
    """One parsed ``KEY OP VALUE``; :meth:`matches` tests an entry."""

    text: str
    key: str
    type: str
    attr: str
    op: str
    value: Any  # str (text, id, tiers), int (size, count), float seconds (age), None (parent=none)

    def matches(self, entry: object, now: float) -> bool:
        v = getattr(entry, self.attr)
        t, op, want = self.type, self.op, self.value
        if t == "text":
            s = "" if v is None else str(v)
            if op in ("~", "!~"):
                hit = want.lower() in s.lower()
                return hit if op == "~" else not hit
            return (s == want) if op == "=" else (s != want)
        if t == "id":
            hit = v is None if want is None else v is not None and v.startswith(want)
            return hit if op == "=" else not hit
        if t == "tiers":
            hit = want in v
            return hit if op == "=" else not hit
        x = (math.inf if v is None else now - v) if t == "age" else v
        return _compare(x, op, want)


def _compare(x: float, op: str, want: float) -> bool:
    if op == "=":
        return x == want
    if op == "!=":
        return x != want
    if op == ">":
        return x > want
    if op == ">=":
        return x >= want
    if op == "<":
        return x < want
    return x <= want


def parse_filter(text: str, kind: str = "namespaces") -> Filter:
    """Parse ``KEY OP VALUE`` for ``kind`` (``"namespaces"`` or ``"blocks"``)."""
    fields = _fields_for(kind)
    m = _FILTER_RE.match(text)
    if m is None:
        raise FilterError(
            f"bad filter {text!r}: write KEY OP VALUE, e.g. 'size>1GB', 'accessed>7d', "
            f"'model~llama'; keys for {kind}: {_key_list(kind)}; operators: {' '.join(OPERATORS)}"
        )
    key, op, raw = m.group(1).lower(), m.group(2), m.group(3)
    if op == "==":
        op = "="
    spec = fields.get(key)
    if spec is None:
        other = "blocks" if kind == "namespaces" else "namespaces"
        also = (f" ('{key}' is a key of {other}: "
                f"{'add' if other == 'blocks' else 'drop'} --blocks)") if key in _fields_for(other) else ""
        raise FilterError(f"bad filter {text!r}: unknown key {key!r}{also}; "
                          f"keys for {kind}: {_key_list(kind)}")
    ops = _OPS_BY_TYPE[spec.type]
    if op not in ops:
        raise FilterError(f"bad filter {text!r}: operator {op!r} does not apply to {key!r} "
                          f"({_TYPE_WORDS[spec.type]}); use one of: {' '.join(ops)}")
    return Filter(text, key, spec.type, spec.attr, op, _parse_value(spec, raw, text))


def _parse_value(spec: FieldSpec, raw: str, text: str) -> Any:
    t = spec.type
    where = f"bad filter {text!r}: "
    if t == "text":
        return raw
    if raw == "":
        raise FilterError(where + f"{spec.name!r} needs a value")
    if t == "id":
        v = raw.lower()
        if spec.name == "parent" and v == "none":
            return None
        if not set(v) <= _HEX:
            raise FilterError(where + f"{raw!r} is not hex; {spec.name} takes a hex prefix"
                              + (" or 'none'" if spec.name == "parent" else ""))
        return v
    if t == "size":
        try:
            return parse_size(raw, what=spec.name)
        except SizeError:
            raise FilterError(where + f"{raw!r} is not a size; write e.g. 1GB, 512MiB, "
                              "1.5GiB or a byte count") from None
    if t == "count":
        try:
            return int(raw)
        except ValueError:
            raise FilterError(where + f"{raw!r} is not an integer") from None
    if t == "age":
        try:
            return parse_duration(raw)
        except FilterError as e:
            raise FilterError(where + str(e)) from None
    v = raw.lower()
    if v not in TIERS:
        raise FilterError(where + f"unknown tier {raw!r}; tiers: {', '.join(TIERS)}")
    return v


@dataclass(frozen=True, slots=True)
class SortSpec:
    """``KEY[:asc|desc]``. Text and id keys default to ascending, sizes and counts to
    descending (largest first), ages to most recent first."""

    key: str
    attr: str
    type: str
    descending: bool

    def sort(self, items: list[Any]) -> list[Any]:
        t = self.type

        def k(e: Any) -> Any:
            v = getattr(e, self.attr)
            if t in ("text", "id"):
                return (v is None, "" if v is None else str(v).lower())
            if t == "tiers":
                return (len(v), ",".join(v))
            if v is None:  # never accessed: oldest
                return -math.inf
            return v

        return sorted(items, key=k, reverse=self.descending)


def parse_sort(text: str, kind: str = "namespaces") -> SortSpec:
    """Parse ``KEY[:asc|desc]`` for ``kind``."""
    fields = _fields_for(kind)
    key, _, order = text.strip().partition(":")
    key = key.strip().lower()
    spec = fields.get(key)
    if spec is None:
        raise FilterError(f"bad sort {text!r}: unknown key {key!r}; keys for {kind}: "
                          f"{_key_list(kind)} (append :asc or :desc)")
    order = order.strip().lower()
    if order not in ("", "asc", "desc"):
        raise FilterError(f"bad sort {text!r}: order must be 'asc' or 'desc', got {order!r}")
    desc = order == "desc" if order else spec.type in ("size", "count", "age")
    return SortSpec(key, spec.attr, spec.type, desc)


def apply(
    items: Iterable[Any],
    filters: Sequence[Filter] = (),
    sort: SortSpec | None = None,
    limit: int | None = None,
    *,
    now: float | None = None,
    default_key: Callable[[Any], Any] | None = None,
) -> tuple[list[Any], int]:
    """Filter (all must match), sort, limit. Returns (the items, how many matched before the
    limit)."""
    now = time.time() if now is None else now
    out = [e for e in items if all(f.matches(e, now) for f in filters)]
    if sort is not None:
        out = sort.sort(out)
    elif default_key is not None:
        out.sort(key=default_key)
    matched = len(out)
    if limit is not None:
        if limit < 0:
            raise FilterError(f"--limit must be >= 0, got {limit}")
        out = out[:limit]
    return out, matched
