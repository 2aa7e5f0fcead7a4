"""Three real ``kvstore serve`` daemons publishing KV events, one router subscribed to all
three: it routes each prompt to the daemon that truly holds its longest prefix (checked by
asking every daemon's lookup), before and after evictions and a daemon's restart."""

import logging

import pytest
import torch
from conftest import wait_until
from support.events import EventDaemon

from kvstore import KVLayout, connect
from kvstore.events import MEDIUM_CPU, MEDIUM_STORAGE
from kvstore.namespace import Namespace
from kvstore.routing import EngineSpec, Router, Subscriber

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, block_tokens=4)
MODEL = "route/model"
NS = Namespace.create(MODEL, LAYOUT)
TOKENS = list(range(1000, 1024))  # 6 blocks


def kv(n):
    return torch.randn(LAYOUT.batch_shape(n)).to(LAYOUT.dtype)


@pytest.fixture
def daemons(tmp_path):
    ds = {}
    for name in "abc":
        (tmp_path / name).mkdir()
        d = EventDaemon(tmp_path / name / "store", tmp_path / name / "run" / "s.sock",
                        f"ipc://{tmp_path}/{name}.events", "--cpu-capacity", "1MiB",
                        "--disk-capacity", "64MiB")
        ds[name] = d.start()
    yield ds
    for d in ds.values():
        assert d.stop() == 0, d.log()


def client(d):
    return connect(d.socket_path, layout=LAYOUT, model_id=MODEL, device="cpu")


def lookups(ds, keys):
    out = {}
    for name, d in ds.items():
        with client(d) as c:
            out[name] = c.lookup(keys)
    return out


def test_route_follows_what_each_daemon_holds(daemons, caplog):
    caplog.set_level(logging.INFO, logger="kvstore.routing")
    specs = [EngineSpec(n, d.endpoint) for n, d in daemons.items()]
    # silence_s: long enough that a slow restart shows as a gap, not as falling silent
    with Subscriber(specs, silence_s=120) as sub:
        router = Router(list(daemons), sub.index, namespace=NS, live=sub.live_engines)
        assert sub.wait_live(timeout=60), sub.stats()
        keys = router.keys(TOKENS)
        for name, n in (("a", 2), ("b", 5), ("c", 3)):
            with client(daemons[name]) as c:
                assert c.put(keys[:n], kv(n)).wait() == n

        def agrees():
            truth = lookups(daemons, keys)
            return sub.index.match(keys, list(daemons)).blocks == tuple(truth.values()), truth

        assert wait_until(lambda: agrees()[0], timeout=30), (agrees(), sub.stats())
        r = router.route(TOKENS)
        assert (r.engine, r.cached_blocks, r.mode) == ("b", 5, "exploit")
        assert MEDIUM_CPU in sub.index.media_of("b", keys[0])  # (and STORAGE once written)

        # b evicts most of it: c now holds the longest prefix
        with client(daemons["b"]) as c:
            c.evict(keys[2:])
        assert wait_until(lambda: agrees()[0], timeout=30), agrees()
        truth = agrees()[1]
        assert truth == {"a": 2, "b": 2, "c": 3}
        r = router.route(TOKENS)
        assert (r.engine, r.cached_blocks) == ("c", 3)

        # c restarts: its memory is gone, its disk kept the blocks; the router sees the new
        # instance's numbers (a gap), resyncs from its snapshot and still routes to it
        before = {s.engine: s for s in sub.stats()}["c"]
        assert daemons["c"].stop() == 0
        daemons["c"].start()
        assert wait_until(lambda: {s.engine: s for s in sub.stats()}["c"].snapshots
                          > before.snapshots, timeout=60), sub.stats()
        after = {s.engine: s for s in sub.stats()}["c"]
        assert after.gaps > before.gaps and after.state == "live"
        assert wait_until(lambda: agrees()[0], timeout=30), agrees()
        assert sub.index.media_of("c", keys[0]) == (MEDIUM_STORAGE,)
        r = router.route(TOKENS)
        assert (r.engine, r.cached_blocks) == ("c", 3)

        # a catches up past everyone
        with client(daemons["a"]) as c:
            c.put(keys, kv(6)).wait()
        assert wait_until(lambda: agrees()[0], timeout=30), agrees()
        assert router.route(TOKENS).engine == "a"
        assert all(s.bad_messages == 0 for s in sub.stats())
    # c's restart is a resync, not an error (issue 26: a KeyError traceback every time)
    bad = [r for r in caplog.records if r.name.startswith("kvstore.routing")
           and (r.levelno > logging.INFO or r.exc_info)]
    assert not bad, [(r.levelname, r.getMessage(), r.exc_text) for r in bad]
