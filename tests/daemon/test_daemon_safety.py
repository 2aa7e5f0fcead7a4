"""The daemon under adversarial use (issue 13): flush after a restart, refused uids, one
daemon per store path, admin removals that reach the daemon's memory, tenants that try to
evict each other's blocks."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_until

from kvstore import KVLayout, connect
from kvstore.admin.live import DaemonUnavailableError, daemon_remove, serving_daemon
from kvstore.errors import PutsLostError
from kvstore.lockfile import LOCK_NAME, read_daemon_lock
from kvstore.wire import messages as m
from kvstore.wire.channel import Channel
from kvstore.wire.codec import pack
from kvstore.wire.framing import send_frame
from kvstore.wire.messages import ErrorCode, PermissionDeniedError, ServerError
from kvstore.wire.protocol import make_hello

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_tokens=4)
DISK = ("--cpu-capacity", "1MiB", "--disk-capacity", "16MiB")
MEMORY = ("--cpu-capacity", "1MiB", "--disk-capacity", "0")
NOBODY = 65534

needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="needs root to run a child as another uid")


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.batch_shape(n), generator=g).to(LAYOUT.dtype)


def _client(d, model_id="m"):
    return connect(d.socket_path, layout=LAYOUT, model_id=model_id, device="cpu", timeout=10)


def _disk_blocks(path, namespace_id: bytes) -> int:
    from kvstore.admin.common import open_disk

    with open_disk(path, readonly=True) as t:
        return sum(1 for _ in t.records(namespace_id))


@pytest.fixture
def open_sock_dir():
    """A socket directory other uids can reach (``0755``, outside pytest's ``0700`` tmp)."""
    d = Path(tempfile.mkdtemp(prefix="kvstore-safety-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_uid(uid: int, fn):
    """``fn()`` in a forked child running as ``uid``; returns what it returned (JSON)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:  # reported to the parent
            out = {"crash": repr(e)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b'{"crash": "no result"}')


# -- 7: flush after a daemon restart -------------------------------------------------------
def test_flush_after_a_killed_daemon_restarts_reports_the_lost_puts(serve):
    d = serve(*DISK)
    c = _client(d)
    keys = c.block_keys(list(range(192)))
    assert c.put(keys, _kv(48)).wait() == 48
    d.kill()  # before anything was flushed
    d2 = serve(*DISK)
    assert wait_until(c.ping)  # the same client reconnected, to another daemon instance
    with pytest.raises(PutsLostError, match=r"48 block\(s\) put since the last flush may be "
                       r"lost: .*restarted without a clean stop") as e:
        c.flush()
    assert e.value.blocks == 48
    c.flush()  # told once: those puts are not reported again
    more = c.block_keys(list(range(16)), salt="later")
    assert c.put(more, _kv(4)).wait() == 4
    c.flush()  # puts to the new instance are flushed normally
    c.close()
    assert d2.stop() == 0


def test_flush_while_the_daemon_is_down_cannot_vouch_for_puts(serve):
    d = serve(*DISK)
    c = _client(d)
    keys = c.block_keys(list(range(16)))
    assert c.put(keys, _kv(4)).wait() == 4
    d.kill()
    with pytest.raises(PutsLostError, match=r"4 block\(s\) .* not confirmed on disk: no kvstore "
                       "daemon answers") as e:
        c.flush()
    assert e.value.blocks == 4
    serve(*DISK)
    assert wait_until(c.ping)
    with pytest.raises(PutsLostError, match="may be lost"):  # and now it is known
        c.flush()
    c.flush()
    c.close()


def test_flush_vouches_for_puts_after_a_reconnect_or_a_clean_restart(serve):
    d = serve(*DISK)
    c = _client(d)
    keys = c.block_keys(list(range(32)))
    kv = _kv(8)
    assert c.put(keys[:4], kv[:4]).wait() == 4
    c._session.channel.close()  # the connection drops; the daemon (and the puts) stay
    assert wait_until(c.ping)
    c.flush()
    assert c.put(keys[4:], kv[4:]).wait() == 4
    assert d.stop() == 0  # SIGTERM: flushed on the way out
    d2 = serve(*DISK)
    assert wait_until(c.ping)
    c.flush()  # the earlier daemon stopped clean: the puts are durable
    assert c.lookup(keys) == 8 and torch.equal(c.fetch(keys).wait(), kv)
    assert d2.stop() == 0
    serve(*DISK)  # two clean restarts while the client held nothing un-flushed
    assert wait_until(c.ping)
    c.flush()
    c.close()


def test_a_clean_stop_of_a_memory_only_daemon_keeps_nothing(serve):
    d = serve(*MEMORY)
    c = _client(d)
    keys = c.block_keys(list(range(16)))
    assert c.put(keys, _kv(4)).wait() == 4
    assert d.stop() == 0
    serve(*MEMORY)
    assert wait_until(c.ping)
    with pytest.raises(PutsLostError):  # no disk: a clean stop does not make them durable
        c.flush()
    assert c.lookup(keys) == 0
    c.close()


def test_hello_reply_of_an_older_daemon_and_of_a_newer_one_parse():
    base = [1, b"n" * 32, "/dev/shm/x", 8, 1024, 1 << 20, 100, 10, "kvstore"]
    old = m.HelloReply.from_wire(base)
    assert old.instance == b"" and old.flushed_instances == ()
    assert old.new_namespace == ""
    new = m.HelloReply.from_wire([*base, b"i" * 16, [b"p" * 16], "new namespace ab12",
                                  "a later field"])
    assert new.instance == b"i" * 16 and new.flushed_instances == (b"p" * 16,)
    assert new.new_namespace == "new namespace ab12"
    assert m.HelloReply.from_wire(new.to_wire()[:12]) == new
    with pytest.raises(m.BadRequest):
        m.HelloReply.from_wire([*base, b"i" * 16, [], 7])  # new_namespace must be a str
    with pytest.raises(m.BadRequest):
        m.HelloReply.from_wire(base[:8])


# -- 8: a refused uid always hears why --------------------------------------------------------
def test_refusal_sent_before_the_hello_was_read_reaches_the_client(tmp_path):
    """The daemon answered NOT_ALLOWED and hung up before our hello left: sending it fails
    with EPIPE, and the refusal waiting in the socket is still what the caller gets."""
    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    ch = Channel.connect(path, 5)
    conn, _ = srv.accept()
    send_frame(conn, pack(m.encode_error(0, ErrorCode.NOT_ALLOWED, "uid 65534 is not allowed")))
    conn.close()
    srv.close()
    with pytest.raises(PermissionDeniedError, match="uid 65534 is not allowed"):
        ch.call(make_hello(LAYOUT, "m"))
    assert ch.broken


@needs_root
def test_a_refused_uid_always_gets_permission_denied(serve, open_sock_dir):
    d = serve(*MEMORY, socket=open_sock_dir / "kvstore.sock")
    os.chmod(d.socket_path, 0o666)  # loosened by hand: the uid allow-list still refuses

    def attempts():
        out = {"denied": 0, "slow_denied": 0, "other": []}
        for _ in range(60):
            try:
                c = connect(d.socket_path, layout=LAYOUT, model_id="m", device="cpu", timeout=10)
            except PermissionDeniedError as e:
                out["denied"] += "is not allowed" in str(e)
            else:
                out["other"].append(repr(c))
                c.close()
        for _ in range(3):  # a client slow to say hello: the refusal went out long before
            ch = Channel.connect(str(d.socket_path), 10)
            time.sleep(0.2)
            try:
                ch.call(make_hello(LAYOUT, "m"))
            except PermissionDeniedError:
                out["slow_denied"] += 1
            except Exception as e:  # reported
                out["other"].append(repr(e))
            ch.close()
        return out

    res = _as_uid(NOBODY, attempts)
    assert res.get("denied") == 60 and res.get("slow_denied") == 3, res
    assert "refused pid" in d.log()


# -- 12: one daemon per store path ---------------------------------------------------------
def test_a_second_daemon_on_the_same_path_is_refused(serve, tmp_path):
    d = serve(*DISK)
    lock = tmp_path / "store" / LOCK_NAME
    rec = read_daemon_lock(tmp_path / "store")
    assert rec is not None and rec.socket == str(d.socket_path) and rec.pid == d.pid
    assert serving_daemon(tmp_path / "store") == str(d.socket_path)
    other = tmp_path / "run2" / "kvstore.sock"
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--path",
                        str(tmp_path / "store"), "--socket", str(other), *DISK],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and str(d.socket_path) in lines[0], p.stderr
    assert "already served" in lines[0] and f"pid {d.pid}" in lines[0], p.stderr
    assert not other.exists()
    with _client(d) as c:  # the first daemon never noticed
        keys = c.block_keys(list(range(8)))
        assert c.put(keys, _kv(2)).wait() == 2
    assert d.stop() == 0, d.log()
    assert lock.exists()
    assert serving_daemon(tmp_path / "store") is None, lock.read_text()  # the lock is gone
    d2 = serve(*DISK, socket=other)  # now it may
    assert serving_daemon(tmp_path / "store") == str(other), lock.read_text()
    d2.kill()  # a killed daemon's lock goes with it
    assert serving_daemon(tmp_path / "store") is None, lock.read_text()
    assert serving_daemon(tmp_path / "nowhere") is None


# -- 10: admin removals reach the daemon's memory ----------------------------------------------
def test_remove_through_the_daemon_clears_warm_and_disk(serve, tmp_path):
    d = serve(*DISK)
    store = tmp_path / "store"
    sock = serving_daemon(store)
    assert sock == str(d.socket_path)
    c = _client(d)
    keys = c.block_keys(list(range(32)))
    assert c.put(keys, _kv(8)).wait() == 8  # warm and dirty: not on disk yet
    assert daemon_remove(sock, c.namespace_id) == 8
    assert c.lookup(keys) == 0 and c.fetch(keys).wait().shape[0] == 0
    c.flush()  # nothing dirty is written back after the removal
    assert c.lookup(keys) == 0 and _disk_blocks(store, c.namespace_id) == 0

    assert c.put(keys, _kv(8)).wait() == 8
    c.flush()
    assert _disk_blocks(store, c.namespace_id) == 8
    leaves_first = [bytes(k) for k in reversed(keys[4:])]
    assert daemon_remove(sock, c.namespace_id.hex(), [k.hex() for k in leaves_first]) == 4
    assert c.lookup(keys) == 4 and _disk_blocks(store, c.namespace_id) == 4
    assert daemon_remove(sock, c.namespace_id, []) == 0

    # removal is an admin connection's: on a connection that said hello it is refused
    with pytest.raises(ServerError, match="admin operation") as e:
        c._session.channel.call(m.Remove(c.namespace_id, None))
    assert e.value.code == ErrorCode.BAD_REQUEST
    nsid = c.namespace_id
    c.close()

    # a namespace the daemon does not have open: its disk blocks go all the same
    assert d.stop() == 0
    d = serve(*DISK)
    other = _client(d, "other")  # keeps a store of another namespace open on that disk
    okeys = other.block_keys(list(range(8)))
    assert other.put(okeys, _kv(2)).wait() == 2
    other.flush()
    assert daemon_remove(d.socket_path, nsid, [bytes(okeys[1]), bytes(keys[0])]) == 1
    assert other.lookup(okeys) == 2  # keys of another namespace are not the named one's
    assert daemon_remove(d.socket_path, nsid) == 3
    assert _disk_blocks(store, nsid) == 0
    with _client(d) as c:
        assert c.lookup(keys) == 0
    assert other.lookup(okeys) == 2
    other.close()


def test_remove_through_a_memory_only_daemon_clears_the_shared_disk_too(serve, tmp_path):
    from kvstore import open_store

    store = tmp_path / "store"
    d = serve(*MEMORY)
    emb = open_store(store, layout=LAYOUT, model_id="m", device="cpu", gpu_capacity=0,
                     cpu_capacity="1MiB", disk_capacity="16MiB")  # an embedded writer beside it
    c = _client(d)
    keys = emb.block_keys(list(range(16)))
    assert c.namespace_id == emb.namespace_id
    assert emb.put(keys, _kv(4)).wait() == 4
    emb.flush()
    emb.evict(tier="warm")  # the embedded store's own memory is not the daemon's business
    assert c.put(keys, _kv(4)).wait() == 4
    assert daemon_remove(d.socket_path, c.namespace_id) >= 4
    assert c.lookup(keys) == 0 and emb.lookup(keys) == 0
    emb.close()
    c.close()


def test_remove_without_a_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(DaemonUnavailableError, match="no daemon answers"):
        daemon_remove(tmp_path / "none.sock", b"n" * 32)


@needs_root
def test_remove_is_refused_to_tenants(serve, open_sock_dir):
    d = serve(*DISK, "--allow-uid", "0", "--allow-uid", str(NOBODY),
              socket=open_sock_dir / "kvstore.sock")
    os.chmod(d.socket_path, 0o666)
    c = _client(d)
    keys = c.block_keys(list(range(16)))
    assert c.put(keys, _kv(4)).wait() == 4
    nsid = c.namespace_id

    def tenant():
        try:
            return {"removed": daemon_remove(d.socket_path, nsid)}
        except DaemonUnavailableError as e:
            return {"refused": str(e)}

    res = _as_uid(NOBODY, tenant)
    assert "admin operation" in res.get("refused", ""), res
    assert c.lookup(keys) == 4
    c.close()


# -- 5: a namespace cannot evict another's blocks ----------------------------------------------
def test_another_namespace_cannot_evict_a_tenants_blocks(serve):
    d = serve(*DISK)
    victim = _client(d, "victim")
    attacker = _client(d, "attacker")
    keys = victim.block_keys(list(range(32)))
    kv = _kv(8, seed=5)
    assert victim.put(keys, kv).wait() == 8
    victim.flush()
    stolen = [bytes(k) for k in keys]  # plain bytes: no namespace attached
    assert attacker.lookup(stolen) == 0 and attacker.fetch(stolen).wait().shape[0] == 0
    assert len(attacker.pin(stolen)) == 0 and attacker.unpin(stolen) == 0
    for tier in (None, "warm", "disk", "hot"):
        assert attacker.evict(stolen, tier=tier) == 0, tier
    assert attacker.evict() == 0  # "all of mine" is none of the victim's
    assert victim.lookup(keys) == 8
    victim.evict(tier="warm")  # its own warm copies go: only the disk copies are left
    assert victim.stats().tier("warm").blocks == 0
    assert victim.lookup(keys) == 8
    assert torch.equal(victim.fetch(keys).wait(), kv)
    for c in (victim, attacker):
        c.close()



def test_unexpected_request_failures_are_logged_once_a_minute_per_kind(monkeypatch, caplog):
    """A fault that hits every request (a disk answering EIO) logged a traceback per request:
    thousands of lines a second until the log filled its disk. Now the first failure of each
    kind has its traceback, the next ones are counted into one line a minute per kind."""
    import logging

    from kvstore import ratelog
    from kvstore.daemon import connection

    now = [1000.0]
    monkeypatch.setattr(ratelog.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(connection, "_FAILURES", ratelog.Every(60.0))

    def fail(op, exc):
        try:
            raise exc
        except Exception as e:
            connection.log_failure("request", op, e)

    with caplog.at_level(logging.ERROR, logger="kvstore.daemon"):
        for _ in range(500):
            fail("fetch", OSError(5, "Input/output error"))
        fail("put", OSError(5, "Input/output error"))  # another kind: its own first line
        fail("fetch", ValueError("x"))  # another exception type: too
        assert len(caplog.records) == 3
        assert all(r.exc_info for r in caplog.records)
        assert "(1 such failure(s)" in caplog.records[0].getMessage()
        now[0] += 61
        fail("fetch", OSError(5, "Input/output error"))
    assert len(caplog.records) == 4
    assert "request fetch failed (500 such failure(s) since the last such line)" \
        in caplog.records[-1].getMessage()
