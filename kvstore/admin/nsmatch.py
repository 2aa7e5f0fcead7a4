"""Namespaces as operators name them: the fields that make a namespace id (model, revision,
dtype, layout, TP shard, extras), parsed from command-line words without torch; resolving an
id prefix or a model id against the namespaces registered in a store; and naming the fields
in which two namespaces differ (``kvstore explain``, ``kvstore import``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.admin.common import AdminError
from kvstore.admin.inventory import layout_string
from kvstore.namespace import FORMAT_VERSION  # torch-free
from kvstore.tiers.disk import DTYPE_SIZES, NamespaceInfo, namespace_record_id

__all__ = [
    "FORMAT_VERSION",
    "FieldDiff",
    "NamespaceFields",
    "NamespaceMatch",
    "NamespaceNotFoundError",
    "closest",
    "differences",
    "parse_extras",
    "parse_layout",
    "resolve_namespace",
]

_HEX = re.compile(r"^[0-9a-fA-F]+$")
_LAYOUT_PART = re.compile(r"^([LPTHD])(\d+)$")
_TP_PART = re.compile(r"^tp(\d+)/(\d+)$")


class NamespaceNotFoundError(AdminError):
    """No registered namespace matches (or several do); the message lists candidates."""


@dataclass(frozen=True, slots=True)
class NamespaceFields:
    """Everything a namespace id hashes (``docs/architecture.md`` "Keys"), torch-free."""

    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    kv_planes: int
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION
    extras: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_info(cls, i: NamespaceInfo) -> NamespaceFields:
        return cls(i.model_id, i.model_revision, i.dtype, i.num_layers, i.kv_planes,
                   i.block_tokens, i.num_kv_heads, i.head_dim, i.tp_rank, i.tp_size,
                   i.format_version, tuple(tuple(kv) for kv in i.extras))  # type: ignore[misc]

    def record_fields(self) -> tuple:
        """The fields in the order of the index's namespace record (``encode_namespace``)."""
        return (self.model_id, self.model_revision, self.dtype, self.num_layers, self.kv_planes,
                self.block_tokens, self.num_kv_heads, self.head_dim, self.tp_rank, self.tp_size,
                self.format_version, self.extras)

    @property
    def id(self) -> bytes:
        nid = namespace_record_id(self.record_fields())
        if nid is None:
            raise AdminError(f"not a valid namespace: {self}")
        return nid

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.kv_planes, self.block_tokens, self.num_kv_heads,
                self.head_dim)

    @property
    def layout(self) -> str:
        return layout_string(self.dtype, self.block_shape, self.tp_rank, self.tp_size)

    @property
    def block_nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.block_shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class FieldDiff:
    """One field in which the namespace asked for differs from a stored one."""

    field: str  # model | revision | dtype | layout | tp_rank | tp_size | extras | format_version
    wanted: str
    stored: str


@dataclass(frozen=True, slots=True)
class NamespaceMatch:
    """A registered namespace and how it differs from the one asked for."""

    namespace_id: str
    model_id: str
    layout: str
    differs: tuple[FieldDiff, ...]


def parse_layout(text: str, *, model_id: str, revision: str = "", tp_rank: int | None = None,
                 tp_size: int | None = None,
                 extras: Sequence[tuple[str, str]] = ()) -> NamespaceFields:
    """Fields from a layout as ``kvstore ls`` prints it: ``"bfloat16 L32 P2 T16 H8 D128"``,
    optionally ``" tp0/2"`` (``P`` defaults to 2). ``tp_rank``/``tp_size`` override it."""
    dtype, dims, tp = None, {}, (0, 1)
    for part in text.replace(",", " ").split():
        if part in DTYPE_SIZES:
            dtype = part
        elif (m := _LAYOUT_PART.match(part)) is not None:
            dims[m.group(1)] = int(m.group(2))
        elif (m := _TP_PART.match(part)) is not None:
            tp = (int(m.group(1)), int(m.group(2)))
        else:
            raise AdminError(f"bad --layout {text!r}: {part!r} is neither a dtype "
                             f"({', '.join(DTYPE_SIZES)}), L/P/T/H/D<n> nor tpR/N; write it as "
                             "'kvstore ls' prints it, e.g. 'bfloat16 L32 P2 T16 H8 D128'")
    missing = [c for c in "LTHD" if c not in dims]
    if dtype is None or missing:
        raise AdminError(f"bad --layout {text!r}: missing "
                         + ", ".join((["a dtype"] if dtype is None else []) + missing)
                         + "; e.g. 'bfloat16 L32 P2 T16 H8 D128'")
    rank = tp[0] if tp_rank is None else tp_rank
    size = tp[1] if tp_size is None else tp_size
    if min(dims.values()) < 1 or dims.get("P", 2) not in (1, 2) or not 0 <= rank < size:
        raise AdminError(f"bad --layout {text!r}: sizes must be >= 1, P 1 or 2, and the TP "
                         f"rank in [0, size) (got tp{rank}/{size})")
    if not model_id:
        raise AdminError("--model must name the model (the model_id the engine passes)")
    return NamespaceFields(model_id, revision, dtype, dims["L"], dims.get("P", 2), dims["T"],
                           dims["H"], dims["D"], rank, size, FORMAT_VERSION,
                           tuple(sorted(extras)))


def parse_extras(items: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` words (``--extra``) as the namespace's canonical extras (values as the
    engine passed them: a str stays itself; ints and bools are written as Python prints
    them, e.g. ``lora=3``)."""
    out: dict[str, str] = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise AdminError(f"bad --extra {it!r}: write KEY=VALUE")
        out[k] = v
    return tuple(sorted(out.items()))


def differences(wanted: NamespaceFields, stored: NamespaceFields) -> tuple[FieldDiff, ...]:
    """The fields in which ``stored`` differs from ``wanted``, most telling first."""
    out = []

    def cmp(name: str, a: object, b: object) -> None:
        if a != b:
            out.append(FieldDiff(name, str(a), str(b)))

    cmp("model", wanted.model_id, stored.model_id)
    cmp("revision", wanted.model_revision or "-", stored.model_revision or "-")
    cmp("dtype", wanted.dtype, stored.dtype)
    shape = "L{} P{} T{} H{} D{}"
    cmp("layout", shape.format(*wanted.block_shape), shape.format(*stored.block_shape))
    cmp("tp_rank", wanted.tp_rank, stored.tp_rank)
    cmp("tp_size", wanted.tp_size, stored.tp_size)
    cmp("extras", _extras_text(wanted.extras), _extras_text(stored.extras))
    cmp("format_version", wanted.format_version, stored.format_version)
    return tuple(out)


def _extras_text(extras: Sequence[tuple[str, str]]) -> str:
    return ",".join(f"{k}={v}" for k, v in extras) or "-"


def match_of(wanted: NamespaceFields, info: NamespaceInfo) -> NamespaceMatch:
    stored = NamespaceFields.from_info(info)
    return NamespaceMatch(info.namespace_id.hex(), info.model_id, stored.layout,
                          differences(wanted, stored))


def closest(wanted: NamespaceFields, infos: Iterable[NamespaceInfo],
            limit: int = 3) -> tuple[NamespaceMatch, ...]:
    """Registered namespaces nearest to ``wanted``: fewest differing fields, then the most
    similar model id (a typo'd ``model_id`` ranks its intended namespace first)."""
    scored = []
    for info in infos:
        m = match_of(wanted, info)
        if not m.differs:
            continue
        sim = difflib.SequenceMatcher(None, wanted.model_id.lower(),
                                      info.model_id.lower()).ratio()
        scored.append((len(m.differs), -sim, m.namespace_id, m))
    scored.sort(key=lambda s: s[:3])
    return tuple(s[3] for s in scored[:limit])


def resolve_namespace(text: str, infos: Sequence[NamespaceInfo]) -> NamespaceInfo:
    """The registered namespace ``text`` names: a namespace id or a unique prefix of it (at
    least 4 hex digits), else an exact model id naming exactly one namespace."""
    t = text.strip()
    if len(t) >= 4 and _HEX.match(t):
        hits = [i for i in infos if i.namespace_id.hex().startswith(t.lower())]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise NamespaceNotFoundError(
                f"namespace prefix {t!r} is ambiguous: {_listing(hits)}; give more digits")
    hits = [i for i in infos if i.model_id == t]
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise NamespaceNotFoundError(f"model {t!r} has {len(hits)} namespaces in this store "
                                     f"({_listing(hits)}); name one by its id")
    near = difflib.get_close_matches(t, sorted({i.model_id for i in infos}), n=3)
    hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else "."
    known = _listing(infos) if infos else "the store has no namespace"
    raise NamespaceNotFoundError(f"no namespace matches {t!r} (ids: >= 4 hex digits, or an "
                                 f"exact model id){hint} Known: {known}")


def _listing(infos: Iterable[NamespaceInfo], n: int = 5) -> str:
    items = list(infos)
    parts = [f"{i.namespace_id.hex()[:12]} ({i.model_id}, "
             f"{layout_string(i.dtype, i.block_shape, i.tp_rank, i.tp_size)})" for i in items[:n]]
    return ", ".join(parts) + (f", +{len(items) - n} more" if len(items) > n else "")


def info_map(infos: Iterable[NamespaceInfo]) -> Mapping[bytes, NamespaceInfo]:
    return {i.namespace_id: i for i in infos}
