"""Disk tier under faults: damaged, truncated and missing segments, bad index entries, disk
full, read-only directories. Damage is a counted miss, never an exception, never wrong bytes."""

from __future__ import annotations

import errno
import logging
import os
import time

import lmdb
import pytest
import torch
from support.disk import (
    block_data,
    chain,
    namespace,
    small_layout,
    verify_all,
    writes,
)

from kvstore.errors import DiskError, TensorMismatchError
from kvstore.tiers.disk import DiskTier, ReadStatus
from kvstore.tiers.disk import index as di
from kvstore.tiers.disk import segments as seg

LAY = small_layout(torch.bfloat16)
NS = namespace(LAY)


def open_tier(path, **kw):
    kw.setdefault("capacity_bytes", 1 << 30)
    t = DiskTier(path, **kw)
    t.register_namespace(NS)
    return t


def read(t, key):
    dst = torch.empty(LAY.block_nbytes, dtype=torch.uint8)
    return t.read_into(key, dst), dst


def seg_path(t, key) -> tuple[str, int]:
    r = t.get_record(key)
    return os.path.join(t.path, "segments", seg.segment_name(r.segment)), r.offset


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def files(t) -> list[str]:
    return sorted(os.listdir(os.path.join(t.path, "segments")))


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_flipped_byte_is_damaged_and_dropped(tmp_path, codec, caplog):
    with open_tier(tmp_path, codec=codec) as t:
        keys = chain("flip", 4)
        t.write_blocks(writes(keys, NS))
        path, off = seg_path(t, keys[1])
        flip(path, off + 7)
        with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
            status, dst = read(t, keys[1])
        assert status is ReadStatus.DAMAGED
        assert any("damaged" in r.message and keys[1].hex()[:16] in r.message for r in caplog.records)
        s = t.stats()
        assert s.read_damaged == 1 and s.reads_ok == 0
        assert not t.contains(keys[1])  # entry dropped
        assert read(t, keys[1])[0] is ReadStatus.MISSING
        assert t.stats().read_missing == 1
        for k in (keys[0], keys[2], keys[3]):  # the rest of the segment is fine
            status, dst = read(t, k)
            assert status is ReadStatus.OK and torch.equal(dst, block_data(k, LAY))
        assert t.leading_run(keys) == 1


def test_truncated_segment(tmp_path):
    with open_tier(tmp_path) as t:
        keys = chain("trunc", 4)
        t.write_blocks(writes(keys, NS))
        path, off = seg_path(t, keys[2])
        os.truncate(path, off + 5)
        assert [read(t, k)[0] for k in keys] == [ReadStatus.OK, ReadStatus.OK,
                                                 ReadStatus.DAMAGED, ReadStatus.DAMAGED]
        s = t.stats()
        assert s.read_damaged == 2 and s.blocks == 2
        assert t.check() == []  # the dropped entries are gone; what is left is intact


def test_deleted_segment_is_damaged(tmp_path):
    """A segment file gone under its records: their bytes are gone, which is damage (dropped,
    counted damaged); a block whose record is gone is a plain miss."""
    with open_tier(tmp_path) as t:
        a, b = chain("dsa", 3), chain("dsb", 3)
        t.write_blocks(writes(a, NS))
        t.write_blocks(writes(b, NS))
        path, _ = seg_path(t, a[0])
        os.unlink(path)
        assert [read(t, k)[0] for k in a] == [ReadStatus.DAMAGED] * 3
        s = t.stats()
        assert s.read_missing == 0 and s.read_damaged == 3
        assert s.blocks == 3 and s.segments == 1  # accounting follows the dropped entries
        assert t.read_many(b + a[:1], [torch.empty(LAY.block_nbytes, dtype=torch.uint8)
                                       for _ in range(4)]) == [ReadStatus.OK] * 3 + [ReadStatus.MISSING]
        assert t.check() == []


def test_read_many_independent_statuses(tmp_path):
    with open_tier(tmp_path) as t:
        keys = chain("rm", 4)
        t.write_blocks(writes(keys, NS))
        path, off = seg_path(t, keys[2])
        flip(path, off)
        never = chain("never", 1)[0]
        dsts = [torch.empty(LAY.block_nbytes, dtype=torch.uint8) for _ in range(5)]
        got = t.read_many([keys[0], never, keys[2], keys[3], keys[1]], dsts)
        assert got == [ReadStatus.OK, ReadStatus.MISSING, ReadStatus.DAMAGED, ReadStatus.OK,
                       ReadStatus.OK]
        for i, k in ((0, keys[0]), (3, keys[3]), (4, keys[1])):
            assert torch.equal(dsts[i], block_data(k, LAY))


def test_read_many_mirrors_only_verified_blocks(tmp_path):
    """``mirrors`` receive each block that read and verified, in every grouping (one block,
    a run in one segment, several segments); damaged and missing blocks leave theirs alone."""
    with open_tier(tmp_path) as t:
        keys = chain("mir", 6)
        t.write_blocks(writes(keys[:3], NS))
        t.write_blocks(writes(keys[3:], NS))  # a second segment
        path, off = seg_path(t, keys[4])
        flip(path, off)
        never = chain("never", 1)[0]
        asked = [*keys, never]
        dsts = [torch.empty(LAY.block_nbytes, dtype=torch.uint8) for _ in asked]
        mirrors = [torch.zeros(LAY.block_nbytes, dtype=torch.uint8) for _ in asked]
        mirrors[1] = None
        got = t.read_many(asked, dsts, mirrors=mirrors)
        assert got == [ReadStatus.OK] * 4 + [ReadStatus.DAMAGED, ReadStatus.OK, ReadStatus.MISSING]
        for i in (0, 2, 3, 5):
            assert torch.equal(mirrors[i], block_data(asked[i], LAY))
        assert not mirrors[4].any() and not mirrors[6].any()
        one = [torch.zeros(LAY.block_nbytes, dtype=torch.uint8)]
        assert t.read_many([keys[0]], [torch.empty_like(one[0])], mirrors=one) == [ReadStatus.OK]
        assert torch.equal(one[0], block_data(keys[0], LAY))
        with pytest.raises(TensorMismatchError, match="mirrors"):
            t.read_many(keys[:2], dsts[:2], mirrors=mirrors[:1])
        with pytest.raises(TensorMismatchError, match=r"mirrors\[0\]"):
            t.read_many(keys[:1], dsts[:1], mirrors=[torch.zeros(8, dtype=torch.uint8)])


def test_check_finds_and_fixes_damage(tmp_path):
    with open_tier(tmp_path) as t:
        a, b, c, d = (chain(f"ck{i}", 3) for i in range(4))
        for ks in (a, b, c, d):
            t.write_blocks(writes(ks, NS))
        pa, oa = seg_path(t, a[1])
        flip(pa, oa + 3)
        pb, ob = seg_path(t, b[2])
        os.truncate(pb, ob + 1)
        pc, _ = seg_path(t, c[0])
        os.unlink(pc)
        found = t.check()
        kinds = sorted((f.kind, f.key) for f in found)
        assert kinds == sorted([("checksum_mismatch", a[1]), ("short_segment", b[2]),
                                ("missing_segment", c[0]), ("missing_segment", c[1]),
                                ("missing_segment", c[2])])
        assert not any(f.fixed for f in found)
        assert t.stats().blocks == 12  # check without fix changes nothing
        fixed = t.check(fix=True)
        assert len(fixed) == 5 and all(f.fixed for f in fixed)
        assert t.check() == []
        ok, bad = verify_all(t, LAY)
        assert ok == 12 - 5 and not bad


def test_check_orphans_temp_files_and_grace(tmp_path):
    with open_tier(tmp_path, orphan_grace_s=60) as t:
        t.write_blocks(writes(chain("or", 2), NS))
        sd = os.path.join(t.path, "segments")
        orphan = os.path.join(sd, seg.segment_name(0xFF))
        temp = os.path.join(sd, seg.temp_name(0xFE))
        other = os.path.join(sd, "README")
        for p in (orphan, temp, other):
            with open(p, "wb") as f:
                f.write(b"x" * 100)
        found = t.check()  # young files may belong to an in-flight writer: left alone
        assert [f.kind for f in found] == ["unknown_file"]
        old = time.time() - 3600
        os.utime(orphan, (old, old))
        os.utime(temp, (old, old))
        found = {f.kind: f for f in t.check()}
        assert set(found) == {"unknown_file", "orphan_segment", "temp_file"}
        assert found["orphan_segment"].path == orphan and found["temp_file"].path == temp
        fixed = {f.kind: f.fixed for f in t.check(fix=True)}
        assert fixed == {"unknown_file": False, "orphan_segment": True, "temp_file": True}
        assert not os.path.exists(orphan) and not os.path.exists(temp) and os.path.exists(other)
        assert [f.kind for f in t.check(grace_s=0)] == ["unknown_file"]


def test_bad_index_record_and_side_indexes(tmp_path, caplog):
    with open_tier(tmp_path) as t:
        keys = chain("bi", 4)
        t.write_blocks(writes(keys, NS))
        sh = t._sh
        sh.write(lambda txn: txn.put(di.dbkey(NS.id, keys[3]), b"junk", db=sh.dbs[di.DB_BLOCKS]))
        with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
            assert read(t, keys[3])[0] is ReadStatus.DAMAGED
        assert not t.contains(keys[3])
        # now break the side indexes behind the tier's back
        sh.write(lambda txn: txn.drop(sh.dbs[di.DB_LRU], delete=False))
        found = t.check()
        assert found and all(f.kind == "bad_index" for f in found)
        assert all(f.fixed for f in t.check(fix=True))
        assert t.check() == []
        t.capacity_bytes = 0
        assert t.evict_to_budget() == [keys[2], keys[1], keys[0]]


def test_bad_record_found_by_check(tmp_path):
    with open_tier(tmp_path) as t:
        keys = chain("br", 2)
        t.write_blocks(writes(keys, NS))
        sh = t._sh
        sh.write(lambda txn: txn.put(di.dbkey(NS.id, keys[1]), b"\x07" * 128,
                                     db=sh.dbs[di.DB_BLOCKS]))
        kinds = {f.kind for f in t.check()}
        assert "bad_record" in kinds
        t.check(fix=True)
        assert t.check() == []
        assert t.leading_run(keys) == 1


def _assert_unchanged(t, before_files, before_stats):
    assert files(t) == before_files, "a failed write left files behind"
    s = t.stats()
    assert (s.blocks, s.stored_bytes, s.segments, s.segment_bytes) == (
        before_stats.blocks, before_stats.stored_bytes, before_stats.segments,
        before_stats.segment_bytes)
    assert t.check(grace_s=0) == []


@pytest.mark.parametrize("where", ["fsync", "writev", "dir_fsync", "index_commit"])
def test_enospc_leaves_no_partial_state(tmp_path, monkeypatch, where):
    with open_tier(tmp_path) as t:
        first = chain("ok", 2)
        t.write_blocks(writes(first, NS))
        before_files, before_stats = files(t), t.stats()
        keys = chain("full", 3)
        enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if where == "fsync":
            def fake_fsync(fd):
                raise enospc
            monkeypatch.setattr(os, "fsync", fake_fsync)
        elif where == "writev":
            real = os.writev
            calls = []

            def fake_writev(fd, bufs):
                calls.append(1)
                if len(calls) > 1:
                    raise enospc
                return real(fd, [bytes(memoryview(bufs[0])[:10])])  # a short write first
            monkeypatch.setattr(os, "writev", fake_writev)
        elif where == "dir_fsync":
            def fake_fsync_dir(path):
                raise enospc
            monkeypatch.setattr(seg, "fsync_dir", fake_fsync_dir)
        else:
            def fake_finish(self):
                raise lmdb.Error("mdb_txn_commit: No space left on device")
            monkeypatch.setattr(di.WriteOps, "finish", fake_finish)
        with pytest.raises(DiskError) as ei:
            t.write_blocks(writes(keys, NS))
        if where != "index_commit":
            assert ei.value.errno == errno.ENOSPC and "disk full" in str(ei.value)
        monkeypatch.undo()
        assert t.stats().write_errors == 1
        assert t.leading_run(keys) == 0
        _assert_unchanged(t, before_files, before_stats)
        # the store is still usable
        assert t.write_blocks(writes(keys, NS)) == keys
        ok, bad = verify_all(t, LAY)
        assert ok == 5 and not bad


def test_read_only_directory_simulated(tmp_path, monkeypatch):
    with open_tier(tmp_path) as t:
        keys = chain("ro", 2)
        t.write_blocks(writes(keys, NS))
        before_files, before_stats = files(t), t.stats()
        real_open = os.open
        segdir = os.path.join(t.path, "segments")

        def ro_open(path, flags, *a, **kw):  # what a 0o555 directory does to a non-root user
            if flags & os.O_CREAT and os.fspath(path).startswith(segdir):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real_open(path, flags, *a, **kw)

        monkeypatch.setattr(os, "open", ro_open)
        with pytest.raises(DiskError) as ei:
            t.write_blocks(writes(chain("ro2", 2), NS))
        assert ei.value.errno == errno.EACCES and "not writable" in str(ei.value)
        for k in keys:  # reads still work
            status, dst = read(t, k)
            assert status is ReadStatus.OK and torch.equal(dst, block_data(k, LAY))
        monkeypatch.undo()
        _assert_unchanged(t, before_files, before_stats)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions; the "
                    "simulated variant (test_read_only_directory_simulated) covers it")
def test_read_only_directory_real(tmp_path):  # pragma: no cover - not root only
    with open_tier(tmp_path) as t:
        keys = chain("ro", 2)
        t.write_blocks(writes(keys, NS))
        sd = os.path.join(t.path, "segments")
        os.chmod(sd, 0o555)
        try:
            with pytest.raises(DiskError):
                t.write_blocks(writes(chain("ro2", 2), NS))
            assert read(t, keys[0])[0] is ReadStatus.OK
        finally:
            os.chmod(sd, 0o755)


def test_readonly_tier(tmp_path):
    keys = chain("rot", 3)
    with open_tier(tmp_path) as t:
        t.write_blocks(writes(keys, NS))
    with DiskTier(tmp_path, capacity_bytes=0, readonly=True) as t:
        assert t.readonly
        with pytest.raises(DiskError) as ei:
            t.write_blocks(writes(chain("x", 1), NS))
        assert ei.value.errno == errno.EROFS
        for op in (lambda: t.delete(keys), lambda: t.evict_to_budget(), lambda: t.compact(),
                   lambda: t.check(fix=True)):
            with pytest.raises(DiskError):
                op()
        t.touch(keys)  # ignored
        ok, bad = verify_all(t, LAY)
        assert ok == 3 and not bad
        assert t.check() == []
    with pytest.raises(DiskError):
        DiskTier(tmp_path / "nothing-here", capacity_bytes=0, readonly=True)


def test_segment_removed_under_a_cached_fd_retries(tmp_path):
    """Another process compacted the segment: the old file is gone, the record moved. The
    reader re-reads the record and retries once; it is not counted as damage."""
    with open_tier(tmp_path) as t:
        keys = chain("mv", 4)
        t.write_blocks(writes(keys, NS))
        assert read(t, keys[0])[0] is ReadStatus.OK  # caches the fd
        stale = t._ensure().get_rec(di.dbkey(NS.id, keys[0]))
        t.delete(keys[2:])
        t.compact(threshold=0.9)  # old segment unlinked, records moved
        from kvstore.tiers.disk.index import encode_record
        status = t._read_one(di.dbkey(NS.id, keys[0]), encode_record(stale), memoryview(
            torch.empty(LAY.block_nbytes, dtype=torch.uint8).numpy()))
        assert status is ReadStatus.OK
        s = t.stats()
        assert s.read_missing == 0 and s.read_damaged == 0


def test_readonly_and_writable_tiers_in_one_process(tmp_path):
    keys = chain("mix", 2)
    with open_tier(tmp_path) as t:
        t.write_blocks(writes(keys[:1], NS))
    ro = DiskTier(tmp_path, capacity_bytes=0, readonly=True)  # opens the environment first
    rw = DiskTier(tmp_path, capacity_bytes=1 << 30)
    try:
        assert ro.readonly and not rw.readonly
        assert rw.write_blocks(writes(keys[1:], NS, keys[0])) == keys[1:]
        assert ro.leading_run(keys) == 2
    finally:
        ro.close()
        rw.close()


@pytest.mark.parametrize("chunk_blocks", [0.3, 2.0])
def test_reads_verify_piece_by_piece(tmp_path, monkeypatch, chunk_blocks):
    """Runs are read and hashed in VERIFY_CHUNK pieces: a block larger than a piece piece by
    piece, smaller ones several per preadv. A flipped byte deep inside a block, or a segment
    cut short in the middle of one, damages that block alone (and what the cut removed)."""
    monkeypatch.setattr(seg, "VERIFY_CHUNK", max(1, int(LAY.block_nbytes * chunk_blocks)))
    with open_tier(tmp_path) as t:
        keys = chain(f"piece{chunk_blocks}", 5)
        t.write_blocks(writes(keys, NS))
        path, off = seg_path(t, keys[1])
        flip(path, off + LAY.block_nbytes - 3)  # in the last piece of block 1
        dsts = [torch.empty(LAY.block_nbytes, dtype=torch.uint8) for _ in keys]
        assert t.read_many(keys, dsts) == [ReadStatus.OK, ReadStatus.DAMAGED] + [ReadStatus.OK] * 3
        for i in (0, 2, 3, 4):
            assert torch.equal(dsts[i], block_data(keys[i], LAY))
        path, off = seg_path(t, keys[3])
        os.truncate(path, off + LAY.block_nbytes // 2)
        dsts = [torch.empty(LAY.block_nbytes, dtype=torch.uint8) for _ in keys]
        got = t.read_many([keys[0], keys[2], keys[3], keys[4]], dsts[:4])
        assert got == [ReadStatus.OK, ReadStatus.OK, ReadStatus.DAMAGED, ReadStatus.DAMAGED]
        assert torch.equal(dsts[1], block_data(keys[2], LAY))
        assert t.stats().read_damaged == 3


@pytest.mark.parametrize("nbytes", [1, 4096, seg.VERIFY_CHUNK, 3 * seg.VERIFY_CHUNK + 17])
def test_pread_checksum_is_the_block_checksum(tmp_path, nbytes):
    data = os.urandom(nbytes + 9)
    p = tmp_path / "f"
    p.write_bytes(data)
    key, ns = bytes(range(32)), bytes(32)
    buf = memoryview(bytearray(nbytes))
    fd = os.open(p, os.O_RDONLY)
    try:
        n, csum = seg.pread_checksum(fd, [buf], 9, key, ns)
        assert (n, bytes(buf)) == (nbytes, data[9:])
        assert csum == seg.block_checksum(key, ns, data[9:])
        short = memoryview(bytearray(nbytes + 10))  # past the end: what was there
        n, csum = seg.pread_checksum(fd, [short], 9, key, ns)
        assert n == nbytes and csum == seg.block_checksum(key, ns, data[9:])
    finally:
        os.close(fd)
