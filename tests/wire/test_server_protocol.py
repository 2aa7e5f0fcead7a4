"""The wire protocol: framing, bounded decoding, typed messages, and a daemon that survives
whatever bytes a client sends (checked against a live ``kvstore serve``)."""

import asyncio
import os
import socket
import struct
import threading
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import KVLayout, connect
from kvstore.wire import messages as m
from kvstore.wire import protocol
from kvstore.wire.channel import Channel, ChannelClosed
from kvstore.wire.codec import CodecError, CodecLimits, pack, unpack
from kvstore.wire.framing import (
    FrameError,
    FrameReader,
    FrameTooLarge,
    encode_frame,
    read_frame,
    recv_frame,
)
from kvstore.wire.messages import ErrorCode, PermissionDeniedError, ProtocolVersionError

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_tokens=4)


# -- framing and codec (no daemon) -----------------------------------------------------------
def test_frame_cap_is_checked_before_the_body_is_read():
    async def go():
        r = asyncio.StreamReader()
        r.feed_data(struct.pack(">I", 1 << 30))  # announces 1 GiB, sends nothing more
        with pytest.raises(FrameTooLarge) as e:
            await read_frame(r, 1024)
        assert e.value.size == 1 << 30 and e.value.cap == 1024
        r = asyncio.StreamReader()
        r.feed_data(encode_frame(b"abc") + b"\x00\x00")
        r.feed_eof()
        assert await read_frame(r, 1024) == b"abc"
        with pytest.raises(FrameError, match="header"):
            await read_frame(r, 1024)
        r = asyncio.StreamReader()
        r.feed_data(struct.pack(">I", 0))
        with pytest.raises(FrameError, match="empty"):
            await read_frame(r, 1024)
        r = asyncio.StreamReader()
        r.feed_eof()
        assert await read_frame(r, 1024) is None

    asyncio.run(go())


def test_blocking_frames_round_trip():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_frame(b"x" * 5000) + struct.pack(">I", 99999))
        assert recv_frame(b, 1 << 20) == b"x" * 5000
        with pytest.raises(FrameTooLarge):
            recv_frame(b, 1000)


@given(st.lists(st.binary(min_size=1, max_size=3000), min_size=1, max_size=12),
       st.lists(st.integers(1, 7000), min_size=1, max_size=30))
@settings(max_examples=60, deadline=None)
def test_frame_reader_any_split(bodies, cuts):
    """Frames arrive cut at any byte boundaries; the buffered reader returns them whole."""
    stream = b"".join(encode_frame(b) for b in bodies)
    a, b = socket.socketpair()
    with a, b:
        r = FrameReader(b, size=1024)  # small, so frames straddle and outgrow the buffer

        def feed():
            off, i = 0, 0
            while off < len(stream):
                n = cuts[i % len(cuts)]
                a.sendall(stream[off : off + n])
                off += n
                i += 1
            a.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=feed)
        t.start()
        got = [r.read(1 << 20) for _ in bodies]
        assert r.read(1 << 20) is None  # clean close between frames
        t.join()
    assert got == bodies
    assert r.capacity == 1024  # a frame bigger than the buffer did not leave it grown


def test_frame_reader_errors():
    a, b = socket.socketpair()
    with a, b:
        r = FrameReader(b)
        a.sendall(encode_frame(b"ok") + struct.pack(">I", 99999))
        assert r.read(1000) == b"ok"
        with pytest.raises(FrameTooLarge):
            r.read(1000)
    for tail in (b"\x00\x00", struct.pack(">I", 10) + b"abc"):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(tail)
            a.shutdown(socket.SHUT_WR)
            with pytest.raises(FrameError, match="closed inside a frame"):
                FrameReader(b).read(1000)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 0))
        with pytest.raises(FrameError, match="empty"):
            FrameReader(b).read(1000)


def test_channel_times_out_on_a_silent_peer():
    """The kernel-enforced receive limit (SO_RCVTIMEO) ends a call to a peer that never
    answers; the channel is then broken, and timeout=None would wait."""
    a, b = socket.socketpair()
    with a, b:
        ch = Channel(b, timeout=0.2)
        t0 = time.monotonic()
        with pytest.raises(ChannelClosed):
            ch.call(m.Lookup(b"k" * 32, None))
        assert 0.15 < time.monotonic() - t0 < 5
        assert ch.broken
        assert len(a.recv(1 << 16)) > 4  # the request did go out
    a, b = socket.socketpair()
    with a, b:
        ch = Channel(b, timeout=0.05)

        def answer_late():
            time.sleep(0.3)
            body = recv_frame(a, 1 << 20)
            rid = unpack(body, CodecLimits.for_frames(1 << 20, 16))[1]
            a.sendall(encode_frame(pack(m.encode_reply(rid, m.Count(1)))))

        t = threading.Thread(target=answer_late)
        t.start()
        assert ch.call(m.Lookup(b"k" * 32, None), timeout=None).n == 1  # waits past 0.05 s
        t.join()
        with pytest.raises(ChannelClosed):  # and the default limit is back
            ch.call(m.Lookup(b"k" * 32, None))


def test_codec_bounds_and_plain_data_only():
    lim = CodecLimits(max_buffer=1 << 16, max_bin=64, max_array=8, max_map=2, max_str=16)
    assert unpack(pack(["a", 1, b"k" * 32, None, {"x": 1.5}]), lim) == ["a", 1, b"k" * 32, None, {"x": 1.5}]
    for bad in (pack(list(range(9))), pack(b"k" * 65), pack({"a": 1, "b": 2, "c": 3}), pack("s" * 17),
                pack([1]) + b"\x01", pack([1, 2])[:-1], b"\xc1", msgpack.packb(msgpack.ExtType(1, b"x")),
                msgpack.packb({1: 2})):  # non-str map keys: strict_map_key
        with pytest.raises(CodecError):
            unpack(bad, lim)
    with pytest.raises(CodecError):
        pack(object())  # no pickle fallback for anything


def test_messages_round_trip():
    keys = os.urandom(64)
    hello = protocol.make_hello(LAYOUT, "m", model_revision="r1", tp_rank=1, tp_size=2,
                                namespace_extras={"adapter": "lora-1", "n": 3}, warm_capacity=4096)
    for req in (hello, m.Lookup(keys, None), m.Fetch(keys, keys[:32]), m.Put(keys, None),
                m.Prefetch(keys), m.Pin(keys), m.Unpin(keys), m.Release(7), m.Commit(8), m.Abort(9),
                m.Evict(None, "warm"), m.Evict(keys, None), m.Stats(), m.Flush(2.5), m.Ping()):
        wire = unpack(pack(m.encode_request(5, req)), CodecLimits.for_frames(1 << 20, 1024))
        rid, op, args = m.decode_envelope(wire)
        assert rid == 5 and m.parse_request(op, args) == req
    for reply in (m.Count(3), m.Lease(2, [5, 6, 9]), m.Grant(1, [0, 2], [7, 8], 1), m.Empty(),
                  m.StatsReply(_stats(), m.ServerStats(leases=2, free_warm_slots=9))):
        rid, status, body = m.decode_reply(unpack(pack(m.encode_reply(4, reply)),
                                                  CodecLimits.for_frames(1 << 20, 1024)))
        assert (rid, status) == (4, m.OK) and type(reply).from_wire(body) == reply


def _stats():
    from kvstore.stats import StoreStats, TierStats

    return StoreStats(*range(17), tiers=(TierStats("warm", "cpu", 10, 5, 1, 0, 0, 2),))


@pytest.mark.parametrize("args, code", [
    ([b"x" * 31, None], ErrorCode.BAD_REQUEST),  # not whole keys
    ([b"x" * 32], ErrorCode.BAD_REQUEST),  # wrong arity
    ([b"x" * 32, b"short"], ErrorCode.BAD_REQUEST),
    (["keys", None], ErrorCode.BAD_REQUEST),
])
def test_bad_arguments_are_bad_requests(args, code):
    with pytest.raises(m.BadRequest) as e:
        m.parse_request("lookup", args)
    assert e.value.code == code
    with pytest.raises(m.BadRequest) as e:
        m.parse_request("nope", [])
    assert e.value.code == ErrorCode.UNKNOWN_OP
    with pytest.raises(m.BadRequest) as e:
        m.decode_envelope(["lookup", 0, []])  # request id 0 is reserved
    assert e.value.code == ErrorCode.BAD_FRAME


def test_namespace_is_derived_by_the_daemon():
    hello = protocol.make_hello(LAYOUT, "m")
    shared_a = protocol.derive_namespace(hello, 1000)
    assert shared_a.id == protocol.derive_namespace(hello, 2000).id  # shared: uid-blind
    per_uid = protocol.make_hello(LAYOUT, "m", salt_policy="per-uid")
    a, b = protocol.derive_namespace(per_uid, 1000), protocol.derive_namespace(per_uid, 2000)
    assert a.id != b.id != shared_a.id
    assert protocol.derive_namespace(hello, 1000, force_per_uid=True).id == a.id
    with pytest.raises(Exception, match="reserved"):
        protocol.make_hello(LAYOUT, "m", namespace_extras={"kvstore.tenant": "uid:0"})
    forged = m.Hello.from_wire([*hello.to_wire()[:6], {"kvstore.tenant": "uid:1000"}, *hello.to_wire()[7:]])
    with pytest.raises(m.BadRequest, match="reserved") as e:
        protocol.derive_namespace(forged, 2000)
    assert e.value.code == ErrorCode.CONFIG


# -- against a live daemon -------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from support.daemon import DaemonProcess

    d = tmp_path_factory.mktemp("proto")
    proc = DaemonProcess(d / "store", d / "run" / "kvstore.sock", "--cpu-capacity", "4MiB",
                         "--disk-capacity", "0", "--max-frame", "64KiB", "--max-keys", "512",
                         "--max-leases", "4")
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log()


def _raw(daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(daemon.socket_path))
    return s


def _call(s, op, rid, args):
    s.sendall(encode_frame(pack([op, rid, args])))
    body = recv_frame(s, 1 << 20)
    return None if body is None else unpack(body, CodecLimits.for_frames(1 << 20, 1 << 16))


def _hello(s, version=protocol.PROTOCOL_VERSION, model="proto"):
    args = protocol.make_hello(LAYOUT, model).to_wire()
    args[0] = version
    return _call(s, "hello", 1, args)


def _closed(s) -> bool:
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def test_oversized_frame_is_refused_and_the_connection_closed(daemon):
    with _raw(daemon) as s:
        assert _hello(s)[1] == m.OK
        s.sendall(struct.pack(">I", 1 << 31))  # no body follows: the daemon must not wait for it
        rid, status, (code, msg) = unpack(recv_frame(s, 1 << 20), CodecLimits.for_frames(1 << 20, 16))
        assert (rid, status, code) == (0, m.ERROR, ErrorCode.FRAME_TOO_LARGE) and "cap" in msg
        assert _closed(s)


def test_wrong_protocol_version_is_refused(daemon, monkeypatch):
    with _raw(daemon) as s:
        rid, status, (code, msg) = _hello(s, version=99)
        assert status == m.ERROR and code == ErrorCode.VERSION_MISMATCH
        assert "protocol version 99 is not supported" in msg and _closed(s)
    monkeypatch.setattr(protocol, "PROTOCOL_VERSION", protocol.PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolVersionError, match="this daemon speaks version"):
        connect(daemon.socket_path, layout=LAYOUT, model_id="proto", device="cpu")


def test_requests_before_hello_and_unknown_ops(daemon):
    with _raw(daemon) as s:
        rid, status, (code, _) = _call(s, "lookup", 3, [b"k" * 32, None])
        assert (rid, status, code) == (3, m.ERROR, ErrorCode.HELLO_REQUIRED) and _closed(s)
    with _raw(daemon) as s:
        assert _hello(s)[1] == m.OK
        assert _call(s, "frobnicate", 2, [])[2][0] == ErrorCode.UNKNOWN_OP
        assert _call(s, "lookup", 3, [b"k" * 33, None])[2][0] == ErrorCode.BAD_REQUEST
        assert _call(s, "lookup", 4, [b"k" * 32 * 513, None])[2][0] == ErrorCode.LIMIT
        assert _call(s, "release", 5, [12345])[2][0] == ErrorCode.UNKNOWN_ID
        assert _call(s, "hello", 6, _hello_args())[2][0] == ErrorCode.HELLO_REQUIRED
        s.sendall(encode_frame(b"\xc1garbage"))  # not msgpack: an error, the connection lives
        assert unpack(recv_frame(s, 1 << 20), CodecLimits.for_frames(1 << 20, 16))[2][0] == ErrorCode.BAD_FRAME
        assert _call(s, "ping", 7, []) == [7, m.OK, []]


def _hello_args():
    return protocol.make_hello(LAYOUT, "proto").to_wire()


def test_outstanding_leases_are_limited_per_connection(daemon):
    with connect(daemon.socket_path, layout=LAYOUT, model_id="leases", device="cpu") as c:
        keys = c.block_keys(list(range(8)))
        c.put(keys, torch.zeros(LAYOUT.batch_shape(2), dtype=LAYOUT.dtype)).wait()
    with _raw(daemon) as s:
        _hello(s, model="leases")
        for rid in range(2, 6):  # --max-leases 4
            assert _call(s, "fetch", rid, [b"".join(keys), None])[1] == m.OK
        assert _call(s, "fetch", 6, [b"".join(keys), None])[2][0] == ErrorCode.LIMIT
        assert _call(s, "put", 7, [os.urandom(32), None])[2][0] == ErrorCode.LIMIT
        assert _call(s, "release", 8, [1]) == [8, m.OK, []]
        assert _call(s, "fetch", 9, [b"".join(keys), None])[1] == m.OK


def _rss_and_fds(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


_ops = st.sampled_from(["hello", "lookup", "fetch", "release", "put", "commit", "abort", "prefetch",
                        "pin", "unpin", "evict", "stats", "flush", "ping", "x", ""])
_atoms = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                   st.binary(max_size=200), st.text(max_size=20),
                   st.binary(min_size=32, max_size=32), st.binary(min_size=64, max_size=64))
_values = st.recursive(_atoms, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                       max_leaves=12)
_envelopes = st.tuples(_ops, st.integers(-5, 2**64 - 1) | st.none(), _values).map(list)


def _frame_of(body_len_delta, body):
    return struct.pack(">I", max(0, len(body) + body_len_delta) % (1 << 32)) + body


@st.composite
def _garbage(draw):
    kind = draw(st.sampled_from(["raw", "frame", "envelope", "truncated", "huge"]))
    if kind == "raw":
        return draw(st.binary(max_size=300))
    if kind == "frame":
        return encode_frame(draw(st.binary(min_size=1, max_size=300)))
    if kind == "envelope":
        return encode_frame(msgpack.packb(draw(_envelopes), use_bin_type=True))
    if kind == "truncated":
        body = msgpack.packb(draw(_envelopes), use_bin_type=True)
        return _frame_of(draw(st.integers(1, 100)), body)  # announces more than it sends
    return struct.pack(">I", draw(st.integers(64 << 10, (1 << 32) - 1))) + draw(st.binary(max_size=50))


def test_fuzzed_frames_never_kill_the_daemon_or_leak(daemon):
    client = connect(daemon.socket_path, layout=LAYOUT, model_id="fuzz", device="cpu")
    keys = client.block_keys(list(range(16)))
    kv = torch.randn(LAYOUT.batch_shape(4)).to(LAYOUT.dtype)
    assert client.put(keys, kv).wait() == 4
    for _ in range(20):  # warm up the daemon's allocations before the baseline
        with _raw(daemon) as s:
            _hello(s, model="fuzz")
            _call(s, "lookup", 2, [b"".join(keys), None])
    rss0, fds0 = _rss_and_fds(daemon.pid)

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(after_hello=st.booleans(), chunks=st.lists(_garbage(), min_size=1, max_size=3))
    def fuzz(after_hello, chunks):
        with _raw(daemon) as s:
            s.settimeout(2)
            if after_hello:
                assert _hello(s, model="fuzz")[1] == m.OK
            try:
                for c in chunks:
                    s.sendall(c)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):  # replies until the daemon closes or we time out
                    pass
            except OSError:
                pass  # the daemon may close on us: fine

    fuzz()
    assert client.ping()  # still answering on the connection opened before the storm
    assert torch.equal(client.fetch(keys).wait(), kv)
    deadline = time.monotonic() + 10
    while True:
        rss, fds = _rss_and_fds(daemon.pid)
        if fds <= fds0 + 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert fds <= fds0 + 2, (fds0, fds)
    assert rss - rss0 < 48 << 20, (rss0, rss)
    st_ = client.server_stats()
    assert st_.leases == 0 and st_.grants == 0 and st_.connections == 1
    assert st_.errors > 100  # the garbage did reach the request handlers
    assert "Traceback" not in daemon.log()  # no internal error on the way
    client.close()


def test_wrong_uid_is_refused(serve):
    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "0", "--allow-uid", str(os.getuid() + 4242))
    with pytest.raises(PermissionDeniedError, match=f"uid {os.getuid()} is not allowed"):
        connect(d.socket_path, layout=LAYOUT, model_id="m", device="cpu")
    with _raw(d) as s:  # refused before a byte is read: no hello needed to find out
        rid, status, (code, _) = unpack(recv_frame(s, 1 << 20), CodecLimits.for_frames(1 << 20, 16))
        assert (rid, status, code) == (0, m.ERROR, ErrorCode.NOT_ALLOWED) and _closed(s)
