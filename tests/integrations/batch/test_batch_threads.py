"""The batched engine's thread count: usable cores (affinity, cgroup quota) and the share of
them other processes leave it (``engines/threads.py``)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from support.cores import FakeCores

from kvstore.integrations.batch.engines import threads
from kvstore.integrations.batch.engines.threads import MIN_WINDOW, proc_stat_reader


def test_idle_cores_all_threads_busy_core_left_out():
    m = FakeCores()
    s = m.share(2)
    assert s.threads() == 2
    m.advance(0.6, others=0.0, own=2.0)  # this process alone, both cores spinning
    assert s.threads() == 2 and s.others == 0.0
    m.advance(0.6, others=1.0, own=1.0)  # a busy process arrived
    assert s.threads() == 1 and abs(s.others - 1.0) < 1e-9
    m.advance(0.6, others=1.0, own=1.0)
    assert s.threads() == 1
    m.advance(0.6, others=0.1, own=1.0)  # it left (a little noise stays)
    assert s.threads() == 2


def test_looks_at_most_every_interval_and_afresh_when_a_run_starts():
    m = FakeCores()
    s = m.share(4)
    m.advance(0.2, others=3.0, own=1.0)
    assert s.threads() == 4 and m.reads == 1  # inside the interval: no look
    t = m.t
    assert s.threads(now=True) == 1 and m.reads == 3  # a run's start looks now ...
    assert abs(m.t - t - MIN_WINDOW) < 1e-12  # ... over a fresh window
    # a burst of another job before the run started is not held against it
    m.advance(5.0, others=4.0, own=0.0)
    m.others = 0.0
    assert s.threads(now=True) == 4


def test_unreadable_stat_keeps_every_usable_core():
    m = FakeCores()
    m.readable = False
    s = m.share(3)
    m.advance(1.0, others=2.0, own=1.0)
    assert s.threads() == 3 and s.threads(now=True) == 3
    m2 = FakeCores()
    s2 = m2.share(3)
    m2.readable = False
    m2.advance(1.0, others=2.0, own=1.0)
    assert s2.threads() == 3  # the file went away mid-run: all cores, no more looks
    m2.readable = True
    m2.advance(1.0, others=2.0, own=1.0)
    assert s2.threads() == 3


@given(cores=st.integers(1, 64), others=st.floats(0, 80), own=st.floats(0, 64),
       seconds=st.floats(0.5, 30))
def test_threads_stay_within_one_and_the_cores(cores, others, own, seconds):
    m = FakeCores()
    s = m.share(cores)
    m.advance(seconds, others=others, own=own)
    n = s.threads()
    assert 1 <= n <= cores
    assert abs(s.others - others) < 1e-6 * max(1.0, others)
    if s.others <= threads.TAKEN:
        assert n == cores
    else:  # every core others keep busy (past TAKEN of it) is left to them
        assert n == max(1, cores - int(s.others + 1 - threads.TAKEN))


def test_proc_stat_reader_sums_the_usable_cpus(tmp_path: Path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  900 0 100 800 0 0 0 0 0 0\n"
                    "cpu0 100 0 50 400 10 0 0 0 0 0\n"
                    "cpu1 200 0 30 300 20 5 5 0 0 0\n"
                    "cpu2 999 0 0 0 0 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    tick = threads.os.sysconf("SC_CLK_TCK")
    got = proc_stat_reader([0, 1], stat)()
    assert got is not None and abs(got.busy - (150 + 240) / tick) < 1e-9
    assert got.own >= 0
    assert proc_stat_reader([7], stat)() is None  # no such CPU listed
    stat.write_text("cpu0 a b c\n")
    assert proc_stat_reader([0], stat)() is None
    assert proc_stat_reader([0], tmp_path / "missing")() is None


def test_the_real_reader_reads_this_machine():
    got = proc_stat_reader()()
    if Path("/proc/stat").exists():
        assert got is not None and got.busy > 0


def test_usable_cores_affinity_and_cgroup_quota(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 3, 5, 6}, raising=False)
    assert threads.usable_cores(tmp_path) == 4  # no quota files
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.usable_cores(tmp_path) == 4
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 cores (v2)
    assert threads.usable_cores(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("20000 100000\n")
    assert threads.usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")  # v1: 3 cores
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.usable_cores(tmp_path) == 3
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1: no quota
    assert threads.usable_cores(tmp_path) == 4


def test_under_a_cgroup_quota_the_count_is_the_quotas(monkeypatch, tmp_path: Path):
    """A quota below the affinity: other containers' load on the host CPUs is not this
    process's to give up; the count stays the quota's."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(threads, "_cgroup_cores", lambda root=tmp_path: 2.0)
    assert threads.quota_limited() and threads.usable_cores() == 2
    s = threads.CoreShare()
    assert s.cores == 2 and s.threads(now=True) == 2 and s.threads() == 2
    monkeypatch.setattr(threads, "_cgroup_cores", lambda root=tmp_path: None)
    assert not threads.quota_limited()
