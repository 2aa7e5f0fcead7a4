"""``kvstore.connect`` beyond parity with the embedded store: a daemon that is down, comes
back, or goes away; paged engines; what a connection holds when it closes."""

import logging
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import wait_until

from kvstore import KVLayout, StoreStats, connect
from kvstore.api import PinReceipt
from kvstore.errors import DaemonUnavailableError

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_tokens=4)
MEMORY = ("--cpu-capacity", "1MiB", "--disk-capacity", "0")


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.batch_shape(n), generator=g).to(LAYOUT.dtype)


@pytest.fixture(scope="module")
def shared(memory_daemon):
    return memory_daemon


_until = wait_until


def test_daemon_down_means_misses_and_a_warning_then_reconnect(serve, tmp_path, caplog):
    sock = tmp_path / "run" / "kvstore.sock"
    with caplog.at_level(logging.WARNING, logger="kvstore.client"):
        c = connect(sock, layout=LAYOUT, model_id="m", device="cpu", timeout=5,
                    wait_for_daemon=True)  # a daemon that is still starting
    assert "unavailable" in caplog.text and "reconnecting" in caplog.text
    keys = c.block_keys(list(range(16)))  # computed locally, no daemon needed
    kv = _kv(4)
    assert not c.connected
    assert c.lookup(keys) == 0
    assert c.fetch(keys).wait().shape == LAYOUT.batch_shape(0)
    assert c.put(keys, kv).wait() == 0  # dropped
    assert c.prefetch(keys).wait() == 0 and len(c.pin(keys)) == 0 and c.unpin(keys) == 0
    assert c.evict() == 0 and isinstance(c.stats(), StoreStats) and c.stats().blocks == 0
    c.flush()
    assert caplog.text.count("unavailable") == 1  # one warning per outage, not per call

    d = serve(*MEMORY)
    assert _until(lambda: c.put(keys, kv).wait() == 4)  # reconnected (with backoff)
    assert c.connected and "reconnected" in caplog.text
    assert torch.equal(c.fetch(keys).wait(), kv)

    d.kill()  # gone mid-session: the next calls miss, nothing raises
    assert c.lookup(keys) == 0 and c.fetch(keys).wait().shape[0] == 0
    assert c.put(keys, kv).wait() == 0
    serve(*MEMORY)
    assert _until(lambda: c.put(keys, kv).wait() == 4)  # a fresh daemon: memory-only, empty
    assert c.lookup(keys) == 4
    c.close()


def test_leases_grants_and_pins_go_back_when_the_client_closes(shared):
    d = shared
    a = connect(d.socket_path, layout=LAYOUT, model_id="pins", device="cpu")
    b = connect(d.socket_path, layout=LAYOUT, model_id="pins", device="cpu")
    keys = a.block_keys(list(range(16)))
    a.put(keys, _kv(4)).wait()
    receipt = a.pin(keys)
    assert isinstance(receipt, PinReceipt) and len(receipt) == 4
    assert b.stats().pinned_blocks == 4 and b.server_stats().pinned_blocks == 4
    assert b.unpin(keys) == 0  # b cannot drop a's pins
    assert b.evict(keys) == 0
    a.close()  # without releasing
    assert _until(lambda: b.stats().pinned_blocks == 0)
    assert b.evict(keys) == 4
    srv = b.server_stats()
    assert srv.leases == srv.grants == srv.pinned_blocks == 0
    assert srv.free_warm_slots == srv.warm_slots
    b.close()


def test_fetch_into_buffer_and_partial_results(shared):
    with connect(shared.socket_path, layout=LAYOUT, model_id="partial", device="cpu") as c:
        keys = c.block_keys(list(range(40)))
        kv = _kv(10, seed=4)
        assert c.put(keys[:6], kv[:6]).wait() == 6
        out = torch.zeros(LAYOUT.batch_shape(10), dtype=LAYOUT.dtype)
        res = c.fetch(keys, out=out).wait()
        assert res.data_ptr() == out.data_ptr() and res.shape[0] == 6
        assert torch.equal(out[:6], kv[:6]) and not out[6:].any()
        assert c.put(keys, kv).wait() == 4  # the 6 held ones are duplicates
        t = c.fetch(keys)
        assert t.done() and t.wait_layer(LAYOUT.num_layers - 1) is None
        assert torch.equal(t.wait(), kv)
        nc = kv.transpose(3, 4).contiguous().transpose(3, 4)  # a non-contiguous source
        k2 = c.block_keys(list(range(1000, 1040)))
        assert c.put(k2, nc).wait() == 10 and torch.equal(c.fetch(k2).wait(), kv)


def test_load_into_and_save_from_paged_cache(shared):
    P, H, D, T = LAYOUT.kv_planes, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.block_tokens
    page = 2
    pages = [torch.randn(P, 16, page, H, D).to(LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]
    with connect(shared.socket_path, layout=LAYOUT, model_id="paged", device="cpu") as c:
        keys = c.block_keys(list(range(3 * T)))
        ids = [5, 6, 1, 2, 9, 10]
        assert c.save_from(pages, ids, keys).wait() == 3
        dst = [torch.zeros_like(p) for p in pages]
        new_ids = [0, 3, 4, 7, 8, 11]
        t = c.load_into(keys, dst, new_ids)
        assert t.wait() == 3
        for src, got in zip(pages, dst, strict=True):
            assert torch.equal(got[:, new_ids], src[:, ids])
            untouched = [i for i in range(16) if i not in new_ids]
            assert not got[:, untouched].any()
        assert c.load_into(c.block_keys(list(range(100, 112))), dst, new_ids).wait() == 0


def test_lookup_longer_than_one_request(serve, caplog):
    d = serve(*MEMORY, "--max-keys", "64")
    with connect(d.socket_path, layout=LAYOUT, model_id="m", device="cpu") as c:
        keys = c.block_keys(list(range(4 * 150)))
        assert c.put(keys[:50], _kv(50)).wait() == 50
        assert c.lookup(keys) == 50  # one request is enough
        assert c.put(keys[50:100], _kv(50)).wait() == 50
        assert c.lookup(keys) == 100  # two requests of <= 64 keys
        with caplog.at_level(logging.WARNING, logger="kvstore.client"):
            # fetches are not split (the limit is the daemon's to set): a miss and a warning,
            # not an exception in the engine
            assert c.fetch(keys).wait().shape[0] == 0
            assert c.put(keys, _kv(150)).wait() == 0
        assert "at most 64" in caplog.text and caplog.text.count("answered as a miss") == 1
        assert c.connected and torch.equal(c.fetch(keys[:64]).wait()[:50], _kv(50))


@pytest.mark.cuda
def test_cuda_client_copies_through_pinned_shared_memory(shared):
    with connect(shared.socket_path, layout=LAYOUT, model_id="cuda", device="cuda") as c:
        assert c._session.pinned  # the mapping is registered: host<->GPU copies are DMA
        keys = c.block_keys(list(range(16)))
        kv = _kv(4).cuda()
        assert c.put(keys, kv).wait() == 4
        got = c.fetch(keys).wait()
        assert got.is_cuda and torch.equal(got, kv)
        out = torch.zeros(LAYOUT.batch_shape(6), dtype=LAYOUT.dtype, device="cuda")
        assert c.fetch(keys, out=out).wait().shape[0] == 4 and torch.equal(out[:4], kv)
        assert not out[4:].any()


def test_lookup_answers_warm_blocks_from_the_key_directory(serve):
    """Warm blocks are found in the shared key directory (no round trip); the stretch after
    them (here: on the daemon's disk only) is asked of the daemon; the daemon still counts
    every lookup; evictions show at once."""
    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "16MiB")
    with connect(d.socket_path, layout=LAYOUT, model_id="dir", device="cpu") as c:
        keys = c.block_keys(list(range(8 * 4)))
        assert c.put(keys, _kv(8)).wait() == 8
        c.flush()
        sent = []
        real_call = c._call
        c._call = lambda req, *a, **kw: sent.append(req) or real_call(req, *a, **kw)
        assert c.lookup(keys) == 8 and c.lookup(keys[:3]) == 3
        assert sent == []  # answered locally
        assert c.evict(keys[5:], tier="warm") == 3  # 5, 6, 7 now only on the daemon's disk
        sent.clear()
        assert c.lookup(keys) == 8
        (asked,) = sent
        assert asked.keys == b"".join(keys[5:]) and asked.parent == keys[4]
        assert c.evict(keys[6:]) == 2  # gone everywhere
        assert c.lookup(keys) == 6
        st = c.stats()  # flushes the client's report of its local lookups first
        assert st.lookups == 4 and st.hits == 8 + 3 + 8 + 6
        assert st.misses == 2


def test_lookup_without_a_key_directory_asks_the_daemon(shared, monkeypatch):
    """An older daemon (no directory file): every lookup is a round trip, same answers."""
    from kvstore.tiers import key_directory

    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(key_directory.KeyDirectory, "open_readonly", staticmethod(missing))
    with connect(shared.socket_path, layout=LAYOUT, model_id="nodir", device="cpu") as c:
        keys = c.block_keys(list(range(16)))
        c.put(keys, _kv(4)).wait()
        sent = []
        real_call = c._call
        c._call = lambda req, *a, **kw: sent.append(req) or real_call(req, *a, **kw)
        assert c.lookup(keys) == 4 and len(sent) == 1


def test_lookup_reports_get_no_reply(shared):
    """A client that only looks up (a router) sends reports; none is answered, so nothing
    piles up unread in its socket; the counts arrive."""
    import select

    with connect(shared.socket_path, layout=LAYOUT, model_id="router", device="cpu") as c:
        keys = c.block_keys(list(range(16)))
        c.put(keys, _kv(4)).wait()
        before = c.stats().hits
        for _ in range(50):
            assert c.lookup(keys) == 4
            c._report(0, 0, 0, now=True)
        sock = c._session.channel._sock
        time.sleep(0.2)
        assert select.select([sock], [], [], 0)[0] == []
        assert c.stats().hits == before + 200


def test_connect_to_a_socket_nobody_serves_raises(tmp_path, caplog):
    """A mistyped path, or a daemon not started, is an error at connect (issue 31): not a
    client that misses everything. Reconnecting is for a daemon that was there."""
    sock = tmp_path / "run" / "kvstore.sock"
    with pytest.raises(DaemonUnavailableError) as e:
        connect(sock, layout=LAYOUT, model_id="m", device="cpu", timeout=5)
    msg = str(e.value)
    assert f"no kvstore daemon answers at {sock} (No such file or directory)" in msg
    assert "wait_for_daemon=True" in msg and "\n" not in msg
    assert isinstance(e.value, ConnectionError)
    sock.parent.mkdir()
    stale = socket.socket(socket.AF_UNIX)  # a socket file nobody listens on (a dead daemon's)
    stale.bind(str(sock))
    stale.close()
    with pytest.raises(DaemonUnavailableError, match="Connection refused"):
        connect(sock, layout=LAYOUT, model_id="m", device="cpu", timeout=5)
    with caplog.at_level(logging.WARNING, logger="kvstore.client"):
        c = connect(sock, layout=LAYOUT, model_id="m", device="cpu", wait_for_daemon=True)
    assert not c.connected and "unavailable" in caplog.text
    c.close()


def test_a_layout_given_by_dtype_name_works_with_tensors(shared):
    by_name = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", block_tokens=4)
    assert by_name == LAYOUT and by_name.dtype is torch.bfloat16
    with connect(shared.socket_path, layout=by_name, model_id="by-name", device="cpu") as c:
        keys = c.block_keys(list(range(16)))
        assert c.put(keys, _kv(4)).wait() == 4
        got = c.fetch(keys).wait()
        assert got.dtype == torch.bfloat16 and torch.equal(got, _kv(4))


def _python(code: str) -> subprocess.CompletedProcess:
    from kvstore.child import env

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env(), stdin=subprocess.DEVNULL)


def test_importing_the_client_does_not_import_torch():
    """``import kvstore.client`` stays light (issue 31: it took 5.6 s of torch); the keys,
    namespace ids and hello of a layout given by dtype name need no torch either."""
    r = _python(
        "import sys, kvstore.client\n"
        "assert 'torch' not in sys.modules, 'import kvstore.client imported torch'\n"
        "from kvstore import KVLayout\n"
        "from kvstore.namespace import Namespace\n"
        "from kvstore.wire.protocol import make_hello\n"
        "lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype='bfloat16', block_tokens=4)\n"
        "make_hello(lay, 'm')\n"
        "print(Namespace.create('m', lay).id.hex(), lay.block_nbytes)\n"
        "assert 'torch' not in sys.modules, 'a layout by name imported torch'\n")
    assert r.returncode == 0, r.stderr
    from kvstore.namespace import Namespace

    assert r.stdout.split() == [Namespace.create("m", LAYOUT).id.hex(), str(LAYOUT.block_nbytes)]


def test_a_put_hint_reaches_the_daemons_eviction_order(serve, tmp_path):
    from kvstore import ConfigError, PutHint

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16,
                   block_tokens=4)  # 2 KiB blocks: 8 fill the daemon's smallest warm tier

    def _kv(n, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(lay.batch_shape(n), generator=g).to(lay.dtype)

    serve("--cpu-capacity", str(8 * lay.block_nbytes), "--disk-capacity", "0",
          "--eviction", "lru")
    c = connect(tmp_path / "run" / "kvstore.sock", layout=lay, model_id="hints",
                device="cpu", timeout=5)
    try:
        chat = c.block_keys(list(range(16)))
        assert c.put(chat, _kv(4), PutHint(session="chat")).wait() == 4
        job1 = c.block_keys([100 + i for i in range(8)])
        job2 = c.block_keys([200 + i for i in range(8)])
        assert c.put(job1, _kv(2, 1), PutHint(session="job")).wait() == 2
        assert c.put(job2, _kv(2, 2), PutHint(session="job")).wait() == 2  # branches
        more = c.block_keys(list(range(24)))
        kv = torch.cat([_kv(4), _kv(2, 3)])
        assert c.put(more, kv, PutHint(session="chat")).wait() == 2
        # the daemon made room from the branching job's blocks, not the conversation's
        assert c.lookup(job2) == 0 and c.lookup(job1) == 2
        assert torch.equal(c.fetch(more).wait(), kv)
        with pytest.raises(ConfigError, match="kvstore.PutHint"):
            c.put(job1, _kv(2), "job")  # type: ignore[arg-type]
    finally:
        c.close()


def test_close_takes_a_timeout_and_is_bounded_by_it(shared):
    """``KVCache.close(timeout=)`` is the protocol's: the daemon client takes it too (it was a
    TypeError), and a call that never finishes on another thread holds ``close`` for at most
    ``timeout`` seconds, not the session's 60."""
    from kvstore.api import KVCache

    c = connect(shared.socket_path, layout=LAYOUT, model_id="close-timeout", device="cpu")
    assert isinstance(c, KVCache)
    keys = c.block_keys(list(range(8)))
    assert c.put(keys, _kv(2)).wait() == 2
    stuck = c._session.copying()  # a copy in flight that never ends
    stuck.__enter__()
    t0 = time.monotonic()
    c.close(timeout=0.3)
    assert time.monotonic() - t0 < 5 and c.closed
    c.close(timeout=0.3)  # twice: a no-op
    with connect(shared.socket_path, layout=LAYOUT, model_id="close-timeout", device="cpu") as d:
        assert torch.equal(d.fetch(keys).wait(), _kv(2))  # acknowledged: kept by the daemon
        d.close(timeout=None)
