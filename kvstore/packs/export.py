"""``kvstore export``: the blocks of one namespace (all of them, or the prefixes of given
prompts) written as a prefix pack (:mod:`kvstore.packs.format`).

The store is opened read-only (safe next to running engines). Blocks are chosen so that the
pack is prefix-closed: every block's parent is in it, parents first (depth-first from the
roots, so a prompt's chain is contiguous). Payloads are read straight from the segment
files (mapped, no copy), verified against their checksums and written at their place in the
pack; a block that does not verify — or vanished meanwhile — is left out with its
descendants. The pack is written under a temporary name, fsynced, and only then given its
name: a pack that exists is complete.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.admin.common import open_disk, quiet_disk_log
from kvstore.admin.explain_find import chain_records
from kvstore.admin.nsmatch import NamespaceFields, resolve_namespace
from kvstore.keys import block_keys
from kvstore.packs.format import PackError, encode_header, manifest_checksum
from kvstore.tiers import codec as _codec
from kvstore.tiers.disk import (
    SEGMENT_READ_FLAGS,
    DiskRecord,
    DiskTier,
    advance,
    block_checksum,
    encode_namespace,
    fsync_dir,
    publish,
    segment_name,
)

__all__ = ["ExportResult", "export_pack"]

Progress = Callable[[int, int], None]
_IOV = 256  # views per pwritev


@dataclass(frozen=True, slots=True)
class ExportResult:
    """Result of :func:`export_pack`."""

    pack: str
    store: str
    namespace_id: str
    model_id: str
    layout: str
    blocks: int  # blocks in the pack
    pack_bytes: int  # file size
    data_bytes: int  # raw block bytes in it
    prompts: int  # prompts given (0: the whole namespace)
    prompt_blocks_missing: int  # full blocks of those prompts the store does not hold
    unreachable: int  # blocks left out: their parent is not on disk
    damaged: int  # blocks left out (with their descendants): their bytes did not verify
    seconds: float


@dataclass(slots=True)
class _Chosen:
    keys: list[bytes]
    parents: list[int]
    recs: list[DiskRecord]


def export_pack(store: str | os.PathLike[str] | None, namespace: str, out: str | os.PathLike[str],
                *, prefixes: Sequence[Sequence[int]] = (), salt: str | None = None,
                overwrite: bool = False, progress: Progress | None = None) -> ExportResult:
    """Write the pack of ``namespace`` (an id, id prefix or model id) of the store at
    ``store`` to ``out``: every block of the namespace reachable from a first block, or with
    ``prefixes`` (token id lists) the blocks of those prompts' leading runs."""
    t0 = time.perf_counter()
    out = os.path.abspath(os.path.expanduser(os.fspath(out)))
    if os.path.lexists(out) and not overwrite:
        raise PackError("exists", f"{out} exists; choose another name or pass --force to "
                        "replace it")
    with open_disk(store, readonly=True) as t, quiet_disk_log():
        info = resolve_namespace(namespace, t.namespaces())
        fields = NamespaceFields.from_info(info)
        nid = info.namespace_id
        missing = 0
        if prefixes:
            chosen, missing = _prompt_blocks(t, fields, nid, prefixes, salt)
            unreachable = 0
        else:
            chosen, unreachable = _all_blocks(t, nid)
        damaged: set[bytes] = set()
        for _attempt in range(4):
            if not chosen.keys:
                raise PackError("empty", f"nothing to export: the store holds no block of "
                                f"namespace {nid.hex()[:12]} ({info.model_id})"
                                + (" for these prompts" if prefixes else ""))
            bad = _write(t, fields, nid, chosen, out, overwrite, progress)
            if not bad:
                break
            damaged |= bad
            chosen = _without(chosen, damaged)
        else:
            raise PackError("altered", f"blocks of {nid.hex()[:12]} kept failing to verify "
                            "while exporting; run 'kvstore verify' on the store")
        store_path = t.path
    n = len(chosen.keys)
    return ExportResult(out, store_path, nid.hex(), info.model_id, fields.layout, n,
                        os.path.getsize(out), n * fields.block_nbytes, len(prefixes), missing,
                        unreachable, len(damaged), time.perf_counter() - t0)


def _all_blocks(t: DiskTier, nid: bytes) -> tuple[_Chosen, int]:
    """Every block of the namespace reachable from a root, depth first (children in key
    order), and how many are unreachable (their parent is not on disk)."""
    recs = {r.key: r for r in t.records(nid)}
    children: dict[bytes | None, list[bytes]] = {}
    for k, r in recs.items():
        parent = r.parent if r.parent in recs else (None if r.parent is None else b"?")
        children.setdefault(parent, []).append(k)
    chosen = _Chosen([], [], [])
    stack: list[tuple[bytes, int]] = [(k, -1) for k in sorted(children.get(None, ()), reverse=True)]
    while stack:
        k, p = stack.pop()
        i = len(chosen.keys)
        chosen.keys.append(k)
        chosen.parents.append(p)
        chosen.recs.append(recs[k])
        stack.extend((c, i) for c in sorted(children.get(k, ()), reverse=True))
    return chosen, len(recs) - len(chosen.keys)


def _prompt_blocks(t: DiskTier, fields: NamespaceFields, nid: bytes,
                   prefixes: Sequence[Sequence[int]], salt: str | None) -> tuple[_Chosen, int]:
    """The leading runs of the prompts on disk (shared prefixes once)."""
    chosen = _Chosen([], [], [])
    index: dict[bytes, int] = {}
    missing = 0
    for tokens in prefixes:
        keys = list(block_keys(nid, list(tokens), fields.block_tokens, salt=salt))
        recs = chain_records(t, keys, nid)
        parent = -1
        for j, (k, rec) in enumerate(zip(keys, recs, strict=True)):
            if rec is None:
                missing += len(keys) - j
                break
            if k not in index:
                index[k] = len(chosen.keys)
                chosen.keys.append(k)
                chosen.parents.append(parent)
                chosen.recs.append(DiskRecord(
                    k, nid, keys[j - 1] if j else None, rec.segment, rec.offset,
                    rec.stored_nbytes, rec.raw_nbytes,
                    _codec.CODEC_NAMES.get(rec.codec, "?"), rec.checksum, rec.created_us / 1e6,
                    rec.last_access_us / 1e6, rec.hits))
            parent = index[k]
    return chosen, missing


def _without(chosen: _Chosen, bad: set[bytes]) -> _Chosen:
    """``chosen`` less the ``bad`` blocks and their descendants (indices remapped)."""
    out = _Chosen([], [], [])
    new_index: dict[int, int] = {}
    for i, (k, p, r) in enumerate(zip(chosen.keys, chosen.parents, chosen.recs, strict=True)):
        if k in bad or (p >= 0 and p not in new_index):
            continue
        new_index[i] = len(out.keys)
        out.keys.append(k)
        out.parents.append(-1 if p < 0 else new_index[p])
        out.recs.append(r)
    return out


def _write(t: DiskTier, fields: NamespaceFields, nid: bytes, chosen: _Chosen, out: str,
           overwrite: bool, progress: Progress | None) -> set[bytes]:
    """Write the pack of ``chosen``; returns the keys that did not verify (then nothing is
    published and the caller tries again without them)."""
    n = len(chosen.keys)
    manifest = b"".join(chosen.keys) + struct.pack(f"<{n}q", *chosen.parents) + struct.pack(
        f"<{n}Q", *(r.checksum for r in chosen.recs))
    record = encode_namespace(fields.record_fields())
    header = encode_header(record, n, manifest_checksum(manifest))
    tmp = f"{out}.tmp-{os.getpid()}"
    # a pack is KV (it reveals prompts): private, as a store is (chmod it to share it)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    published = False
    try:
        _write_all(fd, header + manifest, 0)
        bad = _copy_blocks(t, fields, nid, chosen, fd, len(header) + len(manifest), progress)
        if bad:
            return bad
        os.fsync(fd)
        os.close(fd)
        fd = -1
        _publish(tmp, out, overwrite)
        published = True
        fsync_dir(os.path.dirname(out))
        return set()
    finally:
        if fd >= 0:
            os.close(fd)
        if not published:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _publish(tmp: str, out: str, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, out)
        return
    try:
        publish(tmp, out)  # never over an existing file
    except FileExistsError:
        raise PackError("exists", f"{out} exists (written meanwhile?); choose another name "
                        "or pass --force to replace it") from None


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _copy_blocks(t: DiskTier, fields: NamespaceFields, nid: bytes, chosen: _Chosen, fd: int,
                 start: int, progress: Progress | None) -> set[bytes]:
    """Copy every chosen block's raw bytes to ``start + i * block_nbytes``, segment by
    segment in file order; returns the keys that did not verify."""
    nb = fields.block_nbytes
    by_seg: dict[int, list[int]] = {}
    for i, r in enumerate(chosen.recs):
        by_seg.setdefault(r.segment, []).append(i)
    bad: set[bytes] = set()
    retry: list[int] = []
    done = 0
    total = len(chosen.recs) * nb
    for sid in sorted(by_seg):
        idx = sorted(by_seg[sid], key=lambda i: chosen.recs[i].offset)
        retry += _copy_segment(t, sid, idx, chosen, nid, fd, start, nb, bad)
        done += len(idx) * nb
        if progress is not None:
            progress(done, total)
    for i in retry:  # the segment went away (compacted meanwhile): its record again
        cur = t.get_record(chosen.keys[i], nid)
        if cur is None or cur.segment == chosen.recs[i].segment:
            bad.add(chosen.keys[i])
            continue
        chosen.recs[i] = cur
        if _copy_segment(t, cur.segment, [i], chosen, nid, fd, start, nb, bad):
            bad.add(chosen.keys[i])
    return bad


def _copy_segment(t: DiskTier, sid: int, idx: list[int], chosen: _Chosen, nid: bytes, fd: int,
                  start: int, nb: int, bad: set[bytes]) -> list[int]:
    """Copy the blocks ``idx`` of segment ``sid``; returns them when the file is gone."""
    path = os.path.join(t.path, "segments", segment_name(sid))
    try:
        sfd = os.open(path, SEGMENT_READ_FLAGS)
    except FileNotFoundError:
        return idx
    try:
        size = os.fstat(sfd).st_size
        mm = mmap.mmap(sfd, size, mmap.MAP_SHARED, mmap.PROT_READ) if size else None
    finally:
        os.close(sfd)
    if mm is None:
        bad.update(chosen.keys[i] for i in idx)
        return []
    try:
        _copy_mapped(mm, idx, chosen, nid, fd, start, nb, bad)
    finally:
        with contextlib.suppress(BufferError):  # a view still alive: freed with it
            mm.close()
    return []


def _copy_mapped(mm: mmap.mmap, idx: list[int], chosen: _Chosen, nid: bytes, fd: int,
                 start: int, nb: int, bad: set[bytes]) -> None:
    # each block is hashed, then written from the same pages: WILLNEED reads ahead and keeps
    # them (SEQUENTIAL would drop them behind the hash, and the write would read them again)
    if hasattr(mmap, "MADV_WILLNEED"):
        mm.madvise(mmap.MADV_WILLNEED)
    view = memoryview(mm)
    run: list[tuple[int, memoryview | bytes]] = []
    for i in idx:
        raw = _raw_block(view, chosen.recs[i], chosen.keys[i], nid, nb)
        if raw is None:
            bad.add(chosen.keys[i])
            continue
        if run and (i != run[-1][0] + 1 or len(run) >= _IOV):
            _flush(fd, run, start, nb)
            run = []
        run.append((i, raw))
    if run:
        _flush(fd, run, start, nb)


def _raw_block(view: memoryview, r: DiskRecord, key: bytes, nid: bytes,
               nb: int) -> memoryview | bytes | None:
    """The verified raw bytes of a block (a view into the segment when stored raw)."""
    end = r.offset + r.stored_nbytes
    if r.raw_nbytes != nb or end > len(view):
        return None
    payload = view[r.offset : end]
    if r.codec != "none":
        import numpy as np

        buf = np.empty(nb, dtype=np.uint8)
        try:
            _codec.decompress_into(_codec.CODEC_IDS[r.codec], payload, buf)
        except (_codec.CodecError, KeyError):
            return None
        payload = memoryview(buf).cast("B")
    if block_checksum(key, nid, payload) != r.checksum:
        return None
    return payload


def _flush(fd: int, run: list[tuple[int, memoryview | bytes]], start: int, nb: int) -> None:
    """One ``pwritev`` of consecutive pack blocks."""
    offset = start + run[0][0] * nb
    views = [memoryview(v) for _i, v in run]
    total = len(run) * nb
    written = 0
    while written < total:
        n = os.pwritev(fd, views, offset + written)
        written += n
        advance(views, n)
