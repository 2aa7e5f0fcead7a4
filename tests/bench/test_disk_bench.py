"""The disk benchmark: its schedule (interleaved, rotating, same repetitions for every method,
cold reads after a page-cache drop), its checks (wrong bytes are an error, not a figure), its
rows and table, and one real run at a tiny size through the fork server."""

from __future__ import annotations

import os
import sys

import pytest

from kvstore.bench import disk as disk_bench
from kvstore.bench import disk_harness
from kvstore.bench.disk import DiskPlan, MethodResult, SizeResults


class FakeZygote:
    """Records the operations the benchmark asks for; answers like the worker would."""

    calls: list[tuple[str, str, str]] = []  # (op, dir, cache state)
    dropped: set[str] = set()

    def __init__(self, python, nbytes, n, seed, *, lmcache, log_path, timeout_s=900.0):
        self.n = n

    def run(self, op: str, **args):
        d = args["dir"]
        FakeZygote.calls.append((op, d, "cold" if d in FakeZygote.dropped else "cached"))
        FakeZygote.dropped.discard(d)
        if op.endswith(".write"):
            return {"seconds": 0.5}
        if op == "lmcache_disk.all":
            return {"seconds": 0.5, "cold_seconds": 0.25, "cold_ok": self.n,
                    "warm_seconds": 0.1, "warm_ok": self.n}
        if op == "lmcache_disk.survive":
            return {"seconds": 0.0, "blocks_found": 0}
        return {"seconds": 0.25, "blocks_found": self.n, "blocks_ok": self.n}

    def close(self) -> None:
        pass


@pytest.fixture
def fake(monkeypatch, tmp_path):
    FakeZygote.calls = []
    FakeZygote.dropped = set()

    def drop(d):
        FakeZygote.dropped.add(d)
        return "fadvise"

    monkeypatch.setattr(disk_bench, "Zygote", FakeZygote)
    monkeypatch.setattr(disk_bench, "drop_cache", drop)
    monkeypatch.setattr(disk_bench, "load_cache", lambda d: None)
    monkeypatch.setattr(disk_bench, "lmcache_python", lambda: ("/fake/python", "fake"))
    return tmp_path


def test_schedule_interleaves_rotates_and_drops_before_cold_reads(fake):
    plan = DiskPlan(block_tokens=(16,), total_bytes=8 << 20, reps=4, workdir=str(fake))
    (sr,) = disk_bench.measure(plan)
    names = [m.name for m in disk_bench.METHODS]
    assert [r.method.name for r in sr.results] == names
    for r in sr.results:  # the same number of samples for every method and phase
        assert all(len(r.seconds[p]) == 4 for p in disk_bench.PHASES), r.method.name
    writes = [op for op, _d, _c in FakeZygote.calls if op.endswith((".write", ".all"))]
    firsts = [writes[i * 4] for i in range(4)]  # first writer of each repetition rotates
    assert firsts == ["kvstore.write", "raw.write", "lmcache_disk.all", "lmcache_fsl2.write"]
    reads = [(op, c) for op, _d, c in FakeZygote.calls if op.endswith(".read")]
    # per repetition: a cold read of each method that reads in a fresh process, then cached
    assert [c for _op, c in reads] == (["cold"] * 3 + ["cached"] * 3) * 4
    assert sr.get(disk_bench.KVSTORE).survives == "4/4"
    assert sr.get(disk_bench.LOCAL_DISK).survives == "0/4"
    assert sr.get(disk_bench.RAW).survives == "-"
    assert os.listdir(fake) == []  # cleaned up


def test_rows_compare_medians_and_name_their_goals(fake):
    plan = DiskPlan(block_tokens=(16, 256), total_bytes=64 << 20, reps=1, workdir=str(fake))
    sizes = disk_bench.measure(plan)
    rows = [r for sr in sizes for r in disk_bench.size_rows(sr)]
    by = {(r.name, r.ref_name): r for r in rows}
    put = by[("durable put (put + flush), 2 MiB blocks", disk_bench.RAW)]
    assert put.goal == 0.9 and put.ratio == pytest.approx(1.0) and put.unit == "GB/s"
    assert by[("cold fetch, fresh process, 32 MiB blocks", disk_bench.LOCAL_DISK)].goal == 1.0
    cached = by[("page-cache fetch, fresh process (after restart), 2 MiB blocks",
                 disk_bench.LOCAL_DISK)]
    assert cached.ratio == pytest.approx(0.1 / 0.25)
    assert "survives restart: kvstore 32/32" in cached.note
    table = disk_bench.markdown_table(sizes)
    assert "| 32 MiB | LMCache 0.5.6 LocalDiskBackend | 0.13 | 0.27 | 0.67 | 0/2 |" in table


def test_without_lmcache_the_peers_are_skipped_with_the_reason(fake, monkeypatch):
    monkeypatch.setattr(disk_bench, "lmcache_python", lambda: (None, "no LMCache environment"))
    (sr,) = disk_bench.measure(DiskPlan(block_tokens=(16,), total_bytes=8 << 20, reps=1,
                                        workdir=str(fake)))
    assert [r.method.name for r in sr.results] == [disk_bench.KVSTORE, disk_bench.RAW]
    assert sr.skipped == ["LMCache peers: no LMCache environment"]
    assert "skipped: LMCache peers: no LMCache environment" in disk_bench.markdown_table([sr])


def test_wrong_bytes_are_an_error_not_a_figure(fake, monkeypatch):
    honest = FakeZygote.run

    def lying(self, op, **args):
        if op == "kvstore.read":
            return {"seconds": 0.1, "blocks_found": self.n, "blocks_ok": self.n - 1}
        return honest(self, op, **args)

    monkeypatch.setattr(FakeZygote, "run", lying, raising=True)
    with pytest.raises(AssertionError, match="hold the bytes"):
        disk_bench.measure(DiskPlan(block_tokens=(16,), total_bytes=8 << 20, reps=1,
                                    lmcache=False, workdir=str(fake)))


def test_spread_and_lmcache_env(monkeypatch, tmp_path):
    s = disk_harness.spread_gbs(2_000_000_000, [1.0, 2.0, 4.0])
    assert (s.median, s.low, s.high) == (1.0, 0.5, 2.0) and s.text() == "1.00 [0.50-2.00]"
    assert disk_harness.spread_gbs(1_000_000_000, [1.0]).text() == "1.00"
    monkeypatch.setenv(disk_harness.LMCACHE_VENV_ENV, str(tmp_path / "nope"))
    py, why = disk_harness.lmcache_python()
    assert py is None and "not executable" in why


def test_real_run_in_fresh_processes(tmp_path):
    """kvstore and the raw peer through the fork server: bytes verified, blocks survive the
    writer's SIGKILL, page cache dropped for the cold read."""
    plan = DiskPlan(block_tokens=(16,), total_bytes=8 << 20, reps=1, lmcache=False,
                    workdir=str(tmp_path))
    (sr,) = disk_bench.measure(plan)
    ours = sr.get(disk_bench.KVSTORE)
    assert ours.survives == "4/4"
    assert all(len(ours.seconds[p]) == 1 and ours.seconds[p][0] > 0 for p in disk_bench.PHASES)
    assert "posix_fadvise" in sr.cold_how or "drop_caches" in sr.cold_how
    rows = disk_bench.size_rows(sr)
    assert {r.ref_name for r in rows} == {disk_bench.RAW}
    assert all(r.value > 0 and r.ref_value > 0 and r.ratio > 0 for r in rows)
    assert list(tmp_path.iterdir()) == []


def test_reopen_row(tmp_path):
    row = disk_bench.reopen_row(2_000, str(tmp_path))
    assert row.name == "reopen with 2,000 records (cold index)" and row.value > 0
    assert list(tmp_path.iterdir()) == []


def test_results_survive_text():
    r = MethodResult(disk_bench.METHODS[0], 2 << 20, 8)
    assert r.survives == "-" and r.spread("put") is None
    r.found = 8
    r.seconds["put"] = [1.0]
    assert r.survives == "8/8" and SizeResults(2 << 20, [r], []).get(disk_bench.KVSTORE) is r


def test_every_clock_starts_on_a_settled_heap(tmp_path):
    """Each operation collects and freezes its heap right before its clock starts (as a
    warm engine's process is): regression for a 2 MiB fetch that paid a 60-90 ms full
    collection of torch's objects by chance, a third of the read, and the raw peer none."""
    nb, n = 2 << 20, 2
    z = disk_harness.Zygote(sys.executable, nb, n, 0, lmcache=False,
                            log_path=str(tmp_path / "worker.log"))
    try:
        for op in ("raw.write", "raw.read", "kvstore.write", "kvstore.read"):
            res = z.run(op, dir=str(tmp_path / op.split(".")[0]), block_tokens=16)
            assert res["heap_frozen"] > 1000, (op, res)  # torch's objects, at least
    finally:
        z.close()
