"""What a store holds: namespaces and blocks (``kvstore ls``), a store summary (``kvstore
inspect``) and counters (``kvstore stats`` on a path).

Everything here opens the disk tier read-only: no write lock, nothing changed (not even
access times), safe next to running engines and daemons (LMDB readers never block writers).
Records are read in chunks of short transactions, so a listing taken while engines write is
a consistent view of each chunk, not of the whole store.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.admin.common import AdminError, open_disk
from kvstore.admin.filters import Filter, SortSpec, apply, parse_filter, parse_sort

__all__ = [
    "BlockEntry",
    "Fragmentation",
    "HitCounters",
    "IndexInfo",
    "Listing",
    "NamespaceEntry",
    "NamespaceStats",
    "PathStats",
    "StoreSummary",
    "TargetSummary",
    "TierUsage",
    "inspect_store",
    "inspect_target",
    "layout_string",
    "list_blocks",
    "list_namespaces",
    "store_stats",
]

#: segments below this live fraction count as sparse in ``inspect`` (the default of
#: ``kvstore compact``)
SPARSE_THRESHOLD = 0.5


@dataclass(frozen=True, slots=True)
class NamespaceEntry:
    """One namespace (model, revision, layout, TP shard) and what the store holds of it."""

    namespace_id: str  # 64 hex digits
    model_id: str
    model_revision: str
    dtype: str
    layout: str  # "bfloat16 L32 P2 T16 H8 D128" (+ " tp0/2" when sharded)
    block_shape: tuple[int, int, int, int, int]  # [num_layers, kv_planes, block_tokens, heads, head_dim]
    block_nbytes: int
    tp_rank: int
    tp_size: int
    format_version: int
    extras: tuple[tuple[str, str], ...]
    blocks: int
    stored_bytes: int
    raw_bytes: int
    hits: int  # sum of the blocks' persisted hit counters
    created: float | None  # oldest block, seconds since the epoch
    last_accessed: float | None  # newest access of any block
    tiers: tuple[str, ...]  # tiers holding blocks of it: ("disk",) or ()


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block on disk."""

    key: str  # 64 hex digits
    namespace_id: str
    model_id: str  # "" when its namespace record is unreadable
    parent: str | None  # None for the first block of a prompt
    stored_bytes: int
    raw_bytes: int
    codec: str
    segment: int
    offset: int
    checksum: str  # xxh3_64 of the raw bytes, 16 hex digits
    created: float
    last_accessed: float
    hits: int
    tiers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Listing:
    """Result of :func:`list_namespaces` / :func:`list_blocks`."""

    store: str
    kind: str  # "namespaces" | "blocks"
    items: tuple[NamespaceEntry, ...] | tuple[BlockEntry, ...]
    matched: int  # items that passed the filters (before --limit)
    total: int  # items in the store (before the filters)
    stored_bytes: int  # sum over `items`
    filters: tuple[str, ...]
    sort: str | None

    @property
    def ids(self) -> list[str]:
        """Namespace ids or block keys of the items (what ``ls -q`` prints)."""
        if self.kind == "namespaces":
            return [e.namespace_id for e in self.items]
        return [e.key for e in self.items]


def layout_string(dtype: str, shape: Sequence[int], tp_rank: int = 0, tp_size: int = 1) -> str:
    L, P, T, H, D = shape
    s = f"{dtype} L{L} P{P} T{T} H{H} D{D}"
    return s + (f" tp{tp_rank}/{tp_size}" if tp_size > 1 else "")


class _Agg:
    __slots__ = ("blocks", "stored", "raw", "hits", "created", "last")

    def __init__(self) -> None:
        self.blocks = self.stored = self.raw = self.hits = 0
        self.created: float | None = None
        self.last: float | None = None

    def add(self, r) -> None:  # a DiskRecord
        self.blocks += 1
        self.stored += r.stored_nbytes
        self.raw += r.raw_nbytes
        self.hits += r.hits
        if self.created is None or r.created < self.created:
            self.created = r.created
        if self.last is None or r.last_access > self.last:
            self.last = r.last_access


def _namespace_entries(tier, aggs: dict[bytes, _Agg]) -> list[NamespaceEntry]:
    out = []
    infos = {i.namespace_id: i for i in tier.namespaces()}
    for nid, info in infos.items():
        a = aggs.get(nid) or _Agg()
        out.append(NamespaceEntry(
            namespace_id=nid.hex(), model_id=info.model_id, model_revision=info.model_revision,
            dtype=info.dtype, layout=layout_string(info.dtype, info.block_shape, info.tp_rank,
                                                   info.tp_size),
            block_shape=tuple(info.block_shape), block_nbytes=info.block_nbytes,
            tp_rank=info.tp_rank, tp_size=info.tp_size, format_version=info.format_version,
            extras=tuple(tuple(kv) for kv in info.extras), blocks=a.blocks,
            stored_bytes=a.stored, raw_bytes=a.raw, hits=a.hits, created=a.created,
            last_accessed=a.last, tiers=("disk",) if a.blocks else (),
        ))
    for nid, a in aggs.items():  # blocks whose namespace record is unreadable
        if nid not in infos:
            out.append(NamespaceEntry(
                namespace_id=nid.hex(), model_id="", model_revision="", dtype="", layout="?",
                block_shape=(0, 0, 0, 0, 0), block_nbytes=0, tp_rank=0, tp_size=1,
                format_version=0, extras=(), blocks=a.blocks, stored_bytes=a.stored,
                raw_bytes=a.raw, hits=a.hits, created=a.created, last_accessed=a.last,
                tiers=("disk",),
            ))
    return out


def _scan_namespaces(tier) -> list[NamespaceEntry]:
    aggs: dict[bytes, _Agg] = {}
    for r in tier.records():
        a = aggs.get(r.namespace_id)
        if a is None:
            a = aggs[r.namespace_id] = _Agg()
        a.add(r)
    return _namespace_entries(tier, aggs)


def _parse(filters: Iterable[str | Filter], sort: str | SortSpec | None,
           kind: str) -> tuple[list[Filter], SortSpec | None]:
    fs = [f if isinstance(f, Filter) else parse_filter(f, kind) for f in filters]
    ss = sort if sort is None or isinstance(sort, SortSpec) else parse_sort(sort, kind)
    return fs, ss


def list_namespaces(
    path: str | os.PathLike[str] | None = None,
    *,
    filters: Iterable[str | Filter] = (),
    sort: str | SortSpec | None = None,
    limit: int | None = None,
    include_empty: bool = False,
    now: float | None = None,
) -> Listing:
    """Namespaces of the store at ``path`` with their block counts, bytes, hits and access
    times. Namespaces without blocks (their record stays after ``rm``: an engine may still
    write to it) are left out unless ``include_empty``. Default order: model, then id."""
    fs, ss = _parse(filters, sort, "namespaces")
    now = time.time() if now is None else now
    with open_disk(path, readonly=True) as t:
        entries = _scan_namespaces(t)
        store = t.path
    if not include_empty:
        entries = [e for e in entries if e.blocks]
    items, matched = apply(entries, fs, ss, limit, now=now,
                           default_key=lambda e: (e.model_id, e.namespace_id))
    return Listing(store, "namespaces", tuple(items), matched, len(entries),
                   sum(e.stored_bytes for e in items), tuple(f.text for f in fs),
                   None if ss is None else f"{ss.key}:{'desc' if ss.descending else 'asc'}")


def list_blocks(
    path: str | os.PathLike[str] | None = None,
    *,
    filters: Iterable[str | Filter] = (),
    sort: str | SortSpec | None = None,
    limit: int | None = None,
    now: float | None = None,
) -> Listing:
    """Every block on disk (filtered, sorted, limited). Default order: model, namespace,
    creation time, key."""
    fs, ss = _parse(filters, sort, "blocks")
    now = time.time() if now is None else now
    with open_disk(path, readonly=True) as t:
        models = {i.namespace_id: i.model_id for i in t.namespaces()}
        entries = [
            BlockEntry(
                key=r.key.hex(), namespace_id=r.namespace_id.hex(),
                model_id=models.get(r.namespace_id, ""),
                parent=None if r.parent is None else r.parent.hex(),
                stored_bytes=r.stored_nbytes, raw_bytes=r.raw_nbytes, codec=r.codec,
                segment=r.segment, offset=r.offset, checksum=f"{r.checksum:016x}",
                created=r.created, last_accessed=r.last_access, hits=r.hits, tiers=("disk",),
            )
            for r in t.records()
        ]
        store = t.path
    items, matched = apply(entries, fs, ss, limit, now=now,
                           default_key=lambda e: (e.model_id, e.namespace_id, e.created, e.key))
    return Listing(store, "blocks", tuple(items), matched, len(entries),
                   sum(e.stored_bytes for e in items), tuple(f.text for f in fs),
                   None if ss is None else f"{ss.key}:{'desc' if ss.descending else 'asc'}")


# -- inspect ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TierUsage:
    """A tier's capacity and use. For a store path only the disk tier exists; memory tiers
    live in the processes (or daemon) that have the store open: ``kvstore stats --socket``."""

    name: str
    capacity_bytes: int | None  # None: not recorded in the store (an engine setting)
    used_bytes: int  # stored bytes of the live blocks
    raw_bytes: int
    blocks: int
    file_bytes: int  # segment files + index on disk
    filesystem_bytes: int  # size of the filesystem holding the store
    filesystem_free_bytes: int  # free for unprivileged users


@dataclass(frozen=True, slots=True)
class Fragmentation:
    """Dead space in the segment files (``kvstore compact`` reclaims it)."""

    segments: int  # segment files referenced by the index
    segment_bytes: int  # their total size (headers included)
    live_bytes: int  # bytes of live blocks in them
    dead_bytes: int  # data bytes of deleted/evicted/duplicate blocks still in them
    live_fraction: float  # live / (live + dead); 1.0 when empty
    sparse_threshold: float
    sparse_segments: int  # segments whose file is less than the threshold live (approximate:
    #                       headers count as not live)
    reclaimable_bytes: int  # bytes not live in the sparse segments
    temp_files: int  # *.tmp: writes in flight, or left by a crash (``kvstore prune``)
    unreferenced_segments: int  # segment files no record points at (``kvstore prune``)
    unreferenced_bytes: int


@dataclass(frozen=True, slots=True)
class IndexInfo:
    path: str
    file_bytes: int  # data.mdb
    blocks: int
    namespaces: int


@dataclass(frozen=True, slots=True)
class HitCounters:
    """What the store itself remembers. Misses are counted only by a running store or
    daemon (``kvstore stats --socket``): None here."""

    hits: int  # sum of the blocks' persisted hit counters (disk reads that served a fetch)
    misses: int | None


@dataclass(frozen=True, slots=True)
class StoreSummary:
    """Result of :func:`inspect_store`."""

    path: str
    format_version: int  # on-disk format (docs/format.md)
    tiers: tuple[TierUsage, ...]
    namespaces: tuple[NamespaceEntry, ...]
    fragmentation: Fragmentation
    index: IndexInfo
    counters: HitCounters


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def inspect_store(path: str | os.PathLike[str] | None = None, *,
                  sparse_threshold: float = SPARSE_THRESHOLD) -> StoreSummary:
    """A summary of the store at ``path``: format, disk use, namespaces, fragmentation,
    index size and persisted counters."""
    from kvstore.tiers.disk import DISK_FORMAT_VERSION, SEGMENT_RE, TEMP_RE

    with open_disk(path, readonly=True) as t:
        st = t.stats()
        aggs: dict[bytes, _Agg] = {}
        live: dict[int, int] = {}
        for r in t.records():
            a = aggs.get(r.namespace_id)
            if a is None:
                a = aggs[r.namespace_id] = _Agg()
            a.add(r)
            live[r.segment] = live.get(r.segment, 0) + r.stored_nbytes
        namespaces = sorted(_namespace_entries(t, aggs), key=lambda e: (e.model_id, e.namespace_id))
        store = t.path
        segdir = os.path.join(store, "segments")
        files: dict[int, int] = {}
        temps = 0
        try:
            entries = list(os.scandir(segdir))
        except FileNotFoundError:
            entries = []
        for de in entries:
            m = SEGMENT_RE.match(de.name)
            try:
                size = de.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            if m:
                files[int(m.group(1), 16)] = size
            elif TEMP_RE.match(de.name):
                temps += 1
        sparse = reclaimable = 0
        for sid, lb in live.items():
            fb = files.get(sid, 0)
            dead = max(0, fb - lb)
            if fb and lb < sparse_threshold * fb:
                sparse += 1
                reclaimable += dead
        unref = [sid for sid in files if sid not in live]
        index_bytes = _file_size(os.path.join(store, "index", "data.mdb"))
        try:
            du = shutil.disk_usage(store)
            fs_total, fs_free = du.total, du.free
        except OSError:
            fs_total = fs_free = 0
        # totals as the index keeps them (dead = data bytes of no live block; headers are
        # not counted), per-segment sparseness from the file sizes (headers counted)
        live_bytes, dead_bytes = st.stored_bytes, st.dead_bytes
        frag = Fragmentation(
            segments=st.segments, segment_bytes=st.segment_bytes, live_bytes=live_bytes,
            dead_bytes=dead_bytes,
            live_fraction=(live_bytes / (live_bytes + dead_bytes)) if live_bytes + dead_bytes
            else 1.0,
            sparse_threshold=sparse_threshold, sparse_segments=sparse,
            reclaimable_bytes=reclaimable, temp_files=temps, unreferenced_segments=len(unref),
            unreferenced_bytes=sum(files[s] for s in unref),
        )
        disk = TierUsage(
            name="disk", capacity_bytes=None, used_bytes=st.stored_bytes, raw_bytes=st.raw_bytes,
            blocks=st.blocks, file_bytes=sum(files.values()) + index_bytes,
            filesystem_bytes=fs_total, filesystem_free_bytes=fs_free,
        )
        index = IndexInfo(os.path.join(store, "index"), index_bytes, st.blocks, len(namespaces))
        hits = sum(a.hits for a in aggs.values())
    return StoreSummary(store, DISK_FORMAT_VERSION, (disk,), tuple(namespaces), frag, index,
                        HitCounters(hits, None))


# -- stats (path) ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class NamespaceStats:
    namespace_id: str
    model_id: str
    blocks: int
    stored_bytes: int
    hits: int


@dataclass(frozen=True, slots=True)
class PathStats:
    """Counters of a store path (what persists: the disk tier's totals and per-block hit
    counters). Live counters (lookups, misses, memory tiers) come from a daemon."""

    store: str
    time: float  # when the sample was taken, seconds since the epoch
    blocks: int
    stored_bytes: int
    raw_bytes: int
    segments: int
    segment_bytes: int
    dead_bytes: int
    hits: int  # persisted hit counters, whole store
    namespaces: tuple[NamespaceStats, ...]


def store_stats(path: str | os.PathLike[str] | None = None, *,
                filters: Iterable[str | Filter] = ()) -> PathStats:
    """Counters of the store at ``path``: totals of the whole store, and per namespace (those
    holding blocks that pass ``filters``, ``kvstore ls`` filters)."""
    fs, _ = _parse(filters, None, "namespaces")
    with open_disk(path, readonly=True) as t:
        st = t.stats()
        ns = [e for e in _scan_namespaces(t) if e.blocks]
        store = t.path
    hits = sum(e.hits for e in ns)
    ns, _ = apply(ns, fs, None, None, default_key=lambda e: (e.model_id, e.namespace_id))
    per = tuple(NamespaceStats(e.namespace_id, e.model_id, e.blocks, e.stored_bytes, e.hits)
                for e in ns)
    return PathStats(store, time.time(), st.blocks, st.stored_bytes, st.raw_bytes, st.segments,
                     st.segment_bytes, st.dead_bytes, hits, per)


@dataclass(frozen=True, slots=True)
class TargetSummary:
    """Result of :func:`inspect_target`: the namespaces and blocks a target names."""

    store: str
    target: str  # as given
    namespaces: tuple[NamespaceEntry, ...]
    blocks: tuple[BlockEntry, ...]


def inspect_target(path: str | os.PathLike[str] | None, target: str, *,
                   now: float | None = None) -> TargetSummary:
    """Every field of what ``target`` names in the store at ``path``: namespaces whose id and
    blocks whose key start with it (a hex prefix of at least 4 digits, as ``kvstore rm``
    takes), or the namespaces of a model id. Raises :class:`AdminError` when nothing
    matches."""
    from kvstore.admin.removal import MIN_PREFIX

    t = target.strip()
    hexid = t.lower()
    if t and set(hexid) <= set("0123456789abcdef"):
        if len(hexid) < MIN_PREFIX:
            raise AdminError(f"target {target!r} is too short: give at least {MIN_PREFIX} hex "
                             "digits of a namespace id or block key")
        ns = list_namespaces(path, filters=[f"id={hexid}"], include_empty=True,
                             now=now)
        blocks = list_blocks(path, filters=[f"key={hexid}"], now=now).items
    else:
        ns = list_namespaces(path, filters=[f"model={t}"], include_empty=True,
                             now=now)
        blocks = ()
    if not ns.items and not blocks:
        raise AdminError(f"nothing in {ns.store} matches {target!r}: give a namespace id or "
                         "block key (or a unique prefix of >= 4 hex digits) or a model id; "
                         "'kvstore ls' lists namespaces, 'kvstore ls --blocks' blocks")
    return TargetSummary(ns.store, target, ns.items, blocks)  # type: ignore[arg-type]
