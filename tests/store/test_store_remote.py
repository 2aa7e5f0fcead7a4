"""The store with a remote (Redis) tier: two hosts share blocks; Redis trouble is a miss."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import TESTS, bit_equal, keyed_kv
from support.remote import RedisProcess, redis_server_path

from kvstore import KVLayout, open_store

redis = pytest.importorskip("redis")
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)


@pytest.fixture(scope="module")
def server(redis_server):
    return redis_server


def host(path, url, **kw):
    return open_store(path, layout=LAY, model_id=kw.pop("model_id", "remote/test"), device="cpu",
                      cpu_capacity=kw.pop("cpu", 16) * LAY.block_nbytes, remote=url, **kw)


def kv_for(keys):
    return keyed_kv(LAY, keys)


def same(a, b):
    return bit_equal(a, b)


def test_block_put_on_one_host_is_fetched_bit_exact_on_another(server, tmp_path):
    redis.Redis(port=server.port).flushall()
    with host(tmp_path / "a", server.url) as a:
        keys = a.block_keys(list(range(24)), salt="t")
        a.put(keys, kv_for(keys)).wait()
        a.flush()
        assert a.stats().tier("remote").blocks == 6
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(TESTS)!r}, {str(Path(__file__).parent)!r}]
        from test_store_remote import host, kv_for, same
        with host({str(tmp_path / "b")!r}, {server.url!r}) as b:
            keys = b.block_keys(list(range(24)), salt="t")
            assert b.lookup(keys) == 6
            got = b.fetch(keys).wait()
            assert got.shape[0] == 6 and same(got, kv_for(keys))
            b.flush()
            st = b.stats()
            assert st.tier("disk").blocks == 6, st  # host b keeps a local copy
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_corrupt_remote_value_is_a_counted_miss(server, tmp_path):
    r = redis.Redis(port=server.port)
    r.flushall()
    with host(None, server.url) as a:
        keys = a.block_keys(list(range(16)))
        a.put(keys, kv_for(keys)).wait()
        a.flush()
    for k in r.keys("kvstore:*"):
        v = bytearray(r.get(k))
        v[-3] ^= 0xFF
        r.set(k, bytes(v))
    with host(None, server.url) as b:
        got = b.fetch(keys).wait()
        assert got.shape[0] == 0
        assert b.stats().damaged >= 1


def test_dead_redis_costs_at_most_the_budget(tmp_path):
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed")
    p = RedisProcess().start()
    try:
        with host(tmp_path / "s", p.url, remote_budget_s=0.05) as s:
            keys = s.block_keys(list(range(16)))
            p.pause()  # SIGSTOP: accepts nothing, answers nothing
            t0 = time.perf_counter()
            assert s.lookup(s.block_keys(list(range(100, 116)))) == 0
            assert time.perf_counter() - t0 < 0.5
            assert s.put(keys, kv_for(keys)).wait(5) == 4  # puts never wait for Redis
            assert same(s.fetch(keys).wait(5), kv_for(keys))
    finally:
        p.resume()
        p.stop()
        p.cleanup()


def test_other_namespace_cannot_shadow_blocks_in_the_shared_tier(server, tmp_path):
    """An attacker on another host writes the victim's keys first (its own bytes, its own
    model): the victim's blocks still reach Redis and a third host fetches the victim's bytes."""
    redis.Redis(port=server.port).flushall()
    with host(None, server.url) as v:
        keys = v.block_keys(list(range(16)))
    raw = [bytes(k) for k in keys]
    with host(None, server.url, model_id="attacker") as a:
        junk = torch.zeros(LAY.batch_shape(4), dtype=LAY.dtype)
        a.put(raw, junk).wait()
        a.flush()
    with host(None, server.url) as v:
        v.put(keys, kv_for(keys)).wait()
        v.flush()
    with host(None, server.url) as c:
        assert c.lookup(keys) == 4
        got = c.fetch(keys).wait()
        assert got.shape[0] == 4 and same(got, kv_for(keys))


def test_other_namespace_cannot_overwrite_blocks_in_the_shared_tier(server, tmp_path):
    """The victim's blocks are in Redis; an attacker writes the same keys with its bytes under
    its model: a fresh victim host still fetches the victim's own bytes."""
    redis.Redis(port=server.port).flushall()
    with host(None, server.url) as v:
        keys = v.block_keys(list(range(16)))
        v.put(keys, kv_for(keys)).wait()
        v.flush()
    with host(None, server.url, model_id="attacker") as a:
        a.put([bytes(k) for k in keys], torch.zeros(LAY.batch_shape(4), dtype=LAY.dtype)).wait()
        a.flush()
    with host(None, server.url) as c:
        got = c.fetch(keys).wait()
        assert got.shape[0] == 4 and same(got, kv_for(keys))


def test_remote_lookup_is_one_round_trip_and_a_fetch_two(server, tmp_path, monkeypatch):
    """A lookup is one pipeline of EXISTS; a fetch locates once (EXISTS) and reads with what it
    found (GETRANGE): no second EXISTS, no per-block calls."""
    from kvstore.tiers.remote import tier as remote_tier

    redis.Redis(port=server.port).flushall()
    with host(None, server.url) as a:
        keys = a.block_keys(list(range(24)), salt="rt")
        a.put(keys, kv_for(keys)).wait()
        a.flush()
    calls: list[list[str]] = []
    real = remote_tier._pipeline

    def counted(client, cmds, deadline):
        calls.append([args[0] for args, _ in cmds])
        return real(client, cmds, deadline)

    monkeypatch.setattr(remote_tier, "_pipeline", counted)
    with host(None, server.url) as b:
        keys = b.block_keys(list(range(24)), salt="rt")
        assert b.lookup(keys) == 6
        assert [set(c) for c in calls] == [{"EXISTS"}], calls
        calls.clear()
        got = b.fetch(keys).wait()
        assert got.shape[0] == 6 and same(got, kv_for(keys))
        assert [set(c) for c in calls] == [{"EXISTS"}, {"GETRANGE"}], calls
