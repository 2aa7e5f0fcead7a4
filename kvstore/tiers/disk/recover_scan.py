"""What ``kvstore recover`` reads (:mod:`kvstore.tiers.disk.recover`): every segment header
(each lists its blocks' key, namespace, parent, codec, raw size and checksum, and the records
of their namespaces), then every payload in large sequential reads — a thread per segment
file, xxh3 releases the GIL — keeping a block only when its bytes verify against the
checksum bound to its key and namespace; and namespace records salvaged from old
``data.mdb`` files by a byte scan (no LMDB: the file may be damaged).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import numpy as np

from kvstore.tiers import codec as _codec
from kvstore.tiers.disk import index as di
from kvstore.tiers.disk import segments as _seg

#: payload bytes read per ``preadv`` (whole blocks; a larger block is one read of its own):
#: small enough that what was just read is still in the CPU cache when it is checksummed
#: (16 MiB reads ran at half the speed of 2 MiB ones from the page cache)
READ_CHUNK = 2 << 20
_KEY = 32

#: ``progress(bytes_done, bytes_total, blocks_done, blocks_total)``
Progress = Callable[[int, int, int, int], None]


@dataclass(frozen=True, slots=True)
class RecoverFinding:
    kind: str  # bad_segment | checksum_mismatch | short_segment | bad_entry | temp_file |
    #            segment_id_mismatch | missing_namespace | layout_mismatch
    path: str
    key: str | None  # block key (hex)
    detail: str


@dataclass(slots=True)
class Entry:
    """One block a segment header lists; ``ok`` once its bytes verified."""

    key: bytes
    ns: bytes
    parent: bytes | None
    codec: int
    raw: int
    checksum: int
    offset: int  # absolute
    stored: int
    ok: bool = False
    dtype: object = None  # as the header gives them (checked against the namespace's layout)
    shape: object = None


@dataclass(slots=True)
class Segment:
    """A segment file whose header parsed, with its entries in file order."""

    sid: int
    path: str
    size: int
    data_start: int
    mtime_us: int
    entries: list[Entry]
    namespaces: dict[bytes, bytes] = field(default_factory=dict)  # id -> record, from the header
    bad_entries: int = 0  # block entries of the header that describe no valid block (dropped)


# -- scanning segment headers ------------------------------------------------------------------

_NS_CACHE: dict[str, bytes] = {}


def _parse_entry(name: str, info: object, meta: object, start: int) -> Entry:
    """One header entry; ValueError (a message) when it does not describe a valid block."""
    try:
        cname, raw_s, csum_s, ns_s, parent_s = meta.split(";")  # type: ignore[union-attr]
        b, e = info["data_offsets"]  # type: ignore[index]
        key = bytes.fromhex(name)
        ns = _NS_CACHE.get(ns_s)
        if ns is None:
            ns = _NS_CACHE.setdefault(ns_s, bytes.fromhex(ns_s))
        parent = bytes.fromhex(parent_s) if parent_s else None
        raw, checksum, b, e = int(raw_s), int(csum_s, 16), int(b), int(e)
    except (AttributeError, ValueError, TypeError, KeyError, OverflowError) as ex:
        raise ValueError(f"malformed entry or block metadata {str(meta)[:80]!r}: {ex}") from None
    cid = _codec.CODEC_IDS.get(cname)
    if cid is None:
        raise ValueError(f"unknown codec {cname!r}")
    if (len(key) != _KEY or len(ns) != _KEY or parent is not None and len(parent) != _KEY
            or len(csum_s) != 16):
        raise ValueError("malformed key, checksum, namespace or parent")
    stored = e - b
    if b < 0:
        raise ValueError(f"data_offsets [{b}, {e}] out of range")
    try:  # the record it becomes must decode: the index's own bounds
        di.check_record_bounds(cid, 1, start + b, stored, raw)
    except di.RecordError as ex:
        raise ValueError(str(ex)) from None
    return Entry(key, ns, parent, cid, raw, checksum, start + b, stored,
                 dtype=info.get("dtype"), shape=info.get("shape"))  # type: ignore[union-attr]


def _scan_segment(sid: int, path: str, findings: list[RecoverFinding]) -> Segment | None:
    try:
        obj, start, size = _seg.read_header(path)
        mtime_us = int(os.stat(path).st_mtime * 1e6)
    except (OSError, _seg.SegmentFormatError) as e:
        findings.append(RecoverFinding("bad_segment", path, None, f"header unreadable: {e}"))
        return None
    meta = obj.get("__metadata__")
    if not isinstance(meta, dict):
        findings.append(RecoverFinding("bad_segment", path, None, "no __metadata__"))
        return None
    fmt = meta.get("kvstore.format")
    if fmt != _seg.SEGMENT_FORMAT:
        findings.append(RecoverFinding(
            "bad_segment", path, None, f"segment format {fmt!r}; this kvstore recovers format "
            f"{_seg.SEGMENT_FORMAT} (its checksums would not verify)"))
        return None
    if meta.get("kvstore.segment") != f"{sid:016x}":
        findings.append(RecoverFinding(
            "segment_id_mismatch", path, None, f"the header names segment "
            f"{meta.get('kvstore.segment')!r}; its blocks are recovered under the file's id "
            f"{sid:016x} (they verify by content)"))
    entries: list[Entry] = []
    namespaces: dict[bytes, bytes] = {}
    bad = 0
    for mk, mv in meta.items():
        if isinstance(mk, str) and mk.startswith(_seg.NAMESPACE_META_PREFIX):
            rec = _header_namespace(mk[len(_seg.NAMESPACE_META_PREFIX):], mv)
            if rec is None:
                findings.append(RecoverFinding("bad_entry", path, mk[:64],
                                               "namespace record does not verify against its id"))
            else:
                namespaces[rec[0]] = rec[1]
    for name, info in obj.items():
        if name == "__metadata__" or name.startswith(_seg.NAMESPACE_META_PREFIX):
            continue
        try:
            entries.append(_parse_entry(name, info, meta.get(name), start))
        except ValueError as e:
            findings.append(RecoverFinding("bad_entry", path, name[:64], str(e)))
            bad += 1
    entries.sort(key=lambda en: en.offset)
    return Segment(sid, path, size, start, mtime_us, entries, namespaces, bad)


def _header_namespace(nid_hex: str, value: object) -> tuple[bytes, bytes] | None:
    """(id, record) of a namespace record carried in a segment header, if it hashes to its id."""
    try:
        nid, raw = bytes.fromhex(nid_hex), bytes.fromhex(str(value))
        fields = di.decode_namespace(raw)
    except (ValueError, di.RecordError):
        return None
    if len(nid) != 32 or di.namespace_record_id(fields) != nid:
        return None
    return nid, di.encode_namespace(fields)


# -- reading and verifying payloads ------------------------------------------------------------

def _runs(entries: list[Entry]) -> list[list[Entry]]:
    """Adjacent entries in runs of up to READ_CHUNK bytes (a larger entry alone)."""
    out: list[list[Entry]] = []
    run: list[Entry] = []
    end = size = 0
    for en in entries:
        if run and (en.offset != end or size + en.stored > READ_CHUNK):
            out.append(run)
            run, size = [], 0
        run.append(en)
        end = en.offset + en.stored
        size += en.stored
    if run:
        out.append(run)
    return out


class _Verifier:
    def __init__(self, findings: list[RecoverFinding], progress: Progress | None,
                 total_bytes: int, total_blocks: int) -> None:
        self.findings = findings
        self.lock = threading.Lock()
        self.progress = progress
        self.total = (total_bytes, total_blocks)
        self.done = [0, 0]
        self.bytes_read = 0
        self.local = threading.local()

    def _buf(self, n: int) -> memoryview:
        b = getattr(self.local, "buf", None)
        if b is None or len(b) < n:
            b = self.local.buf = memoryview(bytearray(max(n, READ_CHUNK)))
        return b[:n]

    def task(self, seg: Segment, runs: list[list[Entry]]) -> None:
        bad: list[RecoverFinding] = []
        nread = 0
        try:
            fd = os.open(seg.path, _seg.SEGMENT_READ_FLAGS)
        except OSError as e:
            for run in runs:
                for en in run:
                    bad.append(RecoverFinding("short_segment", seg.path, en.key.hex(),
                                              f"cannot open: {e.strerror}"))
            self._report(bad, 0, sum(len(r) for r in runs), 0)
            return
        try:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, runs[0][0].offset, 0, os.POSIX_FADV_SEQUENTIAL)
            for run in runs:
                first = run[0].offset
                total = run[-1].offset + run[-1].stored - first
                buf = self._buf(total)
                try:
                    n = _seg.pread_into(fd, buf, first)
                except OSError as e:
                    n = 0
                    why = f"read error: {e.strerror}"
                else:
                    why = ""
                nread += n
                for en in run:
                    rel = en.offset - first
                    if rel + en.stored > n:
                        bad.append(RecoverFinding(
                            "short_segment", seg.path, en.key.hex(),
                            why or f"the file ends before this block ({seg.size} bytes; block "
                            f"at {en.offset}+{en.stored})"))
                        continue
                    payload = buf[rel:rel + en.stored]
                    if en.codec == _codec.CODEC_NONE:
                        en.ok = _seg.block_checksum(en.key, en.ns, payload) == en.checksum
                    else:
                        out = np.empty(en.raw, dtype=np.uint8)
                        try:
                            _codec.decompress_into(en.codec, payload, out)
                            en.ok = _seg.block_checksum(en.key, en.ns, out) == en.checksum
                        except _codec.CodecError:
                            en.ok = False
                    if not en.ok:
                        bad.append(RecoverFinding(
                            "checksum_mismatch", seg.path, en.key.hex(),
                            f"the bytes at {en.offset}+{en.stored} do not match the block's "
                            "checksum: not recovered"))
                self._report([], len(run), 0, total if n >= total else n)
        finally:
            os.close(fd)
        self._report(bad, 0, 0, 0, nread)

    def _report(self, bad: list[RecoverFinding], blocks: int, skipped: int, nbytes: int,
                nread: int = 0) -> None:
        with self.lock:
            self.findings.extend(bad)
            self.done[0] += nbytes
            self.done[1] += blocks + skipped
            self.bytes_read += nread
            if self.progress is not None and (blocks or skipped or nbytes):
                self.progress(self.done[0], self.total[0], self.done[1], self.total[1])


def _tasks(s: Segment, threads: int, nsegs: int) -> list[list[list[Entry]]]:
    """A segment's runs as one task (a thread reads the file front to back, with readahead),
    or in ``threads`` contiguous pieces when there are fewer segments than threads."""
    runs = _runs(s.entries)
    if not runs:
        return []
    if nsegs >= threads:
        return [runs]
    step = max(1, -(-len(runs) // max(1, threads // max(1, nsegs))))
    return [runs[i:i + step] for i in range(0, len(runs), step)]


def segment_path(segdir: str, sid: int, quarantined: frozenset[int] = frozenset()) -> str:
    """Where segment ``sid``'s file is: its own name, or its quarantine name."""
    name = _seg.quarantine_name(sid) if sid in quarantined else _seg.segment_name(sid)
    return os.path.join(segdir, name)


def scan_and_verify(segdir: str, ids: list[int], threads: int,
                     findings: list[RecoverFinding],
                     progress: Progress | None,
                     quarantined: frozenset[int] = frozenset()) -> tuple[list[Segment], int, float]:
    """Scan every segment header and verify every payload; the reading threads start on a
    segment as soon as its header is parsed. ``quarantined``: ids of ``ids`` whose file is
    under its quarantine name. Returns (segments, bytes read, seconds)."""
    total_bytes = total_blocks = 0
    for sid in ids:
        with contextlib.suppress(OSError):
            total_bytes += os.path.getsize(segment_path(segdir, sid, quarantined))
    v = _Verifier(findings, progress, total_bytes, 0)
    if progress is not None:
        progress(0, total_bytes, 0, 0)
    segs: list[Segment] = []
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-recover") if threads > 1 else None
    futures = []
    try:
        for sid in sorted(ids):
            s = _scan_segment(sid, segment_path(segdir, sid, quarantined), findings)
            if s is None:
                continue
            segs.append(s)
            with v.lock:
                total_blocks += len(s.entries)
                v.total = (total_bytes, total_blocks)
                v.done[0] += s.size - sum(en.stored for en in s.entries)  # header, gaps
            for runs in _tasks(s, threads, len(ids)):
                if pool is None:
                    v.task(s, runs)
                else:
                    futures.append(pool.submit(v.task, s, runs))
        for f in futures:
            f.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return segs, v.bytes_read, time.perf_counter() - t0


# -- namespace records -------------------------------------------------------------------------

def salvage_namespaces(files: list[str], wanted: set[bytes]) -> dict[bytes, bytes]:
    """Namespace records (encoded) for ``wanted`` ids found anywhere in ``files`` (old
    ``data.mdb`` files), by a byte scan: no LMDB, so a damaged file cannot crash it. A record
    counts only when its fields hash to the id it is kept under."""
    found: dict[bytes, bytes] = {}
    marker = bytes([0x9D, di.NS_RECORD_VERSION])  # msgpack fixarray(13), version 1
    chunk = 64 << 20
    overlap = 1 << 16
    for path in files:
        if not wanted - found.keys():
            break
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            pos = 0
            while pos < size and wanted - found.keys():
                data = os.pread(fd, chunk + overlap, pos)
                if not data:
                    break
                i = data.find(marker)
                while 0 <= i < min(len(data), chunk):
                    _try_record(data, i, wanted, found)
                    i = data.find(marker, i + 1)
                pos += chunk
        except OSError:
            pass
        finally:
            os.close(fd)
    return found


def _try_record(data: bytes, i: int, wanted: set[bytes], found: dict[bytes, bytes]) -> None:
    up = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=1 << 20,
                          max_str_len=1 << 16, max_bin_len=0, max_array_len=1024,
                          max_map_len=0, max_ext_len=0)
    up.feed(data[i:i + (1 << 18)])
    try:
        up.unpack()
    except Exception:  # not a record here
        return
    raw = data[i:i + up.tell()]
    try:
        fields = di.decode_namespace(raw)
    except di.RecordError:
        return
    nid = di.namespace_record_id(fields)
    if nid is not None and nid in wanted and nid not in found:
        found[nid] = di.encode_namespace(fields)

