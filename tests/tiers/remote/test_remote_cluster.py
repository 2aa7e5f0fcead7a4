"""Remote tier on a real 3-master Redis Cluster (127.0.0.1, started here): two processes (two
"hosts") share it bit-exact, a lookup is one pipeline per master, and a killed master turns into
misses for its keys only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'redis>=5')")

from conftest import REPO  # noqa: E402
from support.remote import (  # noqa: E402
    RedisClusterProcesses,
    redis_cli_path,
    redis_server_path,
)

from kvstore.tiers.remote import ReadStatus, RemoteConfig, RemoteTier, RemoteWrite  # noqa: E402

pytestmark = pytest.mark.skipif(redis_server_path() is None or redis_cli_path() is None,
                                reason="redis-server / redis-cli are not installed "
                                       "(tools/ci_redis.sh)")

NS = bytes(range(32, 64))
NBYTES = 8192

# one "host": writes or reads blocks whose bytes derive from their key (numpy only)
HOST_SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np, torch
    from kvstore.tiers.remote import RemoteConfig, RemoteTier, RemoteWrite, ReadStatus
    url, mode, tag, n, nbytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    ns = bytes(range(32, 64))
    keys = [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]
    def block(k):
        rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
        x = rng.standard_normal(nbytes // 2, dtype=np.float32) * 3
        return torch.from_numpy((x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).copy())
    t = RemoteTier(RemoteConfig(url, budget_s=1.0))
    if mode == "write":
        out = {"written": t.write_blocks([RemoteWrite(k, ns, block(k), 2) for k in keys])}
    else:
        dsts = [torch.empty(nbytes, dtype=torch.uint8) for _ in keys]
        st = t.read_many(keys, dsts, namespace_id=ns)
        out = {"lookup": t.leading_run(keys),
               "ok": sum(s is ReadStatus.OK for s in st),
               "exact": sum(s is ReadStatus.OK and torch.equal(d, block(k))
                            for s, d, k in zip(st, dsts, keys))}
    s = t.stats()
    out["ratio"] = s.compression_ratio
    out["nodes"] = s.nodes
    t.close()
    print(json.dumps(out))
""")


def host(url: str, mode: str, tag: str, n: int) -> dict:
    env = dict(os.environ)
    root = str(REPO)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", HOST_SCRIPT, url, mode, tag, str(n), str(NBYTES)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster():
    c = RedisClusterProcesses(3).start()
    yield c
    c.cleanup()


def keys_for(tag: str, n: int) -> list[bytes]:
    import hashlib
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NBYTES // 2, generator=g).to(torch.bfloat16).view(torch.uint8).clone()


def test_two_hosts_share_the_cluster(cluster):
    w = host(cluster.url, "write", "shared", 48)
    assert w["written"] == 48 and w["ratio"] > 1.1 and w["nodes"] == 3
    r = host(cluster.url, "read", "shared", 48)
    assert r == {"lookup": 48, "ok": 48, "exact": 48, "ratio": 1.0, "nodes": 3}
    # the blocks are spread over every master (no hash tag: each key hashes to its own slot)
    sizes = [redis.Redis(host="127.0.0.1", port=p.port).dbsize() for p in cluster.nodes]
    assert all(s > 0 for s in sizes) and sum(sizes) >= 48


@pytest.fixture
def count_sends(monkeypatch):
    sends: list[int] = []
    orig = redis.connection.AbstractConnection.send_packed_command

    def wrapped(self, command, check_health=True):
        sends.append(self.port)
        return orig(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", wrapped)
    return sends


def test_lookup_is_one_pipeline_per_master(cluster, count_sends):
    with RemoteTier(RemoteConfig(cluster.url, budget_s=1.0)) as t:
        k = keys_for("rtt", 30)
        assert t.write_blocks([RemoteWrite(x, NS, block(i), 2) for i, x in enumerate(k)]) == 30
        assert t.leading_run(k) == 30  # warm every master's connection
        count_sends.clear()
        t0 = time.perf_counter()
        assert t.leading_run(k) == 30
        dt = time.perf_counter() - t0
        ports = sorted(count_sends)
        assert ports == sorted(p.port for p in cluster.nodes)  # exactly one write per master
        assert dt < 0.5
        count_sends.clear()
        assert t.read_many(k, [torch.empty(NBYTES, dtype=torch.uint8) for _ in k]) == [
            ReadStatus.OK] * 30
        assert sorted(count_sends) == sorted(p.port for p in cluster.nodes)


def test_unreachable_cluster_is_a_quick_miss():
    from support.remote import free_port

    with RemoteTier(RemoteConfig(f"redis+cluster://127.0.0.1:{free_port()}", budget_s=0.1)) as t:
        k = keys_for("nocluster", 4)
        t0 = time.perf_counter()
        assert t.leading_run(k) == 0
        assert t.read_many(k, [torch.empty(NBYTES, dtype=torch.uint8) for _ in k]) == [
            ReadStatus.MISSING] * 4
        assert t.write_blocks([RemoteWrite(x, NS, block(i), 2) for i, x in enumerate(k)]) == 0
        assert time.perf_counter() - t0 < 0.5
        s = t.stats()
        assert not s.available and s.errors >= 1 and s.skipped >= 4


def test_stale_slot_table_is_refreshed(cluster):
    """MOVED replies (resharding, failover) are misses and trigger a re-read of the slots."""
    with RemoteTier(RemoteConfig(cluster.url, budget_s=1.0, backoff_s=0.1)) as t:
        k = keys_for("moved", 30)
        assert t.write_blocks([RemoteWrite(x, NS, block(i), 2) for i, x in enumerate(k)]) == 30
        topo = t._topo
        first = topo.slots[0]
        topo.slots = [first] * len(topo.slots)  # as if every slot had moved to one master
        topo.refreshed_at = 0.0
        assert t.leading_run(k) < 30  # some keys answered MOVED: misses, not errors raised
        t_end = time.monotonic() + 5
        while t.leading_run(k) != 30:
            assert time.monotonic() < t_end, "slot table was not refreshed"
            time.sleep(0.05)
        assert t.read_many(k, [torch.empty(NBYTES, dtype=torch.uint8) for _ in k]) == [
            ReadStatus.OK] * 30


def test_killed_master_is_misses_for_its_keys(cluster):
    """Runs last in this module: kills a master, then restarts it."""
    t = RemoteTier(RemoteConfig(cluster.url, budget_s=0.2, backoff_s=0.2, backoff_max_s=0.4))
    try:
        k = keys_for("kill", 60)
        data = [block(1000 + i) for i in range(60)]
        assert t.write_blocks([RemoteWrite(x, NS, d, 2) for x, d in zip(k, data, strict=True)]) == 60
        victim = cluster.node_of(t.redis_key(k[0]))
        on_victim = [cluster.node_of(t.redis_key(x)) is victim for x in k]
        assert 0 < sum(on_victim) < 60
        victim.kill()  # mid-run
        out = [torch.empty(NBYTES, dtype=torch.uint8) for _ in k]
        for _ in range(3):
            t0 = time.perf_counter()
            st = t.read_many(k, out, namespace_id=NS)
            assert time.perf_counter() - t0 < 0.2 + 0.2
            for s, dead, d, o in zip(st, on_victim, data, out, strict=True):
                if dead:
                    assert s is ReadStatus.MISSING
                else:
                    assert s is ReadStatus.OK and torch.equal(d, o)
            assert t.leading_run(k) == 0  # k[0] lives on the dead master
            alive = [x for x, dead in zip(k, on_victim, strict=True) if not dead]
            assert t.leading_run(alive) == len(alive)
        s = t.stats()
        assert s.nodes_down == 1 and not s.available and s.errors >= 1 and s.corrupt == 0
        # the master comes back (empty: no persistence); its keys are written again
        victim.start()
        t_end = time.monotonic() + 10
        while t.write_blocks([RemoteWrite(x, NS, d, 2) for x, d in zip(k, data, strict=True)]) != 60:
            assert time.monotonic() < t_end, "the restarted master was not used again"
            time.sleep(0.1)
        assert t.read_many(k, out, namespace_id=NS) == [ReadStatus.OK] * 60
        assert t.stats().available
    finally:
        t.close()
