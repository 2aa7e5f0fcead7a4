"""``kvstore.tiers.disk.tombstones``: the bounded trace of removed records — encoding, newest
trace wins, the bound (and that the newest ``GENERATION`` are always kept), tolerance of an
index without it, and that the index guard accepts an index that has it."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk import tombstones as tomb
from kvstore.tiers.disk.guard import check_index


def _ck(i: int) -> bytes:
    return bytes(32) + i.to_bytes(32, "big")


def test_value_round_trip_and_damage():
    v = tomb.encode(tomb.Reason.EVICTED, tomb.TierCode.WARM, 1_700_000_000_123_456,
                    1_600_000_000_000_000, tomb.Detail.NONE)
    assert v == bytes.fromhex("01010200" "00000000" "40222018240a0600" "0000a40731af0500")
    assert tomb.META.pack(1, 1, 0, 7) == bytes.fromhex("0101000007000000")
    t = tomb.decode(v)
    assert t == tomb.Tombstone(tomb.Reason.EVICTED, tomb.TierCode.WARM, tomb.Detail.NONE,
                               1_700_000_000.123456, 1_600_000_000.0)
    assert tomb.decode(v[:-1]) is None
    assert tomb.decode(bytes([2]) + v[1:]) is None  # another version
    assert tomb.decode(v[:1] + bytes([99]) + v[2:]) is None  # unknown reason


def test_absent_database_is_not_kept(tmp_path):
    """An index written before tombstones existed has no such database: readers answer
    NOT_KEPT until a writer records one (opening it writable creates it)."""
    t = DiskTier(tmp_path / "s", capacity_bytes=1 << 20)
    assert tomb.kept(t)  # a writable open creates the database
    sh = t._sh
    with sh.env.begin(write=True) as txn:  # as an older index was
        txn.drop(sh.dbs.pop(tomb.DB_TOMBSTONES), delete=True)
    try:
        assert not tomb.kept(t)
        assert tomb.lookup_on(t, bytes(32), [bytes(32)]) is tomb.NOT_KEPT
        tomb.record_on(t, [(_ck(1), 5)], tomb.Reason.REMOVED, tomb.TierCode.DISK)
        assert tomb.kept(t)
        (got,) = tomb.lookup_on(t, bytes(32), [_ck(1)[32:]])
        assert got.reason is tomb.Reason.REMOVED and got.stored == 5e-6
    finally:
        t.close()
    res = check_index(os.path.join(tmp_path / "s", "index"), full=True)
    assert res.ok, res.problem  # the index guard accepts an index with the database
    assert res.report.databases.get("tombstones") == 2  # one trace and the bookkeeping entry
    r = DiskTier(tmp_path / "s", capacity_bytes=0, readonly=True)
    try:
        assert tomb.kept(r) and tomb.lookup_on(r, bytes(32), [_ck(1)[32:]])[0] is not None
    finally:
        r.close()


def test_newest_trace_wins(tmp_path):
    t = DiskTier(tmp_path / "s", capacity_bytes=1 << 20)
    try:
        tomb.record_on(t, [(_ck(1), 0)], tomb.Reason.EVICTED, tomb.TierCode.DISK, removed_us=1)
        tomb.record_on(t, [(_ck(1), 0)], tomb.Reason.REMOVED, tomb.TierCode.DISK, removed_us=2)
        (got,) = tomb.lookup_on(t, bytes(32), [_ck(1)[32:]])
        assert got.reason is tomb.Reason.REMOVED and got.removed == 2e-6
    finally:
        t.close()


@settings(max_examples=25, deadline=None)
@given(gen=st.integers(1, 6), batches=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_bounded_and_the_newest_generation_is_kept(tmp_path_factory, monkeypatch_module, gen,
                                                   batches):
    monkeypatch_module.setattr(tomb, "GENERATION", gen)
    t = DiskTier(tmp_path_factory.mktemp("tomb"), capacity_bytes=1 << 20)
    try:
        n = 0
        for b in batches:
            tomb.record_on(t, [(_ck(n + i), 0) for i in range(b)], tomb.Reason.EVICTED,
                           tomb.TierCode.DISK, removed_us=n + 1)
            n += b
        sh = t._sh
        db = tomb.db_in(t._ensure())
        with sh.read() as txn:
            entries = sum(1 for k, _v in txn.cursor(db=db) if len(k) == 65)
        assert entries <= 2 * gen
        got = tomb.lookup_on(t, bytes(32), [_ck(i)[32:] for i in range(n)])
        assert all(g is not None for g in got[max(0, n - gen):])  # the newest are there
    finally:
        t.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
