"""Remote tier on one real redis-server (127.0.0.1, a free port, started here): round trips,
one-round-trip lookups, TTLs, corrupt values, budgets against a hung or dead Redis, the circuit
breaker, AUTH and TLS pass-through."""

from __future__ import annotations

import logging
import os
import struct
import time

import numpy as np
import pytest
import torch

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'redis>=5')")

from support.remote import (  # noqa: E402
    RedisProcess,
    SilentServer,
    free_port,
    make_tls_files,
    redis_server_path,
)

from kvstore.errors import (  # noqa: E402
    ConfigError,
    KeyFormatError,
    StoreClosedError,
    TensorMismatchError,
)
from kvstore.tiers import codec as codec_mod  # noqa: E402
from kvstore.tiers.remote import (  # noqa: E402
    ReadStatus,
    RemoteConfig,
    RemoteTier,
    RemoteWrite,
)
from kvstore.tiers.remote import format as fmt  # noqa: E402
from kvstore.tiers.remote.conn import Breaker, parse_remote_url, redact  # noqa: E402

needs_redis = pytest.mark.skipif(redis_server_path() is None,
                                 reason="redis-server is not installed (tools/ci_redis.sh)")

NS = bytes(range(32))
NBYTES = 4096  # one small block (2 layers x 2 planes x 4 tokens x 2 heads x 64 dims, bf16)


def kv_block(seed: int, dtype: torch.dtype = torch.bfloat16, nbytes: int = NBYTES) -> torch.Tensor:
    """Model-like bytes: normal values scaled per channel, in ``dtype``, as uint8."""
    g = torch.Generator().manual_seed(seed)
    isz = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(nbytes // isz // 64, 64, generator=g) * torch.linspace(0.1, 4, 64)
    return x.to(dtype).reshape(-1).view(torch.uint8).clone()


def keys_for(tag: str, n: int) -> list[bytes]:
    import hashlib
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def writes(keys, dtype=torch.bfloat16, ns=NS, seed0=0):
    isz = torch.empty((), dtype=dtype).element_size()
    return [RemoteWrite(k, ns, kv_block(seed0 + i, dtype), isz) for i, k in enumerate(keys)]


def dsts(n, nbytes=NBYTES):
    return [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]


@pytest.fixture(scope="module")
def server():
    if redis_server_path() is None:
        pytest.skip("redis-server is not installed (tools/ci_redis.sh installs it)")
    p = RedisProcess().start()
    yield p
    p.cleanup()


@pytest.fixture
def raw(server):
    c = redis.Redis(host="127.0.0.1", port=server.port)
    c.flushall()
    yield c
    c.close()


@pytest.fixture
def make_tier():
    opened = []

    def _make(url, **kw):
        kw.setdefault("budget_s", 0.5)  # generous on a loaded CI box; budget tests set theirs
        t = RemoteTier(RemoteConfig(url, **kw))
        opened.append(t)
        return t

    yield _make
    for t in opened:
        t.close()


# -- format and configuration (no server) ------------------------------------------------------

def test_header_layout_is_pinned():
    raw_block = np.arange(64, dtype=np.uint8)
    key = bytes([7]) * 32
    value, n = fmt.encode(key, NS, raw_block, codec="none", itemsize=2)
    assert n == 64 and len(value) == 96 + 64
    assert value[:4] == b"KVRB" and value[4] == 1 and value[5] == 0
    assert struct.unpack_from("<H", value, 6) == (96,)
    assert value[8:40] == key and value[40:72] == NS
    raw_n, checksum, pay_n = struct.unpack_from("<QQQ", value, 72)
    import xxhash
    assert (raw_n, checksum, pay_n) == (64, xxhash.xxh3_64_intdigest(raw_block), 64)
    assert value[96:] == raw_block.tobytes()
    out = np.empty(64, dtype=np.uint8)
    h = fmt.decode_into(value, key, out, NS)
    assert h.codec == 0 and np.array_equal(out, raw_block)


@pytest.mark.parametrize("dtype,codec_id", [(torch.bfloat16, codec_mod.CODEC_ZSTD_SHUFFLE2),
                                            (torch.float32, codec_mod.CODEC_ZSTD_SHUFFLE4)])
def test_zstd_shuffles_by_itemsize(dtype, codec_id):
    b = kv_block(1, dtype).numpy()
    isz = torch.empty((), dtype=dtype).element_size()
    value, n = fmt.encode(b"k" * 32, NS, b, codec="zstd", itemsize=isz)
    assert value[5] == codec_id and n < b.size
    out = np.empty_like(b)
    fmt.decode_into(value, b"k" * 32, out)
    assert np.array_equal(out, b)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_fast_unshuffle_matches_codec(width):
    a = np.random.default_rng(width).integers(0, 256, 4096 * width, dtype=np.uint8)
    sh = codec_mod.shuffle(a, width)
    ref, out = np.empty_like(a), np.empty_like(a)
    codec_mod.unshuffle_into(sh, ref, width)
    fmt.unshuffle_into(sh, out, width)
    assert np.array_equal(ref, a) and np.array_equal(out, a)


def test_config_validation_and_urls():
    for bad in ("http://h:1", "redis://a:1,b:2", "redis+cluster://a:1/3", 42):
        with pytest.raises(ConfigError):
            RemoteConfig(bad)
    for kw in ({"codec": "lz4"}, {"budget_s": 0}, {"ttl_s": -1}, {"admission": "never"},
               {"key_prefix": ""}, {"zstd_level": 0}):
        with pytest.raises(ConfigError):
            RemoteConfig("redis://127.0.0.1:1/0", **kw)
    with pytest.raises(ConfigError, match="hash tag"):
        RemoteTier(RemoteConfig("redis+cluster://127.0.0.1:1", key_prefix="{kv}:"))
    cluster, nodes, kw = parse_remote_url(
        "rediss+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2:7001?ssl_cert_reqs=none")
    assert cluster and nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    assert kw["username"] == "u" and kw["password"] == "p@ss" and kw["ssl_cert_reqs"] == "none"
    assert parse_remote_url("redis://h:6380/2")[2]["db"] == 2
    cfg = RemoteConfig("redis://:hunter2@h:1/0?password=hunter2")
    assert "hunter2" not in repr(cfg) and "hunter2" not in redact(cfg.url)
    assert "hunter2" not in repr(RemoteTier(cfg))


def test_breaker_backs_off_and_probes():
    now = [0.0]
    b = Breaker(1.0, 4.0, clock=lambda: now[0])
    assert b.allow() and b.closed
    assert b.failure() == 1.0 and not b.allow()
    now[0] = 1.01
    assert b.allow() and not b.allow()  # one probe at a time
    assert b.failure() == 2.0
    now[0] = 2.0
    assert not b.allow()
    now[0] = 3.02
    assert b.allow()
    assert b.failure() == 4.0 and b.failure() == 4.0  # capped
    assert b.success() and b.closed and b.allow()


# -- against a real redis-server -----------------------------------------------------------------

@needs_redis
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_round_trip_bit_exact(server, raw, make_tier, dtype, codec):
    t = make_tier(server.url, codec=codec)
    keys = keys_for(f"rt-{dtype}-{codec}", 12)
    items = writes(keys, dtype)
    assert t.write_blocks(items) == 12
    out = dsts(12)
    assert t.read_many(keys, out, namespace_id=NS) == [ReadStatus.OK] * 12
    for w, d in zip(items, out, strict=True):
        assert torch.equal(w.data, d)
    s = t.stats()
    assert s.hits == 12 and s.misses == s.corrupt == 0 and s.blocks_written == 12
    assert s.raw_bytes_written == 12 * NBYTES and s.available
    stored = raw.get(t.redis_key(keys[0]))
    if codec == "zstd":
        # bf16: the exponent plane compresses (~1.2x on these 4 KiB blocks, ~1.4x on 2 MiB);
        # fp32: random mantissas hardly do
        assert s.compression_ratio > (1.1 if dtype == torch.bfloat16 else 1.0) and stored[5] != 0
    else:
        assert s.compression_ratio < 1.0 and stored[5] == 0 and len(stored) == 96 + NBYTES
    # a reader that does not know the itemsize still decodes (the codec id says the shuffle)
    other = make_tier(server.url, codec="none")
    out2 = dsts(12)
    assert other.read_many(keys, out2) == [ReadStatus.OK] * 12
    assert all(torch.equal(a, b) for a, b in zip(out, out2, strict=True))


@needs_redis
def test_itemsize_from_namespace_callback(server, raw, make_tier):
    t = RemoteTier(RemoteConfig(server.url), itemsize_for=lambda ns: 2)
    try:
        k = keys_for("isz", 1)[0]
        assert t.write_blocks([RemoteWrite(k, NS, kv_block(3))]) == 1
        assert raw.get(t.redis_key(k))[5] == codec_mod.CODEC_ZSTD_SHUFFLE2
    finally:
        t.close()


@pytest.fixture
def count_sends(monkeypatch):
    """Counts socket writes of packed commands, by server port: one per round trip."""
    sends: list[int] = []
    orig = redis.connection.AbstractConnection.send_packed_command

    def wrapped(self, command, check_health=True):
        sends.append(self.port)
        return orig(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", wrapped)
    return sends


def _cmdstat(c, name: str) -> int:
    return int(c.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


@needs_redis
def test_leading_run_is_one_round_trip(server, raw, make_tier, count_sends):
    t = make_tier(server.url)
    keys = keys_for("lr", 32)
    assert t.write_blocks(writes(keys[:20])) == 20
    assert t.leading_run(keys[:1]) == 1  # warm: connection made (handshake not counted below)
    before = _cmdstat(raw, "exists")
    count_sends.clear()
    assert t.leading_run(keys) == 20
    assert len(count_sends) == 1  # all 32 EXISTS in one packed write, then the replies
    assert _cmdstat(raw, "exists") - before == 32
    gap = keys[:5] + keys_for("absent", 1) + keys[6:20]
    assert t.leading_run(gap) == 5
    assert t.leading_run([]) == 0
    count_sends.clear()
    assert t.read_many(keys[:20], dsts(20)) == [ReadStatus.OK] * 20
    assert len(count_sends) == 1
    s = t.stats()
    assert s.lookups == 3 and s.lookup_blocks == 1 + 20 + 5  # the empty one is not counted


@needs_redis
def test_ttl_applied(server, raw, make_tier):
    t = make_tier(server.url, ttl_s=30)
    k = keys_for("ttl", 2)
    t.write_blocks(writes(k[:1]))
    assert 29_000 < raw.pttl(t.redis_key(k[0])) <= 30_000
    t0 = make_tier(server.url)
    t0.write_blocks(writes(k[1:]))
    assert raw.ttl(t0.redis_key(k[1])) == -1
    short = make_tier(server.url, ttl_s=0.15)
    k2 = keys_for("ttl-short", 3)
    assert short.write_blocks(writes(k2)) == 3 and short.leading_run(k2) == 3
    time.sleep(0.3)
    assert short.leading_run(k2) == 0
    assert short.read_many(k2, dsts(3)) == [ReadStatus.MISSING] * 3


def _wait_gone(c, rkey, timeout=2.0):
    t_end = time.monotonic() + timeout
    while c.exists(rkey) and time.monotonic() < t_end:
        time.sleep(0.01)
    return not c.exists(rkey)


@needs_redis
@pytest.mark.parametrize("damage", ["garbage", "truncated", "short_header", "bit_flip",
                                    "other_key", "wrong_namespace", "bad_size", "wrong_type",
                                    "bad_codec"])
def test_corrupt_values_are_counted_misses(server, raw, make_tier, damage, caplog):
    t = make_tier(server.url)
    k = keys_for(f"bad-{damage}", 2)
    assert t.write_blocks(writes(k)) == 2
    rk = t.redis_key(k[0])
    v = bytearray(raw.get(rk))
    ns = NS
    out = dsts(1)
    if damage == "garbage":
        raw.set(rk, os.urandom(len(v)))
    elif damage == "truncated":
        raw.set(rk, bytes(v[:-10]))
    elif damage == "short_header":
        raw.set(rk, bytes(v[:50]))
    elif damage == "bit_flip":
        v[200] ^= 0x10
        raw.set(rk, bytes(v))
    elif damage == "other_key":
        raw.set(rk, raw.get(t.redis_key(k[1])))
    elif damage == "wrong_namespace":
        ns = bytes(32)
    elif damage == "bad_size":
        out = dsts(1, NBYTES // 2)
    elif damage == "wrong_type":
        raw.delete(rk)
        raw.lpush(rk, b"x")
    elif damage == "bad_codec":
        v[5] = 99
        raw.set(rk, bytes(v))
    with caplog.at_level(logging.WARNING, logger="kvstore.remote"):
        st = t.read_many(k[:1], out, namespace_id=ns)
    assert st == [ReadStatus.DAMAGED]
    assert t.stats().corrupt == 1 and t.stats().hits == 0
    assert "corrupt" in caplog.text
    assert _wait_gone(raw, rk)  # deleted best-effort (in the background)
    assert t.leading_run(k[:1]) == 0
    # the intact neighbour is untouched
    assert t.read_many(k[1:], dsts(1), namespace_id=NS) == [ReadStatus.OK]


@needs_redis
def test_newer_format_is_a_miss_left_in_place(server, raw, make_tier):
    t = make_tier(server.url)
    k = keys_for("newer", 1)
    t.write_blocks(writes(k))
    rk = t.redis_key(k[0])
    v = bytearray(raw.get(rk))
    v[4] = fmt.FORMAT_VERSION + 1
    raw.set(rk, bytes(v))
    assert t.read_many(k, dsts(1)) == [ReadStatus.MISSING]
    s = t.stats()
    assert s.corrupt == 0 and s.misses == 1
    time.sleep(0.05)
    assert raw.exists(rk)


@needs_redis
def test_argument_errors_raise_and_closed_tier(server, make_tier):
    t = make_tier(server.url)
    with pytest.raises(KeyFormatError):
        t.leading_run([b"short"])
    with pytest.raises(TensorMismatchError):
        t.read_many(keys_for("a", 1), [torch.empty(8, dtype=torch.float32)])
    with pytest.raises(TensorMismatchError):
        t.read_many(keys_for("a", 2), dsts(1))
    with pytest.raises(TensorMismatchError):
        t.write_blocks([RemoteWrite(keys_for("a", 1)[0], NS, torch.empty(4, 4, dtype=torch.uint8))])
    t.close()
    t.close()
    with pytest.raises(StoreClosedError):
        t.leading_run(keys_for("a", 1))


@needs_redis
def test_delete_and_stats(server, raw, make_tier):
    t = make_tier(server.url)
    k = keys_for("del", 4)
    t.write_blocks(writes(k))
    assert t.delete(k[:2] + keys_for("nope", 1)) == 2
    assert t.leading_run(k) == 0 and t.leading_run(k[2:]) == 2
    s = t.stats()
    assert s.deleted == 2 and s.bytes_sent == s.stored_bytes_written > 0


@needs_redis
def test_concurrent_callers(server, raw, make_tier):
    import threading

    t = make_tier(server.url)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            k = keys_for(f"conc-{w}", 8)
            items = writes(k, seed0=100 * w)
            for _ in range(10):
                assert t.write_blocks(items) == 8
                assert t.leading_run(k) == 8
                out = dsts(8)
                assert t.read_many(k, out) == [ReadStatus.OK] * 8
                assert all(torch.equal(a.data, b) for a, b in zip(items, out, strict=True))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    s = t.stats()
    assert s.hits == 320 and s.errors == s.timeouts == s.corrupt == 0


@needs_redis
def test_restart_between_calls_costs_no_error(make_tier):
    """Pooled sockets the server closed are re-made at once (one retry on connection
    errors), so a Redis restart between calls is not a failure of the next call."""
    with RedisProcess() as p:
        t = make_tier(p.url, budget_s=BUDGET)
        k = keys_for("restart", 2)
        assert t.write_blocks(writes(k)) == 2
        p.stop()
        p.start()
        assert t.leading_run(k) == 0  # empty again (no persistence), and reachable
        assert t.write_blocks(writes(k)) == 2 and t.leading_run(k) == 2
        s = t.stats()
        assert s.errors == 0 and s.timeouts == 0 and s.available


# -- budgets, failures, circuit breaker ------------------------------------------------------------

BUDGET = 0.1
SLACK = 0.15  # thread hand-off and a loaded 2-core CI box


def _timed(fn):
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0


@needs_redis
def test_hung_server_costs_at_most_the_budget(make_tier, caplog):
    with SilentServer() as s:
        t = make_tier(s.url, budget_s=BUDGET, backoff_s=0.3)
        k = keys_for("hung", 4)
        with caplog.at_level(logging.WARNING, logger="kvstore.remote"):
            n, dt = _timed(lambda: t.leading_run(k))
        assert n == 0 and dt < BUDGET + SLACK
        assert "failed" in caplog.text
        # breaker open: skipped at once
        st, dt = _timed(lambda: t.read_many(k, dsts(4)))
        assert st == [ReadStatus.MISSING] * 4 and dt < 0.02
        time.sleep(0.35)  # after the back-off one call probes, and pays the budget again
        st, dt = _timed(lambda: t.read_many(k, dsts(4)))
        assert st == [ReadStatus.MISSING] * 4 and dt < BUDGET + SLACK
        s1 = t.stats()
        assert s1.timeouts >= 2 and s1.skipped == 4 and not s1.available
        # a write is bounded by the write budget, and never raises
        t2 = make_tier(s.url, budget_s=BUDGET, write_budget_s=0.2)
        n, dt = _timed(lambda: t2.write_blocks(writes(k)))
        assert n == 0 and dt < 0.2 + SLACK and t2.stats().write_failures == 4


@needs_redis
def test_dead_port_is_a_quick_miss(make_tier):
    t = make_tier(f"redis://127.0.0.1:{free_port()}/0", budget_s=BUDGET)
    k = keys_for("dead", 3)
    n, dt = _timed(lambda: t.leading_run(k))
    assert n == 0 and dt < BUDGET + SLACK
    assert t.write_blocks(writes(k)) == 0
    assert t.stats().errors >= 1


@needs_redis
def test_paused_redis_then_resumed(make_tier):
    with RedisProcess() as p:
        t = make_tier(p.url, budget_s=BUDGET, backoff_s=0.2)
        k = keys_for("pause", 6)
        assert t.write_blocks(writes(k)) == 6
        p.pause()  # SIGSTOP: connections hang, nothing answers
        try:
            n, dt = _timed(lambda: t.leading_run(k))
            assert n == 0 and dt < BUDGET + SLACK
            st, dt = _timed(lambda: t.read_many(k, dsts(6)))
            assert st == [ReadStatus.MISSING] * 6 and dt < BUDGET + SLACK
        finally:
            p.resume()
        t_end = time.monotonic() + 5
        while t.leading_run(k) != 6:  # the breaker lets a probe through, which succeeds
            assert time.monotonic() < t_end, "did not recover after SIGCONT"
            time.sleep(0.05)
        assert t.read_many(k, dsts(6)) == [ReadStatus.OK] * 6 and t.stats().available


@needs_redis
def test_killed_redis_turns_into_misses_then_recovers(make_tier):
    p = RedisProcess().start()
    try:
        t = make_tier(p.url, budget_s=BUDGET, backoff_s=0.2, backoff_max_s=0.4)
        k = keys_for("kill", 8)
        assert t.write_blocks(writes(k)) == 8
        out = dsts(8)
        assert t.read_many(k, out) == [ReadStatus.OK] * 8
        p.kill()  # mid-run
        for _ in range(5):
            st, dt = _timed(lambda: t.read_many(k, out))
            assert st == [ReadStatus.MISSING] * 8 and dt < BUDGET + SLACK
            assert t.leading_run(k) == 0
            assert t.write_blocks(writes(k[:1])) == 0
        s = t.stats()
        assert not s.available and s.nodes_down == 1 and s.errors >= 1
        p.start()  # back, on the same port, empty
        t_end = time.monotonic() + 5
        while t.write_blocks(writes(k)) != 8:
            assert time.monotonic() < t_end, "circuit breaker did not close"
            time.sleep(0.05)
        assert t.leading_run(k) == 8 and t.read_many(k, out) == [ReadStatus.OK] * 8
        assert t.stats().available
    finally:
        p.cleanup()


@needs_redis
def test_auth_passed_through(make_tier):
    with RedisProcess(args=["--requirepass", "s3cret"]) as p:
        k = keys_for("auth", 2)
        good = make_tier(f"redis://:s3cret@127.0.0.1:{p.port}/0")
        assert good.write_blocks(writes(k)) == 2 and good.leading_run(k) == 2
        via_kw = make_tier(p.url, password="s3cret")
        assert via_kw.read_many(k, dsts(2)) == [ReadStatus.OK] * 2
        bad = make_tier(p.url)  # no password: errors, counted, never raised
        assert bad.leading_run(k) == 0 and bad.stats().errors == 1


@needs_redis
def test_tls_passed_through(make_tier, tmp_path):
    try:
        ca, cert, key = make_tls_files(str(tmp_path))
    except (RuntimeError, OSError) as e:
        pytest.skip(f"cannot make TLS files: {e}")
    try:
        p = RedisProcess(tls=(ca, cert, key)).start()
    except RuntimeError as e:
        pytest.skip(f"redis-server without TLS support: {e}")
    try:
        t = make_tier(p.url)  # rediss://127.0.0.1:N/0?ssl_ca_certs=ca.pem
        assert p.url.startswith("rediss://")
        k = keys_for("tls", 3)
        items = writes(k)
        assert t.write_blocks(items) == 3
        out = dsts(3)
        assert t.read_many(k, out) == [ReadStatus.OK] * 3
        assert all(torch.equal(a.data, b) for a, b in zip(items, out, strict=True))
        # without the CA the certificate does not verify: a miss, not an exception
        plain = make_tier(f"rediss://127.0.0.1:{p.port}/0")
        # a refused handshake; on a loaded machine it may outlast the budget instead
        assert plain.leading_run(k) == 0
        assert plain.stats().errors + plain.stats().timeouts == 1
    finally:
        p.cleanup()
