"""Smoke test of the remote benchmark section (quick sizes, its own redis-server)."""

from __future__ import annotations

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (pip install 'redis>=5')")

from kvstore.bench import BenchOptions
from kvstore.bench import remote as remote_bench
from kvstore.tiers.remote import local_server as procs


def test_remote_bench_without_redis_server_is_empty(monkeypatch):
    monkeypatch.setattr(procs, "redis_server_path", lambda: None)
    assert remote_bench.run(BenchOptions(quick=True)) == []


@pytest.mark.skipif(procs.redis_server_path() is None,
                    reason="redis-server is not installed (tools/ci_redis.sh)")
def test_remote_bench_quick(monkeypatch):
    started = []
    orig = procs.RedisProcess.start

    def start(self, *a, **kw):
        started.append(self)
        return orig(self, *a, **kw)

    monkeypatch.setattr(procs.RedisProcess, "start", start)
    rows = remote_bench.run(BenchOptions(quick=True))
    names = [r.name for r in rows]
    assert "read_many codec=none" in names and "write_blocks codec=zstd" in names
    assert any(n.startswith("compression ratio") for n in names)
    assert all(r.section == "remote" and r.value > 0 and r.ref_value > 0 for r in rows)
    ratio = next(r for r in rows if r.name.startswith("compression ratio"))
    assert 1.2 < ratio.value < 2.0  # model-like bf16 KV, zstd + byte-shuffle
    assert started and all(not p.running for p in started)  # its redis-server is stopped


def test_model_like_kv_is_not_uniform_noise():
    import torch

    from kvstore.layout import KVLayout

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_tokens=4)
    b = remote_bench.model_like_kv(lay, 3)
    assert b.shape == (3, lay.block_nbytes) and b.dtype == torch.uint8
    x = b.view(torch.bfloat16).float()
    assert torch.isfinite(x).all() and not torch.equal(b[0], b[1])
