"""Smoke test of the disk benchmark section (quick sizes)."""

from __future__ import annotations

from kvstore.bench import BenchOptions
from kvstore.bench import disk as disk_bench


def test_disk_bench_quick(tmp_path):
    rows = disk_bench.run(BenchOptions(quick=True, workdir=str(tmp_path)))
    names = [r.name for r in rows]
    assert any(n.startswith("write_blocks (1 batch") for n in names)
    assert any(n.startswith("cold read_many (") for n in names)
    assert any(n.startswith("cold read_many vs best peer") for n in names)
    assert any(n.startswith("reopen with 100,000 records") for n in names)
    for r in rows:
        assert r.section == "disk" and r.value > 0 and r.ref_value > 0 and r.ratio > 0
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up after itself
