"""Subscriber over real sockets: publishers joining, restarting and dying; a stream of
garbage. The router's thread must keep following every other engine, whatever comes in."""

import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import zmq
from conftest import wait_until

from kvstore.events import AllBlocksCleared, BlockStored, EventBatch, EventsConfig, encode_batch
from kvstore.events import frames as fr
from kvstore.events.publisher import EventPublisher
from kvstore.routing import EngineSpec, Router, Subscriber
from kvstore.routing.feed import LIVE, SILENT


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def chain(start, n):
    keys = [k(i) for i in range(start, start + n)]
    return keys, [None, *keys[:-1]]


def spec(name, tmp_path, **kw):
    return EngineSpec(name, f"ipc://{tmp_path}/{name}", **kw)


def publisher(tmp_path, name, **kw):
    return EventPublisher(EventsConfig(f"ipc://{tmp_path}/{name}", heartbeat_s=0.1, **kw))


def test_subscriber_follows_publishers_and_a_restart(tmp_path):
    pubs = {n: publisher(tmp_path, n) for n in ("a", "b")}
    sinks = {n: p.sink(b"n" * 32, 16) for n, p in pubs.items()}
    keys, parents = chain(0, 6)
    sinks["a"].stored("warm", keys[:2], parents[:2])  # before anyone listens: the snapshot has it
    with Subscriber([spec("a", tmp_path), spec("b", tmp_path)], silence_s=5) as sub:
        router = Router(["a", "b"], sub.index, live=sub.live_engines)
        assert sub.wait_live()
        sinks["b"].stored("disk", keys[:5], parents[:5])
        assert wait_until(lambda: sub.index.match(keys).blocks == (2, 5))
        assert router.route(keys).engine == "b"
        # b restarts: a new publisher on the same endpoint, with less on it
        pubs["b"].close()
        pubs["b"] = publisher(tmp_path, "b")
        pubs["b"].sink(b"n" * 32, 16).stored("disk", keys[:1], parents[:1])
        assert wait_until(lambda: sub.index.match(keys).blocks == (2, 1))
        assert router.route(keys).engine == "a"
        st = {s.engine: s for s in sub.stats()}
        assert st["b"].state == LIVE and st["b"].snapshots >= 2 and st["b"].gaps >= 1
        assert st["a"].snapshots == 1 and st["a"].bad_messages == 0
    for p in pubs.values():
        p.close()


class FakePublisher:
    """A PUB and a ROUTER that say whatever the test wants."""

    def __init__(self, tmp_path, name):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"ipc://{tmp_path}/{name}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{tmp_path}/{name}.replay")
        self.history = []

    def send(self, seq, *events, raw=None):
        payload = raw if raw is not None else encode_batch(EventBatch(0.0, tuple(events)))
        self.history.append(fr.StreamMessage(b"", seq, payload))
        self.pub.send_multipart([b"", fr.seq_bytes(seq), payload])

    def serve(self, snapshot_seq, *events, vllm=False):
        """Answer pending requests: snapshots with ``events``, replays from the history.
        ``vllm``: like vLLM's publisher, which reads a snapshot request as a replay from a
        number past its buffer (so: the end marker alone)."""
        while self.router.poll(0):
            req = fr.parse_request(self.router.recv_multipart())
            if req.snapshot and vllm:
                msgs = []
            elif req.snapshot:
                msgs = [fr.StreamMessage(b"", snapshot_seq, encode_batch(
                    EventBatch(0.0, (AllBlocksCleared(), *events))))]
            else:
                msgs = [m for m in self.history if m.seq >= req.start_seq]
            for m in msgs:
                self.router.send_multipart(fr.reply(req.client, m))
            self.router.send_multipart(fr.end_of_reply(req.client))

    def close(self):
        self.ctx.destroy(linger=0)


GARBAGE = [
    [b"only one frame"],
    [b"", b"short", b"x"],
    [b"", fr.seq_bytes(1), b"\xc1"],  # msgpack's never-used byte
    [b"", fr.seq_bytes(2), msgpack.packb({"not": "a batch"})],
    [b"", fr.seq_bytes(3), encode_batch(EventBatch(0.0, (BlockStored((k(1),), None, (), 16,
                                                                   "CPU"),)))[:-3]],
    [b"", fr.seq_bytes(4), msgpack.packb([1.0, [["BlockStored", [k(1)], None, [], -1]]])],
    [b"", b"\xff" * 8, b""],
    [b"a", b"b", b"c", b"d", b"e"],
]


def test_garbage_never_stops_the_subscriber(tmp_path):
    fake = FakePublisher(tmp_path, "f")
    good = publisher(tmp_path, "g")
    keys, parents = chain(100, 3)
    good.sink(b"n" * 32, 16).stored("warm", keys, parents)
    with Subscriber([spec("f", tmp_path), spec("g", tmp_path)], silence_s=None,
                    request_timeout_s=0.5) as sub:
        rnd = random.Random(7)
        assert wait_until(lambda: (fake.send(50, BlockStored((k(1),), None, (), 16, "CPU")),
                                   fake.serve(50, BlockStored((k(1),), None, (), 16, "CPU")),
                                   "f" in sub.live_engines())[-1])
        for i in range(300):
            parts = rnd.choice(GARBAGE) if i % 3 else [bytes(rnd.randrange(256) for _ in
                                                             range(rnd.randrange(40)))]
            fake.pub.send_multipart(parts)
            fake.serve(60, BlockStored((k(1),), None, (), 16, "CPU"))
        # and a valid stream after it all: the subscriber resyncs and follows it
        assert wait_until(lambda: (fake.send(70, BlockStored((k(1), k(2)), None, (), 16, "CPU")),
                                   fake.serve(70, BlockStored((k(1), k(2)), None, (), 16,
                                                              "CPU")),
                                   sub.index.match([k(1), k(2)], ["f"]).blocks == (2,))[-1])
        # the other engine unaffected (waited for: on a loaded machine its own first
        # snapshot may still be on its way)
        assert wait_until(lambda: sub.index.match(keys, ["g"]).blocks == (3,)), sub.stats()
        st = {s.engine: s for s in sub.stats()}
        assert st["f"].bad_messages > 0 and st["g"].bad_messages == 0
        assert sub._thread.is_alive()
    fake.close()
    good.close()


PUBLISHER = textwrap.dedent("""
    import sys, time
    from kvstore.events import EventsConfig
    from kvstore.events.publisher import EventPublisher
    p = EventPublisher(EventsConfig(sys.argv[1], heartbeat_s=0.1))
    p.sink(b"n" * 32, 16).stored("warm", [bytes(32)], [None])
    p.flush()
    print("up", flush=True)
    time.sleep(600)
""")


def test_a_publisher_that_dies_falls_out(tmp_path):
    endpoint = f"ipc://{tmp_path}/dying"
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, endpoint], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout.readline() == b"up\n"
        with Subscriber([EngineSpec("d", endpoint)], silence_s=1.0,
                        request_timeout_s=0.5) as sub:
            assert sub.wait_live(timeout=30)
            assert sub.index.match([bytes(32)]).blocks == (1,)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            assert wait_until(lambda: sub.stats()[0].state == SILENT, timeout=30)
            assert sub.index.match([bytes(32)]).blocks == (0,)
            assert sub._thread.is_alive()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_engines_can_be_added_and_removed_while_running(tmp_path):
    p = publisher(tmp_path, "x")
    p.sink(b"n" * 32, 16).stored("warm", [k(5)], [None])
    with Subscriber(silence_s=None) as sub:
        sub.add(spec("x", tmp_path))
        assert wait_until(lambda: sub.index.match([k(5)], ["x"]).blocks == (1,))
        sub.remove("x")
        assert wait_until(lambda: sub.index.engines == ())
        assert sub.stats() == ()
    p.close()


@pytest.mark.parametrize("replay", ["", None])
def test_publishers_without_snapshots_are_followed_from_their_stream(tmp_path, replay):
    """No replay socket at all (``""``), or vLLM's, which has no snapshots."""
    fake = FakePublisher(tmp_path, "v")
    s = EngineSpec("v", f"ipc://{tmp_path}/v", replay_endpoint=replay)
    seq = iter(range(1000))

    def step():
        fake.send(next(seq), BlockStored((k(9),), None, (), 16, None))
        fake.serve(0, vllm=True)
        return sub.index.match([k(9)]).blocks == (1,)

    with Subscriber([s], silence_s=None, request_timeout_s=0.5) as sub:
        assert wait_until(step)
        assert not sub.stats()[0].snapshot_supported
    fake.close()


def test_a_publisher_restart_resyncs_without_a_traceback(tmp_path, caplog):
    """A restarted publisher's replay comes up short and the snapshot follows: the replay's
    socket is closed once, by one owner, and nothing is logged above INFO or with a
    traceback (issue 26: the second close raised KeyError from the poller every time)."""
    caplog.set_level(logging.DEBUG, logger="kvstore")
    keys, parents = chain(200, 3)
    p = publisher(tmp_path, "r")
    p.sink(b"n" * 32, 16).stored("warm", keys[:1], parents[:1])
    with Subscriber([spec("r", tmp_path)], silence_s=30, request_timeout_s=2.0) as sub:
        assert sub.wait_live(timeout=30)
        for n in (2, 3, 1):
            before = sub.stats()[0].snapshots
            p.close()
            p = publisher(tmp_path, "r")
            p.sink(b"n" * 32, 16).stored("warm", keys[:n], parents[:n])

            def resynced(before=before, n=n):
                st = sub.stats()[0]
                return (st.snapshots > before and st.state == LIVE
                        and sub.index.match(keys).blocks == (n,))

            assert wait_until(resynced, timeout=30), sub.stats()
        assert sub._thread.is_alive()
    p.close()
    bad = [r for r in caplog.records if r.levelno > logging.INFO or r.exc_info]
    assert not bad, [(r.levelname, r.getMessage(), r.exc_text) for r in bad]
    assert any("resynced" in r.getMessage() for r in caplog.records)


LAST = fr.MAX_SEQ if hasattr(fr, "MAX_SEQ") else 2**64 - 2


def test_a_snapshot_at_the_last_sequence_number_is_followed_across_the_wrap(tmp_path):
    """The number after 2**64 - 2 (0xFF x 8 is the end marker) is 0: a snapshot at
    2**64 - 2 continues with batches 0, 1, ...; they are applied, not retried forever."""
    fake = FakePublisher(tmp_path, "w")
    with Subscriber([spec("w", tmp_path)], silence_s=None, request_timeout_s=0.5) as sub:
        # batch LAST until the SUB has joined and asked for a snapshot (no more of it after:
        # one arriving once live would be a gap), then the snapshot "after batch LAST"
        assert wait_until(lambda: (fake.send(LAST, BlockStored((k(1),), None, (), 16, "CPU")),
                                   sub.stats()[0].state != "new")[-1])
        time.sleep(0.2)
        assert wait_until(lambda: (fake.serve(LAST, BlockStored((k(1),), None, (), 16, "CPU")),
                                   "w" in sub.live_engines())[-1])
        for seq, key in ((0, 2), (1, 3), (2, 4)):
            fake.send(seq, BlockStored((k(key),), k(key - 1), (), 16, "CPU"))
            fake.serve(LAST, BlockStored((k(1),), None, (), 16, "CPU"))
        assert wait_until(lambda: sub.index.match([k(i) for i in range(1, 5)]).blocks == (4,)), \
            sub.stats()
        st = sub.stats()[0]
        assert st.state == LIVE and st.expected == 3 and st.batches == 3 and st.gaps == 0
    fake.close()
