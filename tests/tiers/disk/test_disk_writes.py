"""Disk tier writes taken apart: staged batches are neither visible nor named until their
commit, several batches share one commit, an abort or a failed commit leaves nothing, and
the segment writer hands its chunks to the device as it goes."""

from __future__ import annotations

import os

import pytest
import torch
from support.disk import block_data, chain, namespace, small_layout, writes
from support.disk import verify_all as _verify_all

from kvstore.errors import DiskError
from kvstore.tiers.disk import DiskTier, ReadStatus
from kvstore.tiers.disk import segments as seg

LAY = small_layout(torch.bfloat16)
NS = namespace(LAY)


def open_tier(path, **kw):
    kw.setdefault("capacity_bytes", 1 << 30)
    t = DiskTier(path, **kw)
    t.register_namespace(NS)
    return t


def verify_all(t: DiskTier, keys: list[bytes], layout) -> None:
    ok, bad = _verify_all(t, layout)
    assert bad == [] and ok == t.stats().blocks and t.leading_run(keys) == len(keys)


def _segment_files(path) -> tuple[list[str], list[str]]:
    names = os.listdir(os.path.join(path, "segments"))
    return (sorted(n for n in names if seg.SEGMENT_RE.match(n)),
            sorted(n for n in names if seg.TEMP_RE.match(n)))


def test_staged_blocks_are_invisible_until_committed_together(tmp_path):
    t = open_tier(tmp_path)
    a, b = chain("a", 3), chain("b", 2)
    s1 = t.stage_blocks(writes(a, NS))
    s2 = t.stage_blocks(writes(b, NS))
    assert s1.nbytes > 3 * LAY.block_nbytes and t.leading_run(a + b) == 0
    named, temps = _segment_files(tmp_path)
    assert named == [] and len(temps) == 2  # written under temp names only
    other = open_tier(tmp_path)  # another process's view: nothing either
    assert other.leading_run(a) == 0 and other.stats().blocks == 0
    assert sorted(t.commit_staged([s1, s2])) == sorted(a + b)
    assert t.stats().blocks == 5 and t.stats().segments == 2
    named, temps = _segment_files(tmp_path)
    assert len(named) == 2 and temps == []
    verify_all(t, a + b, LAY)
    assert t.commit_staged([s1, s2]) == []  # a batch is committed once
    t.close()
    other.close()
    t = open_tier(tmp_path)  # durable: a fresh open finds every block
    verify_all(t, a + b, LAY)
    t.close()


def test_abort_removes_the_staged_files(tmp_path):
    t = open_tier(tmp_path)
    keys = chain("x", 4)
    s = t.stage_blocks(writes(keys, NS))
    t.abort_staged([s])
    assert _segment_files(tmp_path) == ([], []) and t.leading_run(keys) == 0
    assert t.commit_staged([s]) == []
    t.close()


def test_a_failed_commit_leaves_nothing_visible_or_named(tmp_path, monkeypatch):
    t = open_tier(tmp_path)
    first, second = chain("f", 2), chain("s", 2)
    s1 = t.stage_blocks(writes(first, NS))
    s2 = t.stage_blocks(writes(second, NS))
    real = seg.finish_segment
    calls = []

    def failing(open_seg):
        calls.append(open_seg.final)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(open_seg)

    monkeypatch.setattr(seg, "finish_segment", failing)
    with pytest.raises(DiskError, match="disk full"):
        t.commit_staged([s1, s2])
    assert _segment_files(tmp_path) == ([], [])  # the one already named went too
    assert t.leading_run(first) == 0 and t.leading_run(second) == 0
    assert t.stats().write_errors == 1
    monkeypatch.setattr(seg, "finish_segment", real)
    assert t.write_blocks(writes(first, NS)) == first  # the tier still works
    t.close()


def test_staging_skips_present_keys_and_a_batch_of_nothing(tmp_path):
    t = open_tier(tmp_path)
    keys = chain("p", 3)
    t.write_blocks(writes(keys[:2], NS))
    s = t.stage_blocks(writes(keys, NS))
    assert t.commit_staged([s]) == [keys[2]]
    empty = t.stage_blocks(writes(keys, NS))
    assert empty.segments == [] and t.commit_staged([empty]) == []
    dst = torch.empty(LAY.block_nbytes, dtype=torch.uint8)
    assert t.read_into(keys[2], dst) is ReadStatus.OK
    assert torch.equal(dst, block_data(keys[2], LAY))
    t.close()


def test_the_same_key_staged_twice_is_committed_once(tmp_path):
    t = open_tier(tmp_path)
    keys = chain("d", 2)
    s1, s2 = t.stage_blocks(writes(keys, NS)), t.stage_blocks(writes(keys, NS))
    assert t.commit_staged([s1, s2]) == keys  # the second copy is dead bytes
    assert t.stats().blocks == 2
    verify_all(t, keys, LAY)
    t.close()


def test_segment_writes_are_chunked_and_handed_to_the_device(tmp_path, monkeypatch):
    kicked = []
    monkeypatch.setattr(seg, "_WRITE_CHUNK", 3 * LAY.block_nbytes)
    monkeypatch.setattr(seg, "kick_writeback", lambda fd, off, n: kicked.append((off, n)))
    t = open_tier(tmp_path)
    keys = chain("k", 10)
    t.write_blocks(writes(keys, NS))
    total = sum(n for _off, n in kicked)
    (name,), _ = _segment_files(tmp_path)
    assert total == os.path.getsize(tmp_path / "segments" / name) and len(kicked) >= 3
    assert [off for off, _n in kicked] == [sum(n for _o, n in kicked[:i]) for i in range(len(kicked))]
    verify_all(t, keys, LAY)
    t.close()


def test_kick_writeback_is_harmless_where_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(seg, "_sync_file_range", None)
    p = tmp_path / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"x" * 8192)
        seg.kick_writeback(fd, 0, 8192)
        seg.kick_writeback(-1, 0, 1)  # EBADF: raises nothing, and the hint stays on
        assert seg._sync_file_range is not False
        seg.kick_writeback(fd, 0, 8192)
    finally:
        os.close(fd)
