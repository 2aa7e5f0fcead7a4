"""Adversarial reliability pass, round 12: "safe to run for months". Earlier rounds attacked bad
input, crashes, faults and races; this one attacks long running: what grows without bound, or
leaks, when a daemon, its clients, the Redis tier or the KV event publisher run for months.

Churn is accelerated (thousands of iterations in seconds) through the public API and real
processes: clients that connect, lease, put and go (cleanly, cut off with a reset, mid-frame),
namespaces opened and closed, Redis restarted and its masters moved, writes Redis refuses
under a steady fault. Growth is measured by comparing what a process holds (file descriptors,
threads, mappings, shared-memory files, internal tables, log records) after N and after 2N
iterations, with margins no scheduling can flake: a leak grows with N, a bounded table does
not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import pytest
import torch

from kvstore.tiers.remote.local_server import redis_server_path

needs_redis = pytest.mark.skipif(redis_server_path() is None,
                                 reason="redis-server is not installed (tools/ci_redis.sh)")


class _Records(logging.Handler):
    """Every record of one logger, kept (the test reads how many a fault wrote)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= level]


@contextlib.contextmanager
def recorded(name: str):
    lg = logging.getLogger(name)
    h = _Records()
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    try:
        yield h
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)


# -- the Redis tier under a steady fault: writes refused -----------------------------------------

@needs_redis
def test_writes_redis_refuses_for_hours_log_a_line_per_interval_not_per_block():
    """Redis at ``maxmemory`` with ``noeviction`` (or a replica turned read-only by a failover)
    refuses every SET: every block the writer pushes is refused, for as long as nobody fixes
    it. Each refused block logged its own WARNING (``write of <key> refused: OOM ...``): 160
    lines for 160 blocks, thousands a second under load. Now the first refusal is logged, then
    at most one line per interval saying how many more were refused; the counter
    (``write_failures``) still counts every block."""
    from kvstore.tiers.remote import RemoteConfig, RemoteTier, RemoteWrite
    from kvstore.tiers.remote.local_server import RedisProcess

    ns = b"n" * 32
    data = torch.zeros(4096, dtype=torch.uint8)
    with RedisProcess() as r, recorded("kvstore.remote") as log:
        r.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
        r.cli("CONFIG", "SET", "maxmemory", "1")  # used memory is past it: every SET refused
        with RemoteTier(RemoteConfig(r.url, budget_s=1.0, codec="none")) as t:
            def burst(n: int) -> int:
                for _ in range(n):
                    assert t.write_blocks([RemoteWrite(os.urandom(32), ns, data, 2)
                                           for _ in range(8)]) == 0
                return len(log.at(logging.WARNING))

            first = burst(20)
            second = burst(20)
            assert t.stats().write_failures == 320
    assert 1 <= first <= 2 and second == first, (first, second)
    assert "maxmemory" in log.at(logging.WARNING)[0].getMessage()


# -- a store under put/flush churn: the disk index's file ----------------------------------------

_DIES_READING = r"""
import lmdb, os, signal, sys
env = lmdb.open(sys.argv[1], max_readers=1024, max_dbs=16)  # kvstore's own settings
txn = env.begin()  # a read transaction: one reader slot, at the index's current txn...
txn.stat(env.open_db(b"blocks", txn=txn, create=False))
os.kill(os.getpid(), signal.SIGKILL)  # ...kept by a process that died with it
"""


def test_the_index_file_stays_bounded_under_put_and_flush_churn(tmp_path, monkeypatch):
    """A store whose disk budget holds ~500 blocks, each put of 8 new blocks flushed (what an
    engine that flushes per request does for months): the index holds ~500 records and the
    segments stay within the budget, but ``index/data.mdb`` grew ~100 pages (400 KiB) per 300
    puts, to 10.5 MiB after 8,000 puts. Two causes:

    - the tombstones database (``kvstore explain``'s trace of the blocks that left the index)
      filling to its fixed bound, 65,536 traces at one page per ~27 evictions: ~2,630 pages
      (10.3 MiB) from ~8,200 puts on, then no more (2,633 pages at 10,000 puts, 2,658 at
      24,000). Bounded, so no leak: here its bound is 128 so that it fills in the warm-up;
    - a process killed -9 inside a read transaction of the index (an engine's lookup): LMDB
      counted its reader slot as a live reader as old as that transaction, so no page freed
      after it was ever reused, and every commit grew the file (~50 pages per put+flush:
      8,168 pages over these 160 puts) for as long as the store ran. Now each write
      transaction first clears the slots of dead processes: 2 pages."""
    import subprocess
    import sys

    from support.attacks import LAY, T, attack_store

    from kvstore.tiers.disk import tombstones

    monkeypatch.setattr(tombstones, "GENERATION", 128)
    kv = torch.zeros(LAY.batch_shape(8), dtype=LAY.dtype)
    data = tmp_path / "st" / "index" / "data.mdb"
    sizes = []
    with attack_store(tmp_path / "st", model="round12/lmdb", warm=64, disk="256KiB") as s:
        i = 0
        for _ in range(4):
            for _ in range(80):
                i += 1
                s.put(s.block_keys([i * 1000 + x for x in range(8 * T)]), kv).wait()
                s.flush()
            sizes.append(data.stat().st_size)
            if len(sizes) == 2:  # warmed up: an engine dies inside a read of the index
                subprocess.run([sys.executable, "-c", _DIES_READING, str(data.parent)],
                               check=False, timeout=60)
    assert sizes[3] - sizes[1] <= 16 * 4096, sizes


# -- a Redis Cluster whose masters move for months -----------------------------------------------

class _SlotsServer:
    """A cluster's startup node as far as the tier asks it: answers ``CLUSTER SLOTS`` with
    every slot on the master at ``self.master`` (a port), ``HELLO`` with an error (RESP2),
    anything else with ``+OK``. Moving
    ``master`` is a failover or a rescheduled pod: the same slots, a new address."""

    def __init__(self, master: int) -> None:
        import socket
        import threading

        self.master = master
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import threading

        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(c,), daemon=True).start()

    def _answer(self, c) -> None:
        c.settimeout(5)
        f = c.makefile("rb")
        with contextlib.suppress(OSError, ValueError), c, f:
            while True:
                head = f.readline()
                if not head.startswith(b"*"):
                    return
                args = []
                for _ in range(int(head[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:n])
                if [a.upper() for a in args[:2]] == [b"CLUSTER", b"SLOTS"]:
                    host = b"127.0.0.1"
                    c.sendall(b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n"
                              % (len(host), host, self.master))
                elif args[:1] == [b"HELLO"]:  # RESP2 only: redis-py falls back to it
                    c.sendall(b"-ERR unknown command 'HELLO'\r\n")
                else:
                    c.sendall(b"+OK\r\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@needs_redis
def test_a_cluster_whose_masters_move_keeps_only_its_current_nodes(tmp_path):
    """Redis Cluster masters change address over months (failovers to a replica, pods
    rescheduled with new IPs). The tier made a ``Node`` (two connection pools, a breaker) for
    every address the slot table ever named and never let one go: one more per move, each
    old one counted down forever, so ``stats()`` said ``available=False`` (and ``nodes_down``
    = every move so far) on a healthy cluster. Now a slot-table read keeps the masters it
    names (and closes the rest): after 3 or 6 moves, one node, none down."""
    from kvstore.tiers.remote import RemoteConfig, RemoteTier, RemoteWrite
    from kvstore.tiers.remote.local_server import RedisProcess

    ns = b"n" * 32
    data = torch.zeros(256, dtype=torch.uint8)
    keys = [bytes([i]) * 32 for i in range(8)]
    first = RedisProcess(workdir=str(tmp_path)).start()
    procs = [first]
    slots = _SlotsServer(first.port)
    tier = RemoteTier(RemoteConfig(f"redis+cluster://127.0.0.1:{slots.port}", budget_s=0.5,
                                   backoff_s=0.01, backoff_max_s=0.02))
    try:
        def move(times: int):
            for _ in range(times):
                new = RedisProcess(workdir=str(tmp_path)).start()
                slots.master = new.port
                procs[-1].cleanup()
                procs.append(new)
                deadline = time.monotonic() + 10
                while tier.write_blocks([RemoteWrite(k, ns, data, 1) for k in keys]) != 8:
                    assert time.monotonic() < deadline, "the moved master was not found"
                    time.sleep(0.02)
            st = tier.stats()
            return st.nodes, st.nodes_down, st.available

        assert tier.write_blocks([RemoteWrite(k, ns, data, 1) for k in keys]) == 8
        after3 = move(3)
        after6 = move(3)
        assert tier.leading_run(keys) == 8
    finally:
        tier.close()
        slots.close()
        for p in procs:
            p.cleanup()
    assert after3 == after6 == (1, 0, True), (after3, after6)


# -- the daemon under a steady fault: a client it refuses, retrying for months -------------------

def test_a_refused_client_retrying_for_months_is_logged_per_interval_not_per_connect(serve):
    """An engine whose uid the daemon does not allow (a changed service user, a missing
    ``--allow-uid``) retries with backoff for as long as it runs: every attempt wrote a
    WARNING (``refused pid P uid U: not in the allow-list``), some 17,000 lines a day per
    engine at the 5 s backoff, more from a process that retries without one. Now the first
    is logged, then at most one line per interval with how many were refused since; every
    attempt is still refused (and counted in ``kvstore_connections_refused_total``)."""
    from kvstore.wire import messages as m
    from kvstore.wire.channel import Channel
    from kvstore.wire.errors import PermissionDeniedError

    other = 4242 if os.getuid() != 4242 else 4243
    d = serve("--cpu-capacity", "64KiB", "--disk-capacity", "0", "--allow-uid", str(other))

    def refused(n: int) -> int:
        for _ in range(n):
            ch = Channel.connect(str(d.socket_path), 5)
            with pytest.raises(PermissionDeniedError):
                ch.call(m.Ping())
            ch.close()
        # the daemon logs before it answers: every refusal so far is in the log by now
        lines = d.log_path.read_text(errors="replace").splitlines()  # all of it
        return sum("refused" in line and "WARNING" in line for line in lines)

    first = refused(100)
    second = refused(100)
    assert 1 <= first <= 2 and second == first, (first, second)


# -- namespaces opened and closed for months, with KV events ---------------------------------------

def test_namespaces_that_come_and_go_leave_no_event_state_behind(tmp_path, monkeypatch):
    """A daemon with ``--kv-events`` whose clients open namespaces that come and go (per-uid
    tenants, LoRA adapters or revisions in the extras, more of them than
    ``--max-namespaces``): each closed namespace holding nothing any more (memory only, its
    warm tier cleared) kept its event mirror and sink in the publisher, and its id in the
    registry, forever: one more of each per namespace ever opened (20 after 20, 40 after 40).
    Now a closed namespace's mirror goes once it holds nothing, and the registry remembers
    a bounded number of ids (4,096; 8 here); a namespace opened again gets a fresh sink and
    is published as before."""
    import asyncio

    from kvstore import KVLayout
    from kvstore.daemon import namespaces
    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.events import DaemonEvents
    from kvstore.daemon.namespaces import NamespaceRegistry
    from kvstore.daemon.security import Limits
    from kvstore.events.config import EventsConfig
    from kvstore.namespace import Namespace

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
                   block_tokens=4)
    shm = tmp_path / "shm"
    shm.mkdir()
    cfg = DaemonConfig(tmp_path / "store", tmp_path / "s.sock", cpu_capacity=16 * lay.block_nbytes,
                       disk_capacity=0, limits=Limits(max_namespaces=2))
    events = DaemonEvents(EventsConfig(f"ipc://{tmp_path}/ev", heartbeat_s=0.05))
    pub = events.publisher
    monkeypatch.setattr(namespaces, "_SEEN_MAX", 8)

    async def run_blocking(fn, *args):
        return fn(*args)

    async def churn(reg, first: int, n: int) -> None:
        for j in range(first, first + n):
            ns = Namespace.create("round12/ns", lay, extras={"adapter": str(j)})
            entry = await reg.acquire(ns, None, "client")
            keys = entry.store.block_keys(list(range(8)))
            entry.store.put(keys, torch.zeros(lay.batch_shape(2), dtype=lay.dtype)).wait()
            await reg.release(entry, "client")

    async def main():
        reg = NamespaceRegistry(cfg, shm, run_blocking, events)
        try:
            await churn(reg, 0, 20)
            assert pub.flush(10)
            after20 = len(pub._mirrors), len(pub._sinks), len(reg._seen)
            await churn(reg, 20, 20)
            assert pub.flush(10)
            after40 = len(pub._mirrors), len(pub._sinks), len(reg._seen)
            await churn(reg, 0, 1)  # an old one again: announced as before
            assert pub.flush(10)
            return after20, after40, pub.stats().blocks
        finally:
            await reg.close_all()

    try:
        after20, after40, blocks = asyncio.run(main())
    finally:
        events.close()
    assert after40 == after20, (after20, after40)
    assert after40[0] <= 3 and after40[2] <= 8, after40  # the open ones (2), the last 8 seen
    assert blocks == 2 + 2  # the warm blocks of the 2 open ones: the last new one, the reopened


# -- what held: clients that come and go by the thousand -------------------------------------------

def test_clients_that_lease_put_pin_and_vanish_leave_the_daemon_as_it_was(serve):
    """Held (no fix needed): connections that say hello, take a lease, a granted put and pins,
    then go (closed cleanly, reset, cut off mid-frame), 200 then 200 more. The daemon's open
    files, threads, memory mappings and shared-memory files are the same after 400 as after
    200; no lease, grant or pin is left and every warm slot is free or holding a block."""
    import glob
    import socket
    import struct

    from kvstore import KVLayout, connect
    from kvstore.keys import block_keys
    from kvstore.wire import messages as m
    from kvstore.wire.channel import Channel
    from kvstore.wire.codec import pack
    from kvstore.wire.framing import encode_frame
    from kvstore.wire.protocol import make_hello

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                   block_tokens=4)
    d = serve("--cpu-capacity", "64KiB", "--disk-capacity", "0")
    c = connect(d.socket_path, layout=lay, model_id="round12/churn", device="cpu")
    held = c.block_keys(list(range(32)))
    assert c.put(held, torch.zeros(lay.batch_shape(8), dtype=lay.dtype)).wait() == 8
    blob = b"".join(held)
    hello = make_hello(lay, "round12/churn", client="churn")

    def held_by_daemon() -> tuple[int, ...]:
        pid = d.pid
        return (len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task")),
                sum(1 for _ in open(f"/proc/{pid}/maps")),
                len(glob.glob(f"/dev/shm/kvstore-serve-{pid}-*/*")))

    def churn(first: int, n: int) -> None:
        for i in range(first, first + n):
            ch = Channel.connect(str(d.socket_path), 10)
            ns = ch.call(hello).namespace_id
            assert ch.call(m.Fetch(blob, None)).slots  # a lease, never released
            new = block_keys(ns, list(range(10_000 + 8 * i, 10_008 + 8 * i)), 4)
            ch.call(m.Put(b"".join(new), None))  # a grant, never committed
            ch.call(m.Pin(blob, None))
            if i % 3 == 1:  # reset: SO_LINGER 0
                ch._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif i % 3 == 2:  # half a frame, then gone
                body = pack(m.encode_request(99, m.Lookup(blob, None)))
                ch._sock.sendall(encode_frame(body)[: len(body) // 2])
            ch.close()

    def settled() -> tuple[int, ...]:
        deadline = time.monotonic() + 20
        while True:
            srv = c.server_stats()
            if (srv.leases, srv.grants, srv.pinned_blocks, srv.connections) == (0, 0, 0, 1) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (srv.leases, srv.grants, srv.pinned_blocks, srv.connections) == (0, 0, 0, 1)
        assert srv.free_warm_slots + c.stats().tier("warm").blocks == srv.warm_slots
        return held_by_daemon()

    churn(0, 200)
    after200 = settled()
    churn(200, 200)
    after400 = settled()
    c.close()
    fds, threads, maps, shm = after400
    assert fds == after200[0] and shm == after200[3] == 2, (after200, after400)
    assert threads <= after200[1] + 2 and maps <= after200[2] + 8, (after200, after400)


def test_new_namespaces_do_not_each_read_every_namespace_the_store_has(tmp_path, monkeypatch,
                                                                       caplog):
    """The daemon's "new namespace" note read every namespace record of the store for each
    namespace it had not opened before: a daemon whose namespaces churn (tenants, adapters)
    paid time in the number of stored namespaces on every new one (60 ms each at 600), so
    quadratic over its life. The list is now read once per minute at most, with the
    namespaces the daemon opens since added to it; the note still names a near miss."""
    import asyncio

    from kvstore import KVLayout
    from kvstore.daemon import namespaces
    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.security import Limits
    from kvstore.namespace import Namespace

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
                   block_tokens=4)
    shm = tmp_path / "shm"
    shm.mkdir()
    cfg = DaemonConfig(tmp_path / "store", tmp_path / "s.sock", cpu_capacity=16 * lay.block_nbytes,
                       disk_capacity=1 << 20, limits=Limits(max_namespaces=4))
    reads = []
    real = namespaces._stored_namespaces
    monkeypatch.setattr(namespaces, "_stored_namespaces",
                        lambda c: reads.append(1) or real(c))

    async def run_blocking(fn, *args):
        return fn(*args)

    async def main():
        reg = namespaces.NamespaceRegistry(cfg, shm, run_blocking)
        try:
            for j in range(12):
                ns = Namespace.create("org/Model-8B", lay, extras={"adapter": str(j)})
                entry = await reg.acquire(ns, None, "client")
                await reg.release(entry, "client")
            typo = Namespace.create("org/Model-8b", lay, extras={"adapter": "3"})
            await reg.release(await reg.acquire(typo, None, "client"), "client")
        finally:
            await reg.close_all()

    with caplog.at_level(logging.INFO, logger="kvstore"):
        asyncio.run(main())
    assert len(reads) == 1  # 13 new namespaces, one read of the store's list
    notes = [r.getMessage() for r in caplog.records if "new namespace" in r.getMessage()]
    assert len(notes) == 13
    assert "differing in one field only" in notes[-1] and "org/Model-8B" in notes[-1]
