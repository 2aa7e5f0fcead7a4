"""Adversarial reliability pass, round 4: the Redis tier attacked as a careless operator or a
hostile writer sharing the Redis would (tests/test_attacks_round4.py has the rest).

Every attack checks the promise: a fetch returns exactly the bytes put under its keys or
fewer blocks (a counted miss), never other bytes; a bad configuration is a ConfigError;
Redis trouble never raises into the store and no call waits past its budget.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time

import pytest
import torch

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'redis>=5')")

from conftest import bit_equal, keyed_kv  # noqa: E402
from support.remote import HOST, RedisProcess, redis_server_path  # noqa: E402

from kvstore import KVLayout, open_store  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.tiers.remote import ReadStatus, RemoteConfig, RemoteTier, RemoteWrite  # noqa: E402

pytestmark = pytest.mark.skipif(redis_server_path() is None,
                                reason="redis-server is not installed (tools/ci_redis.sh)")

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
OTHER = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_tokens=4)
BN = LAY.block_nbytes
BUDGET = 0.2  # generous on a loaded 2-core box; what is checked is the bound, not the speed
SLACK = 0.3


@pytest.fixture(scope="module")
def server():
    p = RedisProcess().start()
    yield p
    p.stop()
    p.cleanup()


@pytest.fixture
def raw(server):
    c = redis.Redis(host=HOST, port=server.port)
    c.flushall()
    c.config_set("maxmemory", 0)
    yield c
    c.config_set("maxmemory", 0)
    with contextlib.suppress(redis.RedisError):
        c.execute_command("REPLICAOF", "NO", "ONE")
    c.close()


def host(url, *, layout=LAY, path=None, model="attacks/remote", **kw):
    return open_store(path, layout=layout, model_id=model, device="cpu",
                      cpu_capacity=64 * layout.block_nbytes, gpu_capacity=0, remote=url,
                      remote_budget_s=BUDGET, **kw)


def put_chain(url, i: int, n: int = 4, **kw) -> list:
    """A store puts chain ``i`` (``n`` blocks) and flushes it to Redis; returns its keys."""
    with host(url, **kw) as s:
        keys = s.block_keys([i * 1000 + t for t in range(n * LAY.block_tokens)])
        assert s.put(keys, keyed_kv(LAY, keys)).wait(10) == n
        s.flush()
    return keys


def fetch_exact(s, keys, out=None) -> int:
    got = s.fetch(keys, out=out).wait(20)
    assert bit_equal(got, keyed_kv(LAY, keys[: got.shape[0]])), "wrong KV served"
    return got.shape[0]


def rkey(raw, key: bytes) -> bytes:
    """The Redis key holding ``key``'s block (the prefix names the namespace)."""
    found = raw.keys(b"*" + key.hex().encode())
    assert len(found) == 1, found
    return found[0]


def bounded(fn, limit: float):
    t0 = time.monotonic()
    r = fn()
    dt = time.monotonic() - t0
    assert dt < limit, f"took {dt:.2f} s (bound {limit} s)"
    return r


# -- other writers of the shared Redis ---------------------------------------------------------
def test_a_value_far_larger_than_a_block_is_corrupt_not_a_stalled_tier(server, raw):
    """Another writer stores 128 MiB under one of our keys. Every read of that key pulled the
    whole value: the read's pipeline ran past its deadline, so every block of it (the good
    ones before too) was a miss, the node was skipped as if down, and the value was never
    found corrupt nor deleted: one bad value took the shared tier out for everyone, read
    after read. Now a read takes at most a block's value (GETRANGE): the big value is a
    counted corrupt value, deleted, and the blocks before it are served."""
    keys = put_chain(server.url, 1)
    victim = rkey(raw, keys[1])
    raw.set(victim, b"\0" * (128 << 20))
    with host(server.url) as s:
        assert bounded(lambda: fetch_exact(s, keys), 5) == 1
        assert s.stats().damaged == 1
        assert not raw.exists(victim) or time.sleep(0.5) or not raw.exists(victim)
        assert s.stats().tier("remote").hits >= 1
        other = put_chain(server.url, 2)
        assert fetch_exact(s, other) == 4  # the tier was not put out of service


@pytest.mark.parametrize("how", ["swapped", "truncated", "other_layout", "empty", "not_string"])
def test_values_damaged_by_another_writer_are_counted_misses(server, raw, how):
    """Values swapped between two keys, cut short, replaced by a same-key block of a store
    with another layout, emptied, or replaced by a list: each fetch returns the exact
    blocks before the damage (a counted miss for damage, a plain miss for an empty value),
    and the damaged values are deleted."""
    keys = put_chain(server.url, 3)
    a, b = rkey(raw, keys[1]), rkey(raw, keys[2])
    if how == "swapped":
        va, vb = raw.get(a), raw.get(b)
        raw.set(a, vb)
        raw.set(b, va)
    elif how == "truncated":
        raw.set(a, raw.get(a)[:-100])
    elif how == "other_layout":
        with host(server.url, layout=OTHER, model="attacks/remote") as o:
            okeys = o.block_keys([3 * 1000 + t for t in range(4 * OTHER.block_tokens)])
            assert o.put(okeys, torch.ones(OTHER.batch_shape(4), dtype=OTHER.dtype)).wait(10) == 4
            o.flush()
        raw.set(a, raw.get(rkey(raw, okeys[1])))
    elif how == "empty":
        raw.set(a, b"")
    else:
        raw.delete(a)
        raw.rpush(a, b"x")
    with host(server.url) as s:
        assert bounded(lambda: fetch_exact(s, keys), 5) == 1
        assert (s.stats().damaged == 0) == (how == "empty")
        assert fetch_exact(s, keys) == 1
        if how != "empty":  # an empty value cannot be told from an absent one: left alone
            time.sleep(0.1)  # deleted in the background
            assert s.lookup(keys) == 1


def test_flushall_between_lookup_and_fetch_is_a_plain_miss_and_out_is_kept(server, raw):
    """FLUSHALL (an operator, or another tenant) between a lookup that found four blocks and
    the fetch: the fetch returns 0 blocks, counts no damage, and leaves the caller's
    ``out`` rows as they were; a put afterwards reaches Redis again."""
    keys = put_chain(server.url, 4)
    with host(server.url) as s:
        assert s.lookup(keys) == 4
        raw.flushall()
        mine = torch.full(LAY.batch_shape(4), 9.5, dtype=LAY.dtype)
        out = mine.clone()
        assert fetch_exact(s, keys, out=out) == 0
        assert s.stats().damaged == 0 and bit_equal(out, mine)
    keys = put_chain(server.url, 4)
    with host(server.url) as s:
        assert fetch_exact(s, keys) == 4


def test_maxmemory_eviction_under_fetches_serves_exact_prefixes(server, raw):
    """Redis at a small maxmemory with allkeys-lru evicts blocks while chains are written
    and read: every fetch is an exact prefix, damage is never counted for an eviction."""
    raw.config_set("maxmemory-policy", "allkeys-lru")
    raw.config_set("maxmemory", str(int(raw.info("memory")["used_memory"]) + 40 * (BN + 200)))
    try:
        chains = [put_chain(server.url, 10 + i, 6, remote_codec="none") for i in range(12)]
        with host(server.url) as s:
            served = [fetch_exact(s, ks) for ks in chains]
            assert sum(served) < 72 and s.stats().damaged == 0
    finally:
        raw.config_set("maxmemory", 0)


@pytest.mark.parametrize("refusal", ["oom", "readonly"])
def test_a_redis_that_refuses_writes_costs_counted_write_failures(server, raw, refusal):
    """Redis answers every SET with an error: OOM (maxmemory with noeviction) or READONLY (a
    replica). Puts and flushes never raise (the shared tier is a best-effort copy), the
    refusals are counted, the store serves from memory, and reads of Redis keep working."""
    old = put_chain(server.url, 30)
    if refusal == "oom":
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", 1)
    else:
        raw.config_set("replica-read-only", "yes")
        raw.execute_command("REPLICAOF", HOST, 1)  # a master that is not there: stays a replica
    try:
        with host(server.url) as s:
            keys = s.block_keys(list(range(31_000, 31_016)))
            assert bounded(lambda: s.put(keys, keyed_kv(LAY, keys)).wait(10), 5) == 4
            bounded(s.flush, 5)
            assert fetch_exact(s, keys) == 4
            assert s.stats().tier("remote").blocks == 0
        tier = RemoteTier(RemoteConfig(server.url, budget_s=BUDGET))
        try:
            w = [RemoteWrite(k, bytes(32), torch.zeros(BN, dtype=torch.uint8), 2) for k in keys]
            assert tier.write_blocks(w) == 0
            st = tier.stats()
            assert st.write_failures == 4 and st.available  # refusals do not trip the breaker
        finally:
            tier.close()
        with host(server.url) as s:
            assert fetch_exact(s, old) == 4  # reads are fine
    finally:
        raw.config_set("maxmemory", 0)
        raw.config_set("maxmemory-policy", "noeviction")
        raw.execute_command("REPLICAOF", "NO", "ONE")


def test_redis_killed_mid_run_and_restarted_empty_under_a_store(tmp_path):
    """Redis is SIGKILLed while a store with a disk tier uses it, then restarted empty on the
    same port: lookups and fetches stay within the budget and serve the disk's exact blocks,
    puts and flushes never raise, and once Redis is back new blocks reach it again."""
    p = RedisProcess().start()
    try:
        with host(p.url, path=tmp_path, disk_capacity="16MiB") as s:
            keys = s.block_keys(list(range(40_000, 40_016)))
            assert s.put(keys, keyed_kv(LAY, keys)).wait(10) == 4
            s.flush()
            p.kill()
            s.evict(keys, tier="warm")
            assert bounded(lambda: fetch_exact(s, keys), 2) == 4  # from disk
            more = s.block_keys(list(range(41_000, 41_016)))
            assert bounded(lambda: s.put(more, keyed_kv(LAY, more)).wait(10), 5) == 4
            bounded(s.flush, 5)
            p.start()
            assert s.lookup(more) == 4 and fetch_exact(s, more) == 4
            late = s.block_keys(list(range(42_000, 42_016)))
            deadline = time.monotonic() + 10
            while True:  # the breaker lets a probe through after its back-off
                s.put(late, keyed_kv(LAY, late)).wait(10)
                s.flush()
                if redis.Redis(port=p.port).dbsize() > 0 or time.monotonic() > deadline:
                    break
                s.evict(late)
                time.sleep(0.2)
            assert redis.Redis(port=p.port).dbsize() > 0, "the restarted Redis got no writes"
    finally:
        p.stop()
        p.cleanup()


# -- wrong configuration, wrong servers --------------------------------------------------------
@pytest.mark.parametrize("how", ["url", "kwargs"])
def test_decode_responses_is_a_config_error(server, how):
    """``?decode_responses=true`` in the URL (or in connection_kwargs): the tier's binary
    values were decoded as text, so every lookup hit and every read failed: a silent,
    permanent miss. Now it is refused at construction with what to drop."""
    with pytest.raises(ConfigError, match="decode_responses"):
        if how == "url":
            RemoteConfig(server.url + "?decode_responses=true").url  # noqa: B018
            RemoteTier(RemoteConfig(server.url + "?decode_responses=true"))
        else:
            RemoteTier(RemoteConfig(server.url, connection_kwargs={"decode_responses": True}))
    with pytest.raises(ConfigError, match="decode_responses"):
        host(server.url + "?decode_responses=true")


class _Impostor:
    """A TCP server on a free loopback port that is not Redis: it answers every chunk it
    reads with ``reply`` (and closes, with ``close``)."""

    def __init__(self, reply: bytes, close: bool = False) -> None:
        self.reply, self.close_after = reply, close
        self.sock = socket.create_server((HOST, 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            t = threading.Thread(target=self._serve, args=(c,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, c: socket.socket) -> None:
        c.settimeout(0.05)
        with c:
            while not self.stop.is_set():
                try:
                    data = c.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data or not self._answer(c, data):
                    return

    def _answer(self, c: socket.socket, data: bytes) -> bool:
        """Answer one chunk of commands; False: close the connection."""
        # one reply per command sent (a pipeline sends several in one chunk)
        n = max(1, data.count(b"\r\n*") + data.startswith(b"*") - 1 + 1)
        with contextlib.suppress(OSError):
            c.sendall(self.reply * n)
        return not self.close_after

    def __enter__(self) -> _Impostor:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(2)
        self.sock.close()


@pytest.mark.parametrize("reply", [
    b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",  # a web server on the port
    b":1\r\n",  # "yes" to everything, as an integer: EXISTS true, GET a number
    b"+OK\r\n",  # "OK" to everything
    b"*2\r\n$1\r\na\r\n$1\r\nb\r\n",  # arrays where strings belong
    b"-ERR unknown command\r\n",
], ids=["http", "int", "ok", "array", "error"])
def test_a_port_that_is_not_redis_is_a_bounded_miss_never_a_raise(reply):
    """The remote URL points at something that is not Redis. Lookups, reads and writes
    return misses within the budget; the tier's ``read_many`` never raises (a server that
    answered a read with a number made it raise TypeError, which the store then counted as
    damage of every block of the read); a store on it serves its own memory."""
    with _Impostor(reply) as srv:
        t = RemoteTier(RemoteConfig(srv.url, budget_s=BUDGET, backoff_s=0.01,
                                    backoff_max_s=0.02))
        try:
            keys = [hashlib.sha256(b"%d" % i).digest() for i in range(3)]
            dsts = [torch.empty(BN, dtype=torch.uint8) for _ in keys]
            for _ in range(3):
                bounded(lambda: t.leading_run(keys), BUDGET + SLACK)
                st = bounded(lambda: t.read_many(keys, dsts, namespace_id=bytes(32)),
                             BUDGET + SLACK)
                assert ReadStatus.OK not in st
                w = [RemoteWrite(k, bytes(32), torch.zeros(BN, dtype=torch.uint8), 2)
                     for k in keys]
                wrote = bounded(lambda w=w: t.write_blocks(w), 3)
                assert wrote == 0 or reply == b"+OK\r\n"  # "OK" is all a SET answers
                time.sleep(0.03)
        finally:
            t.close()
        with host(srv.url) as s:
            keys = s.block_keys(list(range(50_000, 50_016)))
            assert bounded(lambda: s.put(keys, keyed_kv(LAY, keys)).wait(10), 5) == 4
            bounded(s.flush, 5)
            assert fetch_exact(s, keys) == 4
            other = s.block_keys(list(range(51_000, 51_016)))
            assert bounded(lambda: fetch_exact(s, other), 2) == 0


_HELLO_REPLY = (b"%7\r\n+server\r\n+redis\r\n+version\r\n+7.0.0\r\n+proto\r\n:3\r\n+id\r\n"
                b":1\r\n+mode\r\n+standalone\r\n+role\r\n+master\r\n+modules\r\n*0\r\n")


class _Trickler(_Impostor):
    """A server that answers the connection's handshake and then trickles every other reply:
    a 1 MB bulk string header, then a byte every 50 ms, inside any socket timeout. It notes
    each connection it accepts and when the client cut it."""

    def __init__(self) -> None:
        self.accepted = 0
        self.cut: list[float] = []
        super().__init__(b"")

    def _serve(self, c: socket.socket) -> None:
        self.accepted += 1
        super()._serve(c)
        self.cut.append(time.monotonic())

    def _answer(self, c: socket.socket, data: bytes) -> bool:
        try:
            if b"HELLO" in data:  # redis-py's connect (RESP3 in redis-py 8)
                c.sendall(_HELLO_REPLY)
            elif b"CLIENT" in data:
                c.sendall(b"+OK\r\n" * max(1, data.count(b"*")))
            else:
                c.sendall(b"$1000000\r\n")
                while not self.stop.is_set():
                    c.sendall(b"x")
                    time.sleep(0.05)
        except OSError:  # the client cut the connection
            return False
        return True


def test_a_server_trickling_its_reply_loses_the_connection_at_the_deadline():
    """A hostile or broken server answers a read one byte at a time, each inside the socket
    timeout: the read was a miss at its deadline, but the worker thread kept reading for as
    long as the server trickled (and redis-py's retry would send it again). The late call's
    socket is now cut at the deadline, with no retry past it: the thread is free again."""
    with _Trickler() as srv:
        t = RemoteTier(RemoteConfig(srv.url, budget_s=BUDGET, backoff_s=0.01,
                                    backoff_max_s=0.02))
        try:
            keys = [hashlib.sha256(b"t%d" % i).digest() for i in range(3)]
            dsts = [torch.empty(BN, dtype=torch.uint8) for _ in keys]
            st = bounded(lambda: t.read_many(keys, dsts, namespace_id=bytes(32)),
                         BUDGET + SLACK)
            assert ReadStatus.OK not in st
            t_read = time.monotonic()
            deadline = t_read + 3
            while not srv.cut and time.monotonic() < deadline:
                time.sleep(0.02)
            assert srv.cut, "the trickling read still holds its connection"
            assert srv.cut[0] - t_read < 2
            time.sleep(0.3)
            assert srv.accepted == 1, "the read was sent again after its deadline"
        finally:
            t.close()
