"""``DiskTier.check``: consistency check and repair of a disk tier.

Safe while other processes use the store: unreferenced files younger than the grace period are
left alone (an in-flight writer links its segment into place before committing the records), anything
that looks missing is re-checked against a fresh transaction before it is reported, and repairs
remove records only if they still are the ones that were found bad, records before files.

A block whose segment header is damaged (unreadable, or not listing the block at its recorded
place) but whose bytes still verify against its index record — the checksum is bound to key
and namespace, so bytes that verify are this block's — is not dropped: it is copied into a
fresh segment and its record moved there (:func:`rewrite_unlisted`), as compaction does.
A segment file is never modified in place.
"""


from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvstore.tiers import codec as _codec
from kvstore.tiers.base import ReadStatus
from kvstore.tiers.disk import segments as _seg
from kvstore.tiers.disk import tombstones as _tomb
from kvstore.tiers.disk.compaction import rewrite
from kvstore.tiers.disk.index import (
    BE64,
    DB_BLOCKS,
    DB_CHILDREN,
    DB_LRU,
    DB_META,
    DB_SEGS,
    META_TOTALS,
    TOTALS,
    U32,
    Rec,
    RecordError,
    SegInfo,
    decode_record,
    decode_seginfo,
    encode_seginfo,
    lru_key,
    parent_dbkey,
)
from kvstore.tiers.disk.inflight import in_flight, unlink_unless_in_flight
from kvstore.tiers.disk.reads import UNAVAILABLE, read_payload, read_rec
from kvstore.tiers.disk.records import Finding, NamespaceInfo, ns_cache_entry
from kvstore.tiers.disk.txn import drop_damaged, drop_entries, unlink_segments, write_raw

log = logging.getLogger("kvstore.disk")

if TYPE_CHECKING:
    from kvstore.tiers.disk.context import DiskContext
    from kvstore.tiers.disk.env import SharedEnv

#: a record found bad: (index key, its record or None, finding kind, detail)
BadKey = tuple[bytes, Rec | None, str, str]


@dataclass(frozen=True, slots=True)
class FixScope:
    """Which findings ``run_check(fix=True)`` may repair: a plan that was shown and
    confirmed. Anything else found is reported unfixed."""

    keys: frozenset[bytes] = frozenset()  # record findings, by index key or block key
    files: frozenset[str] = frozenset()  # orphan segments and temp files, by path
    index: bool = False  # rebuild inconsistent side indexes


@dataclass(slots=True)
class _Snapshot:
    """One consistent snapshot of the index, and what was wrong in it."""

    recs: list[tuple[bytes, Rec]] = field(default_factory=list)
    bad_keys: list[BadKey] = field(default_factory=list)
    segs: dict[int, SegInfo] = field(default_factory=dict)
    index_problems: list[str] = field(default_factory=list)
    children: dict[bytes, int] = field(default_factory=dict)
    lru: set[bytes] = field(default_factory=set)
    totals: list[int] = field(default_factory=list)


def run_check(ctx: DiskContext, *, fix: bool, grace_s: float, verify_data: bool,
              scope: FixScope | None = None, max_segment_bytes: int) -> list[Finding]:
    """The body of ``DiskTier.check``; with ``scope``, ``fix`` repairs only what it names.
    The tier has checked that it is open (writable, with ``fix``) and persisted its touches."""
    findings: list[Finding] = []
    now = time.time()
    # 1. files (listed before the index snapshot: a file committed in between is re-stat'ed)
    files, temps = _list_files(ctx.segdir, findings)
    # 2. one consistent snapshot of the index
    snap = _snapshot(ctx.sh)
    good = _known_records(ctx, snap)
    # 3. side indexes against the records
    snap.index_problems.extend(_side_index_problems(snap))
    # 4. segment files against the index
    by_seg, flagged, orphans = _check_segment_files(ctx, good, files, snap, now, grace_s)
    # a file a writer holds is in flight whatever its mtime says (the clock may have jumped)
    stale_temps = [p for p, mt in temps if _aged(now, mt, grace_s) and not in_flight(p)]
    # 5. data: every remaining block read back and verified (plus its header entry)
    header_bad = _verify_data(ctx, by_seg, flagged, snap.bad_keys) if verify_data else []

    # 6. report and repair: records first, then headers, then side indexes, then files
    def allowed(k: bytes) -> bool:  # scope keys: index keys or block keys
        return scope is None or k in scope.keys or k[-32:] in scope.keys

    findings += _repair_records(ctx, fix, allowed, snap.bad_keys, header_bad, max_segment_bytes)
    index_fixed = False
    if snap.index_problems and fix and (scope is None or scope.index):
        dead = rebuild_side_indexes(ctx.sh, ctx.segdir, lambda fn: write_raw(ctx, fn))
        unlink_segments(ctx, dead)
        index_fixed = True
    for p in snap.index_problems:
        findings.append(Finding("bad_index", ctx.index_dir, None, p, index_fixed))

    def remove(path: str) -> bool:
        # under the file's lock: a writer that created it after our look and locked it since
        # keeps it
        return fix and (scope is None or path in scope.files) and unlink_unless_in_flight(path)

    for path in stale_temps:
        findings.append(Finding("temp_file", path, None, "temporary file of an interrupted write",
                                remove(path)))
    for path in orphans:
        findings.append(Finding("orphan_segment", path, None,
                                "segment file not referenced by the index", remove(path)))
    return findings


def _list_files(segdir: str, findings: list[Finding]
                ) -> tuple[dict[int, os.stat_result], list[tuple[str, float]]]:
    """Segment files by id and temp files (path, mtime) in ``segdir``; anything else is an
    ``unknown_file`` finding."""
    files: dict[int, os.stat_result] = {}
    temps: list[tuple[str, float]] = []
    try:
        entries = list(os.scandir(segdir))
    except FileNotFoundError:
        entries = []
    for de in entries:
        m = _seg.SEGMENT_RE.match(de.name)
        try:
            st = de.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if m:
            files[int(m.group(1), 16)] = st
        elif _seg.TEMP_RE.match(de.name):
            temps.append((de.path, st.st_mtime))
        elif _seg.QUARANTINE_RE.match(de.name):
            findings.append(Finding(
                "quarantined_segment", de.path, None,
                "a segment whose blocks did not verify against their records (its file "
                "swapped or overwritten?); kept: `kvstore recover --force` restores what in it "
                "still verifies; delete it once not needed", False))
        else:
            findings.append(Finding("unknown_file", de.path, None,
                                    "not a segment or temp file of this tier; left alone", False))
    return files, temps


def _snapshot(sh: SharedEnv) -> _Snapshot:
    snap = _Snapshot()
    with sh.read() as txn:
        for k, v in txn.cursor(db=sh.dbs[DB_SEGS]):
            try:
                snap.segs[BE64.unpack(k)[0]] = decode_seginfo(v)
            except (RecordError, Exception):
                snap.index_problems.append(f"segment record {k.hex()} does not decode")
        for k, v in txn.cursor(db=sh.dbs[DB_BLOCKS]):
            if len(k) != 64:  # namespace id ‖ key
                snap.bad_keys.append((k, None, "bad_record", f"index key of {len(k)} bytes"))
                continue
            try:
                r = decode_record(v)
            except RecordError as e:
                snap.bad_keys.append((k, None, "bad_record", str(e)))
                continue
            if r.namespace_id != k[:32]:
                snap.bad_keys.append((k, r, "bad_record", "record names another namespace than "
                                      "the key space it is stored in"))
                continue
            snap.recs.append((k, r))
        snap.children = {k: U32.unpack(v)[0] for k, v in txn.cursor(db=sh.dbs[DB_CHILDREN])}
        snap.lru = {k for k, _ in txn.cursor(db=sh.dbs[DB_LRU])}
        snap.totals = list(TOTALS.unpack(txn.get(META_TOTALS, db=sh.dbs[DB_META])))
    return snap


def _known_records(ctx: DiskContext, snap: _Snapshot) -> list[tuple[bytes, Rec]]:
    """The records of a known codec and namespace; the others are ``bad_record``."""
    ctx.namespaces.load()
    good: list[tuple[bytes, Rec]] = []
    for k, r in snap.recs:
        if r.codec not in _codec.CODEC_NAMES:
            snap.bad_keys.append((k, r, "bad_record", f"unknown codec id {r.codec}"))
        elif not ctx.namespaces.cached(r.namespace_id):
            snap.bad_keys.append((k, r, "bad_record",
                                  f"unknown namespace {r.namespace_id.hex()[:16]}"))
        else:
            good.append((k, r))
    return good


def _side_index_problems(snap: _Snapshot) -> list[str]:
    """Where the children counts, the LRU index, segment accounting and totals disagree
    with the block records."""
    recs, segs, totals = snap.recs, snap.segs, snap.totals
    problems: list[str] = []
    exp_children = Counter(parent_dbkey(r) for _, r in recs if r.parent is not None)
    if dict(exp_children) != snap.children:
        problems.append("children counts do not match the records")
    exp_lru = {lru_key(r.last_access_us, k) for k, r in recs if not exp_children.get(k)}
    if exp_lru != snap.lru:
        problems.append(f"LRU index has {len(snap.lru - exp_lru)} stale and "
                        f"{len(exp_lru - snap.lru)} missing entries")
    live: dict[int, list[int]] = {}
    for _, r in recs:
        s = live.setdefault(r.segment, [0, 0])
        s[0] += 1
        s[1] += r.stored_nbytes
    for sid, (n, b) in live.items():
        s = segs.get(sid)
        if s is None:
            problems.append(f"segment {sid:016x} is referenced but has no segment record")
        elif (s.live_count, s.live_bytes) != (n, b):
            problems.append(f"segment {sid:016x} accounting is {s.live_count} blocks/"
                            f"{s.live_bytes} bytes, records say {n}/{b}")
    for sid in segs.keys() - live.keys():
        problems.append(f"segment record {sid:016x} has no live blocks")
    exp_tot = [len(recs), sum(r.stored_nbytes for _, r in recs), sum(r.raw_nbytes for _, r in recs)]
    if totals[:3] != exp_tot or totals[3] != len(segs):
        problems.append(f"totals {totals[:4]} do not match the index {exp_tot + [len(segs)]}")
    return problems


def _check_segment_files(ctx: DiskContext, good: list[tuple[bytes, Rec]],
                         files: dict[int, os.stat_result], snap: _Snapshot, now: float,
                         grace_s: float
                         ) -> tuple[dict[int, list[tuple[bytes, Rec]]], set[bytes], list[str]]:
    """Records whose segment is missing or too short (``bad_keys``), and the orphan segment
    files past the grace period. Returns (good records by segment, keys flagged, orphans)."""
    segdir, segs = ctx.segdir, snap.segs
    by_seg: dict[int, list[tuple[bytes, Rec]]] = {}
    for k, r in good:
        by_seg.setdefault(r.segment, []).append((k, r))
    flagged: set[bytes] = set()
    for sid, items in by_seg.items():
        path = os.path.join(segdir, _seg.segment_name(sid))
        st = files.get(sid)
        if st is None:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
        if st is None:
            for k, r in items:
                cur = ctx.get_rec(k)
                if cur is not None and (cur.segment, cur.offset) == (r.segment, r.offset):
                    snap.bad_keys.append((k, r, "missing_segment",
                                          f"segment file {path} is missing"))
                    flagged.add(k)
            continue
        expect = segs[sid].file_bytes if sid in segs else 0
        for k, r in items:
            if r.offset + r.stored_nbytes > st.st_size:
                snap.bad_keys.append((k, r, "short_segment",
                                      f"segment has {st.st_size} bytes (expected {expect}); "
                                      f"block at {r.offset}+{r.stored_nbytes} is cut off"))
                flagged.add(k)
    referenced = set(segs) | set(by_seg)
    orphans = []
    for sid, st in files.items():
        if sid in referenced:
            continue
        path = os.path.join(segdir, _seg.segment_name(sid))
        # in flight first: a writer releases its file only after the index references it
        if (_aged(now, st.st_mtime, grace_s) and not in_flight(path)
                and _unreferenced(ctx.sh, sid)):
            orphans.append(path)
    return by_seg, flagged, orphans


def _verify_data(ctx: DiskContext, by_seg: dict[int, list[tuple[bytes, Rec]]], flagged: set[bytes],
                 bad_keys: list[BadKey]) -> list[tuple[bytes, Rec, str]]:
    """Read back and verify every block not flagged yet; a failure is a ``bad_keys`` entry.
    Returns the blocks whose bytes verify but whose segment header does not list them."""
    segdir = ctx.segdir
    header_bad: list[tuple[bytes, Rec, str]] = []
    scratch: dict[int, np.ndarray] = {}
    for sid, items in by_seg.items():
        listing = segment_listing(segdir, sid)
        if listing is None:
            continue  # moved by a concurrent compaction (checked per record below)
        for k, r in items:
            if k in flagged:
                continue
            problem = listing_problem(listing, k, r.offset, r.stored_nbytes, rec_expect(ctx, r))
            buf = scratch.get(r.raw_nbytes)
            if buf is None:
                buf = scratch[r.raw_nbytes] = np.empty(r.raw_nbytes, dtype=np.uint8)
            status, why = read_rec(ctx, k, r, memoryview(buf))
            if status is ReadStatus.OK:
                if problem is not None:
                    header_bad.append((k, r, problem))
                continue
            if why.startswith(UNAVAILABLE):  # out of descriptors, say: not damage, kept
                log.warning("disk tier %s: block %s not checked: %s", ctx.path,
                            k[-32:].hex()[:16], why)
                continue
            cur = ctx.get_rec(k)
            if cur is None or (cur.segment, cur.offset) != (r.segment, r.offset):
                continue  # changed meanwhile
            kind = why.split(" ", 1)[0] if why.split(" ", 1)[0] in (
                "missing_segment", "short_segment", "checksum_mismatch") else "checksum_mismatch"
            bad_keys.append((k, r, kind, why or kind))
            flagged.add(k)
    return header_bad


def _repair_records(ctx: DiskContext, fix: bool, allowed: Callable[[bytes], bool],
                    bad_keys: list[BadKey], header_bad: list[tuple[bytes, Rec, str]],
                    max_segment_bytes: int) -> list[Finding]:
    """Findings of bad records (dropped with ``fix``) and of blocks their segment header
    does not list (rewritten into a fresh segment with ``fix``), in that order."""
    segdir = ctx.segdir
    findings: list[Finding] = []
    fixed_keys: set[bytes] = set()
    todo = [(k, r) for k, r, _, _ in bad_keys if allowed(k)]
    if fix and todo:
        fixed_keys = set(drop_entries(ctx, todo, reason=_tomb.Reason.PRUNED))
        # a record removed by someone else meanwhile is fixed too
        for k, _r in todo:
            if ctx.get_rec(k) is None:
                fixed_keys.add(k)
    for k, r, kind, detail in bad_keys:
        path = os.path.join(segdir, _seg.segment_name(r.segment)) if r is not None else ctx.index_dir
        findings.append(Finding(kind, path, k[-32:], detail, k in fixed_keys))
    repaired: set[bytes] = set()
    redo = [k for k, _r, _ in header_bad if allowed(k)]
    if fix and redo:
        res = rewrite_unlisted(ctx, redo, max_segment_bytes)
        repaired = set(res.rewritten) | set(res.unchanged) | set(res.dropped)
    for k, r, detail in header_bad:
        path = os.path.join(segdir, _seg.segment_name(r.segment))
        findings.append(Finding("bad_header", path, k[-32:], f"{detail}; the block's bytes verify",
                                k in repaired))
    return findings


# -- segment headers ---------------------------------------------------------------------------

class Listed(NamedTuple):
    """One tensor of a segment header: where its bytes are, and what it says they are."""

    offset: int  # absolute
    nbytes: int
    dtype: object  # as the header has them (not checked here)
    shape: object


#: ``name -> Listed`` of a readable header, a string saying why the header is unreadable, or
#: None when the file is gone (moved or removed meanwhile)
Listing = dict[str, Listed] | str | None


def segment_listing(segdir: str, sid: int) -> Listing:
    """What the header of segment ``sid`` lists (see :data:`Listing`)."""
    path = os.path.join(segdir, _seg.segment_name(sid))
    try:
        obj, start, _ = _seg.read_header(path)
        return {name: Listed(off, n, obj[name].get("dtype"), obj[name].get("shape"))
                for name, (off, n) in _seg.header_tensors(obj, start).items()}
    except FileNotFoundError:
        return None
    except (OSError, _seg.SegmentFormatError, AttributeError) as e:
        return f"segment header unreadable: {e}"


def expected_tensor(codec: str, stored_nbytes: int,
                    ns: NamespaceInfo | None) -> tuple[str, list[int]] | None:
    """The dtype and shape a segment header gives a block stored with ``codec`` in namespace
    ``ns`` (format.md, "Segment files"); None when the namespace is not known."""
    if codec != "none":
        return "U8", [stored_nbytes]
    if ns is None:
        return None
    c = ns_cache_entry(ns)
    return c.st_dtype, list(c.shape)


def rec_expect(ctx: DiskContext, rec: Rec) -> tuple[str, list[int]] | None:
    """:func:`expected_tensor` of an index record, with the namespace the tier knows."""
    ns = ctx.namespaces.get(rec.namespace_id)
    return expected_tensor(_codec.CODEC_NAMES.get(rec.codec, "?"), rec.stored_nbytes,
                           None if ns is None else ns.info)


def listing_problem(listing: Listing, key: bytes, offset: int, nbytes: int,
                    expect: tuple[str, list[int]] | None = None) -> str | None:
    """Why ``listing`` does not describe block ``key`` at ``offset`` (None: it does, or the
    file is gone); with ``expect`` (:func:`expected_tensor`), also with that dtype and shape."""
    if listing is None:
        return None
    if isinstance(listing, str):
        return listing
    got = listing.get(key[-32:].hex())  # the block key or its dbkey
    if got is None or (got.offset, got.nbytes) != (offset, nbytes):
        return "segment header does not list this block at the recorded offset"
    if expect is not None and (got.dtype, got.shape) != expect:
        return (f"segment header says dtype {got.dtype!r} shape {got.shape!r}; the index "
                f"record and the store's layout say {expect[0]!r} {expect[1]!r}")
    return None


@dataclass(frozen=True, slots=True)
class RewriteResult:
    """What :func:`rewrite_unlisted` did with each key."""

    rewritten: tuple[bytes, ...]  # bytes verified, copied into a fresh segment, record moved
    dropped: tuple[bytes, ...]  # bytes failed the checksum: record dropped (now a miss)
    unchanged: tuple[bytes, ...]  # listed by their header by now, or gone: nothing to do
    failed: tuple[bytes, ...]  # could not be read (segment missing, I/O error): left as is
    segments: int  # fresh segments written


def rewrite_unlisted(ctx: DiskContext, keys: Sequence[bytes],
                     max_segment_bytes: int) -> RewriteResult:
    """Give blocks whose segment header does not describe them a header that does: copy their
    verified bytes into fresh segments and move their records there (compaction's own
    ``rewrite``: the new segment is durable before the records move, and an old file is
    unlinked only once no record points at it). Each block is judged again now: one that
    another process moved or removed meanwhile is left alone, one whose bytes fail the checksum
    is dropped. ``keys`` are index keys (``index.dbkey``: namespace id ‖ block key)."""
    ctx.require_writable()
    limit = min(max_segment_bytes, 256 << 20)
    listings: dict[int, Listing] = {}
    rewritten: list[bytes] = []
    dropped: list[bytes] = []
    unchanged: list[bytes] = []
    failed: list[bytes] = []
    segments = 0
    pending: list[tuple[bytes, Rec, bytearray]] = []
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes, segments
        if not pending:
            return
        rewrite(ctx, pending)
        segments += 1
        for k, r, _p in pending:
            cur = ctx.get_rec(k)
            if cur is not None and (cur.segment, cur.offset) != (r.segment, r.offset):
                rewritten.append(k)
            else:
                (unchanged if cur is None else failed).append(k)
        pending, pending_bytes = [], 0

    for k in keys:
        rec = ctx.get_rec(k)
        if rec is None:
            unchanged.append(k)
            continue
        if rec.segment not in listings:
            listings[rec.segment] = segment_listing(ctx.segdir, rec.segment)
        listing = listings[rec.segment]
        if listing is None:
            failed.append(k)  # no file: a read finds it missing (check reports that)
            continue
        if listing_problem(listing, k, rec.offset, rec.stored_nbytes,
                           rec_expect(ctx, rec)) is None:
            unchanged.append(k)
            continue
        payload, damage = read_payload(ctx, k, rec)  # verified
        if damage is not None:
            drop_damaged(ctx, [damage])  # damaged: its record goes
        if payload is None:
            cur = ctx.get_rec(k)
            if cur is None:
                dropped.append(k)
            elif (cur.segment, cur.offset) != (rec.segment, rec.offset):
                unchanged.append(k)  # moved meanwhile: its new segment lists it
            else:
                failed.append(k)
            continue
        pending.append((k, rec, payload))
        pending_bytes += rec.stored_nbytes
        if pending_bytes >= limit:
            flush()
    flush()
    return RewriteResult(tuple(rewritten), tuple(dropped), tuple(unchanged), tuple(failed),
                         segments)


def _aged(now: float, mtime: float, grace_s: float) -> bool:
    """Whether a file last written at ``mtime`` is past the grace period. A time in the future
    counts by its distance too: the clock went back since (a file from before the jump was
    otherwise never old enough, a leak until the clock caught up); what is in flight is
    told by its lock, not its mtime."""
    return abs(now - mtime) >= grace_s


def _unreferenced(sh: SharedEnv, sid: int) -> bool:
    with sh.read() as txn:
        return txn.get(BE64.pack(sid), db=sh.dbs[DB_SEGS]) is None


def rebuild_side_indexes(sh: SharedEnv, segdir: str,
                         write: Callable[[Callable], object]) -> list[int]:
    """Recompute children counts, the LRU index, segment accounting and totals from the block
    records, in one write transaction (``write(fn)`` runs it: the tier's ``txn.write_raw``,
    or recovery's on the index it builds). Returns the segments left without live blocks
    (for the caller to unlink, or not)."""

    def fn(txn) -> list[int]:
        blocks = sh.dbs[DB_BLOCKS]
        recs: list[tuple[bytes, Rec]] = []
        for k, v in txn.cursor(db=blocks):
            try:
                recs.append((k, decode_record(v)))
            except RecordError:
                txn.delete(k, db=blocks)
        old_segs: dict[int, SegInfo] = {}
        for k, v in txn.cursor(db=sh.dbs[DB_SEGS]):
            with contextlib.suppress(Exception):
                old_segs[BE64.unpack(k)[0]] = decode_seginfo(v)
        for name in (DB_CHILDREN, DB_LRU, DB_SEGS):
            txn.drop(sh.dbs[name], delete=False)
        kids = Counter(parent_dbkey(r) for _, r in recs if r.parent is not None)
        for p, n in kids.items():
            txn.put(p, U32.pack(n), db=sh.dbs[DB_CHILDREN])
        for k, r in recs:
            if not kids.get(k):
                txn.put(lru_key(r.last_access_us, k), b"", db=sh.dbs[DB_LRU])
        live: dict[int, list[int]] = {}
        for _, r in recs:
            s = live.setdefault(r.segment, [0, 0])
            s[0] += 1
            s[1] += r.stored_nbytes
        seg_file = seg_data = 0
        for sid, (n, b) in live.items():
            old = old_segs.get(sid)
            if old is not None:
                fbytes, dbytes, created = old.file_bytes, old.data_bytes, old.created_us
            else:
                fbytes, dbytes, created = _segment_sizes(segdir, sid)
            txn.put(BE64.pack(sid), encode_seginfo(SegInfo(n, fbytes, dbytes, b, created)),
                    db=sh.dbs[DB_SEGS])
            seg_file += fbytes
            seg_data += dbytes
        totals = (len(recs), sum(r.stored_nbytes for _, r in recs),
                  sum(r.raw_nbytes for _, r in recs), len(live), seg_file, seg_data)
        txn.put(META_TOTALS, TOTALS.pack(*totals), db=sh.dbs[DB_META])
        return [sid for sid in old_segs if sid not in live]

    return write(fn)  # type: ignore[return-value]


def _segment_sizes(segdir: str, sid: int) -> tuple[int, int, int]:
    path = os.path.join(segdir, _seg.segment_name(sid))
    try:
        _obj, start, size = _seg.read_header(path)
        mtime = int(os.stat(path).st_mtime * 1e6)
    except (OSError, _seg.SegmentFormatError):
        return 0, 0, 0
    return size, size - start, mtime
