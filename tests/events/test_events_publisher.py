"""The publisher: what a sink call turns into (mirror), sequence numbers, heartbeats, replay
and snapshots over real ZMQ sockets (ipc endpoints in the test's directory)."""

import time

import msgpack
import pytest
import zmq
from conftest import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError
from kvstore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    EventsConfig,
    decode_batch,
)
from kvstore.events import frames as fr
from kvstore.events.config import replay_endpoint_for
from kvstore.events.mirror import Mirror
from kvstore.events.publisher import EventPublisher
from kvstore.routing.index import PrefixIndex


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


# -- mirror ------------------------------------------------------------------------------------

def test_mirror_groups_chains_and_skips_repeats():
    m = Mirror(block_size=16)
    evs = m.stored("warm", [k(1), k(2), k(3), k(9)], [None, k(1), k(2), k(1)])
    assert evs == [BlockStored((k(1), k(2), k(3)), None, (), 16, "CPU"),
                   BlockStored((k(9),), k(1), (), 16, "CPU")]
    assert m.stored("warm", [k(2)], [k(1)]) == []  # announced already
    assert m.stored("disk", [k(2)], [k(1)]) == [BlockStored((k(2),), k(1), (), 16, "STORAGE")]
    assert m.tiers_of(k(2)) == ("warm", "disk")
    assert m.removed("warm", [k(2), k(7)]) == [BlockRemoved((k(2),), "CPU")]
    assert m.tiers_of(k(2)) == ("disk",)
    evs = m.cleared("warm")  # k(1) leaves its last tier: its descendants go too, k(2) on disk
    assert {(e.medium, h) for e in evs for h in e.block_hashes} == {
        ("CPU", k(1)), ("CPU", k(3)), ("CPU", k(9)), ("STORAGE", k(2))}
    assert len(m) == 0


def test_mirror_keeps_the_namespace_prefix_closed():
    m = Mirror(block_size=4)
    assert m.stored("warm", [k(2)], [k(1)]) == []  # an orphan is never announced
    assert m.dropped == 1
    m.stored("warm", [k(1), k(2), k(3)], [None, k(1), k(2)])
    m.stored("disk", [k(2), k(3)], [k(1), k(2)])
    evs = m.removed("warm", [k(2)])
    assert evs == [BlockRemoved((k(2),), "CPU")]  # still on disk: nothing else moves
    evs = m.removed(None, [k(1)])  # the root leaves: the whole chain goes, every tier
    assert sorted((e.medium, e.block_hashes) for e in evs) == [
        ("CPU", (k(1), k(3))), ("STORAGE", (k(2), k(3)))]
    assert len(m) == 0 and list(m.snapshot()) == []


def test_mirror_runs_are_bounded():
    m = Mirror(block_size=4, max_run=3)
    keys = [k(i) for i in range(7)]
    evs = m.stored("hot", keys, [None, *keys[:-1]])
    assert [len(e.block_hashes) for e in evs] == [3, 3, 1]
    assert [e.parent_block_hash for e in evs] == [None, k(2), k(5)]
    assert [len(e.block_hashes) for e in m.removed("hot", keys)] == [3, 3, 1]


ops = st.lists(st.tuples(st.sampled_from(["stored", "removed", "cleared"]),
                         st.sampled_from(["hot", "warm", "disk", None]),
                         st.lists(st.integers(0, 12), max_size=6)), max_size=40)


@settings(max_examples=100, deadline=None)
@given(ops)
def test_snapshot_rebuilds_what_the_stream_built(script):
    """A consumer that applied every event and one that applied the snapshot agree."""
    m = Mirror(block_size=4, max_run=2)
    live, snap = PrefixIndex(), PrefixIndex()
    live.add_engine("e")
    snap.add_engine("e")
    parent = {i: (i - 1 if i % 4 else None) for i in range(13)}  # chains 0-3, 4-7, 8-11, 12
    for op, tier, ids in script:
        if op == "stored":
            if tier is None:
                continue
            evs = m.stored(tier, [k(i) for i in ids],
                           [None if parent[i] is None else k(parent[i]) for i in ids])
        elif op == "removed":
            evs = m.removed(tier, [k(i) for i in ids])
        else:
            evs = m.cleared(tier)
        live.apply("e", evs)
    snap.apply("e", list(m.snapshot()))
    probes = [[k(i) for i in range(s, s + 4) if i < 13] for s in (0, 4, 8, 12)]
    assert [live.match(p).blocks for p in probes] == [snap.match(p).blocks for p in probes]
    for i in range(13):
        assert set(live.media_of("e", k(i))) == set(snap.media_of("e", k(i)))


# -- sockets -----------------------------------------------------------------------------------

@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def pub(tmp_path):
    p = EventPublisher(EventsConfig(f"ipc://{tmp_path}/ev", heartbeat_s=30))
    yield p
    p.close()


def _sub(ctx, pub):
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(pub.endpoint)
    return s


def _request(ctx, endpoint, body):
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVTIMEO, 10_000)
    d.connect(endpoint)
    d.send_multipart([b"", body])
    out = []
    while True:
        msg = fr.parse_reply(d.recv_multipart())
        if msg is None:
            d.close(linger=0)
            return out
        out.append(msg)


def _joined(ctx, pub, sink):
    """A SUB that is surely connected: it has seen a batch published after it joined."""
    s = _sub(ctx, pub)
    s.setsockopt(zmq.RCVTIMEO, 200)
    for i in range(200):
        sink.stored("hot", [k(1000 + i)], [None])
        pub.flush()
        try:
            return s, fr.parse_stream(s.recv_multipart())
        except zmq.Again:
            continue
    raise AssertionError("the SUB never joined")


def test_stream_numbers_batches_and_maps_tiers(ctx, pub):
    sink = pub.sink(b"n" * 32, 16)
    s, first = _joined(ctx, pub, sink)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    sink.stored("warm", [k(1), k(2)], [None, k(1)])
    sink.stored("disk", [k(1)], [None])
    sink.removed("warm", [k(2)])
    assert pub.flush()
    want = [BlockStored((k(1), k(2)), None, (), 16, "CPU"),
            BlockStored((k(1),), None, (), 16, "STORAGE"), BlockRemoved((k(2),), "CPU")]
    got, events = [first], []
    while events[-3:] != want:
        msg = fr.parse_stream(s.recv_multipart())
        assert msg.topic == b""
        got.append(msg)
        events.extend(decode_batch(msg.payload).events)
    seqs = [m.seq for m in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one more per batch, no gap
    # numbers start at the publisher's start time (microseconds), so restarts never reuse them
    assert abs(seqs[0] / 1e6 - time.time()) < 3600


def test_first_batch_clears_and_replay_returns_history(ctx, pub):
    sink = pub.sink(b"n" * 32, 16)
    sink.stored("warm", [k(1)], [None])
    pub.flush()
    history = _request(ctx, pub.replay_endpoint, fr.seq_bytes(0))
    assert decode_batch(history[0].payload).events == (AllBlocksCleared(),)
    assert [m.seq for m in history] == list(range(history[0].seq, history[0].seq + len(history)))
    tail = _request(ctx, pub.replay_endpoint, fr.seq_bytes(history[-1].seq))
    assert tail == history[-1:]
    assert _request(ctx, pub.replay_endpoint, fr.seq_bytes(history[-1].seq + 1)) == []
    assert pub.stats().replays == 3


def test_snapshot_is_the_state_after_the_last_batch(ctx, pub):
    a, b = pub.sink(b"a" * 32, 16), pub.sink(b"b" * 32, 4)
    assert pub.sink(b"a" * 32, 16) is a
    a.stored("warm", [k(1), k(2), k(3)], [None, k(1), k(2)])
    a.stored("disk", [k(1)], [None])
    b.stored("hot", [k(50)], [None])
    a.removed("warm", [k(3)])
    pub.flush()
    snap = _request(ctx, pub.replay_endpoint, fr.SNAPSHOT_REQUEST)
    assert {m.seq for m in snap} == {pub.stats().last_seq}
    events = [e for m in snap for e in decode_batch(m.payload).events]
    assert events[0] == AllBlocksCleared()
    assert set(events[1:]) == {
        BlockStored((k(1),), None, (), 16, "CPU"), BlockStored((k(1),), None, (), 16, "STORAGE"),
        BlockStored((k(2),), k(1), (), 16, "CPU"), BlockStored((k(50),), None, (), 4, "GPU")}
    assert pub.stats().snapshots == 1 and pub.stats().blocks == 3


def test_numbers_wrap_to_0_after_the_last(ctx, tmp_path):
    """After 2**64 - 2 comes 0 (0xFF x 8 is the end marker); a replay from a number before
    the wrap returns the history in the order it was published, across the wrap."""
    last = fr.MAX_SEQ
    with EventPublisher(EventsConfig(f"ipc://{tmp_path}/w", heartbeat_s=30),
                        first_seq=last - 1) as p:
        sink = p.sink(b"n" * 32, 16)
        for i in range(3):
            sink.stored("warm", [k(i)], [None])
            p.flush()
        assert p.stats().last_seq == 2 - 1  # batches last - 1, last, 0, 1
        history = _request(ctx, p.replay_endpoint, fr.seq_bytes(last - 1))
        assert [m.seq for m in history] == [last - 1, last, 0, 1]
        assert [m.seq for m in _request(ctx, p.replay_endpoint, fr.seq_bytes(last))] == \
            [last, 0, 1]
        assert [m.seq for m in _request(ctx, p.replay_endpoint, fr.seq_bytes(0))] == [0, 1]
        assert _request(ctx, p.replay_endpoint, fr.seq_bytes(2)) == []
        assert _request(ctx, p.replay_endpoint, fr.END_SEQ) == []  # no batch's number
        assert {m.seq for m in _request(ctx, p.replay_endpoint, fr.SNAPSHOT_REQUEST)} == {1}
    for bad in (-1, fr.MAX_SEQ + 1, 2**64, 1.0, "1"):
        with pytest.raises(ConfigError, match="first_seq"):
            EventPublisher(EventsConfig(f"ipc://{tmp_path}/x"), first_seq=bad)


def test_sequence_arithmetic():
    last = fr.MAX_SEQ
    assert last == 2**64 - 2 and fr.next_seq(last) == 0 and fr.prev_seq(0) == last
    assert fr.seq_diff(0, last) == 1 and fr.seq_diff(last, 0) == -1
    assert fr.seq_diff(5, 3) == 2 and fr.seq_diff(3, 5) == -2
    for bad in (-1, last + 1, 2**64, 1.5, "1", None, True):
        with pytest.raises(ValueError, match="out of range"):
            fr.seq_bytes(bad)
    assert fr.parse_seq(fr.seq_bytes(last)) == last


def test_heartbeats(ctx, tmp_path):
    with EventPublisher(EventsConfig(f"ipc://{tmp_path}/hb", heartbeat_s=0.05)) as p:
        s = _sub(ctx, p)
        seen = [decode_batch(fr.parse_stream(s.recv_multipart()).payload) for _ in range(3)]
        assert all(b.events == () for b in seen)


def test_bad_requests_are_counted_not_fatal(ctx, pub):
    d = ctx.socket(zmq.DEALER)
    d.connect(pub.replay_endpoint)
    for body in ([b"", b""], [b"", b"x" * 9], [b"junk"], [b"", b"1", b"2"]):
        d.send_multipart(body)
    assert wait_until(lambda: pub.stats().bad_requests == 4)
    assert _request(ctx, pub.replay_endpoint, fr.seq_bytes(0))  # still serving
    d.close(linger=0)


def test_sink_checks_its_arguments(pub):
    sink = pub.sink(b"n" * 32, 16)
    with pytest.raises(ValueError, match="tier"):
        sink.stored("remote", [k(1)], [None])
    with pytest.raises(ValueError, match="parents"):
        sink.stored("warm", [k(1)], [])
    with pytest.raises(ValueError, match="tier"):
        sink.removed("ssd", [k(1)])


def test_bind_conflict_is_a_config_error(tmp_path):
    with EventPublisher(EventsConfig("tcp://127.0.0.1:0")) as p, \
            pytest.raises(ConfigError, match="cannot bind"):
        EventPublisher(EventsConfig(p.endpoint))


def test_config():
    assert replay_endpoint_for("tcp://*:5557") == "tcp://*:5558"
    assert replay_endpoint_for("tcp://h:0") == "tcp://h:0"
    assert replay_endpoint_for("ipc:///run/ev") == "ipc:///run/ev.replay"
    assert EventsConfig("inproc://x").replay_endpoint == "inproc://x-replay"
    for bad, why in (({"endpoint": "udp://x:1"}, "tcp://"), ({"endpoint": "tcp://x"}, "port"),
                     ({"endpoint": "ipc:///a", "replay_endpoint": "ipc:///a"}, "differ"),
                     ({"endpoint": "ipc:///a", "layout": "json"}, "layout"),
                     ({"endpoint": "ipc:///a", "heartbeat_s": 0}, "heartbeat")):
        with pytest.raises(ConfigError, match=why):
            EventsConfig(**bad)


def test_frames():
    assert fr.parse_request([b"id", b"", fr.seq_bytes(5)]) == fr.Request(b"id", False, 5)
    assert fr.parse_request([b"id", b"", b"\x07"]).start_seq == 7  # vLLM reads any width
    assert fr.parse_request([b"id", b"", fr.SNAPSHOT_REQUEST]).snapshot
    assert fr.parse_reply([b"", b"", fr.END_SEQ, b""]) is None
    with pytest.raises(Exception, match="8 bytes"):
        fr.parse_stream([b"", b"\x00", msgpack.packb([])])
    # the end marker is no batch's number, on the stream or in a reply
    with pytest.raises(EventFormatError, match="end marker"):
        fr.parse_stream([b"", fr.END_SEQ, msgpack.packb([])])
    with pytest.raises(EventFormatError, match="end marker"):
        fr.parse_reply([b"", b"t", fr.END_SEQ, b"payload"])
    for frames in ([b"", None, b""], [b"", 7, b""], [b"", "12345678", b""]):
        with pytest.raises(EventFormatError):
            fr.parse_stream(frames)


def test_a_client_that_asks_and_never_reads_holds_at_most_one_reply(ctx, tmp_path):
    """Before: the replay socket's send queue was unbounded (SNDHWM 0), so every request
    from a client that did not read its replies queued the whole buffer again in the
    engine's memory (here 40 requests: ~2,000 messages of ~37 KB). Now a client's queue holds
    one whole replay; a reply that does not fit is abandoned (counted), the thread never
    blocks past the client's patience, and the client, once it reads, is served again."""
    cfg = EventsConfig(f"ipc://{tmp_path}/p", buffer_steps=50, heartbeat_s=60)
    with EventPublisher(cfg, first_seq=1000) as p:
        sink = p.sink(b"n" * 32, 16)
        for b in range(49):  # + the first AllBlocksCleared: 50 batches of 4,096 hashes
            keys = [k(b * 4096 + i) for i in range(4096)]
            sink.stored("warm", keys, [None, *keys[:-1]])
            assert p.flush()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVHWM, 5)
        d.connect(p.replay_endpoint)
        for _ in range(40):
            d.send_multipart([b"", fr.seq_bytes(1000)])
        assert wait_until(lambda: p.stats().replays == 40, timeout=30)
        assert p.stats().abandoned_replies >= 1
        keys = [k(10**6 + i) for i in range(4)]
        sink.stored("warm", keys, [None, *keys[:-1]])
        assert p.flush(5.0), "the stalled client held the publisher's thread"
        got = 0
        d.setsockopt(zmq.RCVTIMEO, 500)
        try:
            while True:
                d.recv_multipart()
                got += 1
        except zmq.Again:
            pass
        assert got < 200, f"{got} messages were queued for a client that did not read"
        d.close(linger=0)
        # a client that reads gets the whole buffer and the end marker
        assert len(_request(ctx, p.replay_endpoint, fr.seq_bytes(1000))) == 50
