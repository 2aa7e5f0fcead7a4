"""Adversarial reliability pass, round 7 (b): one ``Store`` used from many threads at once
(calls racing ``close``, fetches racing the eviction of their own keys, flushes while puts go
on, then ``kill -9``), and the KV events path (the ZMQ publisher, the subscriber's feed and
the prefix index) fed hostile frames: garbled numbers, duplicates, replays, out-of-order
batches, publishers restarting with numbers going back, request floods, one hash announced
under two parents.

Every attack checks the promise: a fetch returns exactly the bytes put under its keys or fewer
blocks, never other bytes, and leaves the rows past them alone; a call after (or racing)
``close`` raises ``StoreClosedError``, never anything else, never a hang; what a ``flush``
vouched for survives ``kill -9``; a bad event frame is counted and skipped (or resynchronises),
never stops the subscriber's thread, never leaves an index that claims an engine holds a block
it was told was removed; nothing waits without a bound.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import zmq
from conftest import REPO, TESTS, bit_equal, fetch_exact, keyed_kv, run_bounded, wait_until
from support.attacks import LAY, T, attack_store, close_amid, stop_all, vouched_chains

from kvstore.errors import StoreClosedError
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch
from kvstore.events import frames as fr
from kvstore.events.config import EventsConfig
from kvstore.events.mirror import Mirror
from kvstore.events.publisher import EventPublisher
from kvstore.routing import EngineSpec, Subscriber
from kvstore.routing.feed import LIVE, EngineFeed
from kvstore.routing.index import PrefixIndex

MODEL = "attacks/round7"


def chain(s, i: int, n: int = 5):
    return s.block_keys([i * 100_000 + t for t in range(n * T)])


# -- one store, many threads ----------------------------------------------------------------------
def _every_call_raises_closed(s, ks) -> None:
    for call in (lambda: s.put(ks, keyed_kv(LAY, ks)), lambda: s.fetch(ks),
                 lambda: s.lookup(ks), lambda: s.prefetch(ks), lambda: s.flush(1),
                 lambda: s.stats(), lambda: s.evict(ks), lambda: s.evict(ks, tier="disk"),
                 lambda: s.pin(ks), lambda: s.borrow_blocks(ks), lambda: s.lease_warm(ks),
                 lambda: s.block_keys(list(range(8)))):
        with pytest.raises(StoreClosedError):
            run_bounded(call, 10)


def test_every_call_racing_close_is_exact_or_store_closed(tmp_path):
    """Twelve threads, each looping over one call (put, fetch, flush, stats, evict of every
    tier, lookup, prefetch, pin, borrow, lease, evict-all, a put not waited for) while close()
    comes at a random moment, six times over: every fetch is exact, every failure is
    StoreClosedError, every thread ends, and afterwards each call raises StoreClosedError."""
    rng = random.Random(7)
    for rnd in range(6):
        path = tmp_path / f"r{rnd}"
        s = attack_store(path, model=MODEL, warm=12, hot=2)
        chains = [chain(s, c) for c in range(8)]
        stop = threading.Event()
        bad: list[str] = []
        late: list = []  # transfers handed out around the close

        def worker(op: int, seed: int, s=s, chains=chains, stop=stop, bad=bad, late=late) -> None:
            r = random.Random(seed)
            while not stop.is_set():
                ks = r.choice(chains)
                try:
                    if op == 0:
                        s.put(ks, keyed_kv(LAY, ks)).wait(20)
                    elif op == 1:
                        got = s.fetch(ks).wait(20)
                        if not bit_equal(got, keyed_kv(LAY, ks[:got.shape[0]])):
                            bad.append("wrong KV")
                    elif op == 2:
                        s.flush(20)
                    elif op == 3:
                        s.stats()
                    elif op == 4:
                        s.evict(ks[r.randrange(len(ks)):], tier=r.choice([None, "hot", "warm", "disk"]))
                    elif op == 5:
                        s.lookup(ks)
                    elif op == 6:
                        s.prefetch(ks).wait(20)
                    elif op == 7:
                        with s.pin(ks):
                            s.lookup(ks)
                    elif op == 8:
                        with s.borrow_blocks(ks) as b:
                            if not bit_equal(b.blocks, keyed_kv(LAY, ks[:len(b)])):
                                bad.append("wrong borrowed KV")
                    elif op == 9:
                        got, _ = s.lease_warm(ks)
                        s.release_lease(got)
                    elif op == 10:
                        s.evict(None, tier=r.choice([None, "disk"]))
                    else:
                        late.append((ks, s.fetch(ks)))
                        late.append((None, s.put(ks, keyed_kv(LAY, ks))))
                except StoreClosedError:
                    return
                except BaseException as e:  # reported below
                    bad.append(f"op {op}: {type(e).__name__}: {e}")
                    return

        threads = [threading.Thread(target=worker, args=(op, rnd * 100 + op), daemon=True)
                   for op in range(12)]
        close_amid(s, threads, stop, after=0.1 + rng.random() * 0.3)
        assert not bad, bad
        for ks, tr in late[-50:]:
            try:
                got = tr.wait(20)
                if ks is not None:
                    assert bit_equal(got, keyed_kv(LAY, ks[:got.shape[0]]))
            except StoreClosedError:
                pass
        _every_call_raises_closed(s, chains[0])
        s.close()  # again: a no-op
    with attack_store(tmp_path / "r5", model=MODEL, warm=8) as s:
        for c in range(8):
            fetch_exact(s, chain(s, c))
        assert s.stats().damaged == 0


def test_fetches_racing_the_eviction_of_their_own_keys(tmp_path):
    """Chains on disk and in a tiny warm tier; four threads fetch them into ``out`` buffers
    prefilled with a pattern while three others evict the same keys (from warm, from disk, from
    the store) and put them back: every fetch is exact for its run and never writes the rows
    past it."""
    s = attack_store(tmp_path, model=MODEL, warm=10)
    chains = [chain(s, 20 + c, 6) for c in range(6)]
    for ks in chains:
        s.put(ks, keyed_kv(LAY, ks)).wait(20)
    s.flush(20)
    stop = threading.Event()
    bad: list[str] = []
    served = [0]

    def fetcher(seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            ks = r.choice(chains)
            out = torch.full(LAY.batch_shape(len(ks)), 7.0, dtype=LAY.dtype)
            try:
                got = s.fetch(ks, out=out).wait(20)
            except BaseException as e:  # reported below
                bad.append(f"{type(e).__name__}: {e}")
                return
            n = got.shape[0]
            served[0] += n
            if not bit_equal(out[:n], keyed_kv(LAY, ks[:n])):
                bad.append("wrong KV")
            if not bool((out[n:] == 7.0).all()):
                bad.append(f"rows past the run of {n} written")

    def evicter(seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            ks = r.choice(chains)
            try:
                s.evict(ks[r.randrange(len(ks)):], tier=r.choice([None, "warm", "disk"]))
                if r.random() < 0.5:
                    s.put(ks, keyed_kv(LAY, ks)).wait(20)
            except BaseException as e:  # reported below
                bad.append(f"{type(e).__name__}: {e}")
                return

    threads = [threading.Thread(target=fetcher, args=(i,), daemon=True) for i in range(4)]
    threads += [threading.Thread(target=evicter, args=(10 + i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop_all(threads, stop, "a fetch or an evict hung")
    run_bounded(s.close, 30)
    assert not bad, bad[:5]
    assert served[0] > 0


WRITER = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, sys.argv[2])
    from conftest import keyed_kv
    from support.attacks import LAY, T, attack_store
    s = attack_store(sys.argv[1], model="attacks/round7", warm=16)
    lock = threading.Lock()
    landed = set()  # chains whose put has completed

    def putter(w):
        for i in range(w, 10_000, 3):
            ks = s.block_keys([i * 100_000 + t for t in range(4 * T)])
            s.put(ks, keyed_kv(LAY, ks)).wait(30)
            with lock:
                landed.add(i)

    for w in range(3):
        threading.Thread(target=putter, args=(w,), daemon=True).start()
    told = set()
    while True:  # flushes while the puts go on: each vouches for what landed before it
        with lock:
            before = sorted(landed - told)
        s.flush(30)
        told.update(before)
        for i in before:
            sys.stdout.write(f"flushed {i}\\n")
        sys.stdout.flush()
""")


def test_what_a_flush_vouched_for_amid_concurrent_puts_survives_kill_9(tmp_path):
    """Three threads put chains through a small warm tier while the main thread flushes
    again and again, reporting the chains whose puts had completed before each flush began;
    killed -9 mid-way: every chain a flush vouched for is there whole, with exact bytes."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(TESTS)],
                            stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while len(lines) < 20 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=20)
    vouched = sorted(set(vouched_chains(lines + rest.splitlines(keepends=True))))
    assert vouched, "nothing was flushed"
    # the last ones vouched for (the flush nearest the kill) and a sample of the rest
    vouched = vouched[-30:] + random.Random(3).sample(vouched[:-30], min(30, len(vouched[:-30])))
    with attack_store(tmp_path, model=MODEL, warm=16) as s:
        for i in vouched:
            ks = s.block_keys([i * 100_000 + t for t in range(4 * T)])
            assert fetch_exact(s, ks) == len(ks), f"chain {i} vouched for, then lost"
        assert s.stats().damaged == 0


def test_a_flush_under_puts_that_never_pause_returns(tmp_path):
    """Three threads put without a pause while the main thread flushes: a flush waited for a
    writer pass that found nothing left to do, which never came while the puts went on (the
    first flush took 24 s, returning only when the putters ran out of work; flush() without
    a timeout had no bound). Now it waits for the blocks and overflow put before it, then
    returns; what it vouched for is on disk."""
    s = attack_store(tmp_path, model=MODEL, warm=16)
    stop = threading.Event()
    landed: list[int] = []
    errors: list[str] = []

    def putter(w: int) -> None:
        i = w
        while not stop.is_set():
            ks = s.block_keys([i * 100_000 + t for t in range(4 * T)])
            try:
                s.put(ks, keyed_kv(LAY, ks)).wait(30)
            except BaseException as e:  # reported below
                errors.append(f"{type(e).__name__}: {e}")
                return
            landed.append(i)
            i += 3

    threads = [threading.Thread(target=putter, args=(w,), daemon=True) for w in range(3)]
    for t in threads:
        t.start()
    vouched: set[int] = set()
    try:
        for _ in range(3):
            time.sleep(0.3)
            before = list(landed)
            t0 = time.monotonic()
            s.flush(20)  # TimeoutError before the fix: the putters never stop on their own
            assert time.monotonic() - t0 < 20
            vouched |= set(before)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:3]
    assert len(landed) > len(vouched) > 0  # puts went on while the flushes ran
    s.close()
    with attack_store(tmp_path, model=MODEL, warm=16) as s:
        for i in random.Random(5).sample(sorted(vouched), min(40, len(vouched))):
            ks = s.block_keys([i * 100_000 + t for t in range(4 * T)])
            assert fetch_exact(s, ks) == len(ks), f"chain {i} vouched for, then lost"


# -- KV events: the index -------------------------------------------------------------------------
def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_a_hash_announced_under_two_parents_never_outlives_its_removed_parent():
    """Before: the index keeps one parent per hash, the first announced. Engine B announced
    ``r -> m -> l`` where engine A had announced ``l`` under ``x``; B then removed ``m``, which
    took only ``m`` (``l`` was not among ``m``'s children), so B still held ``r`` and ``l`` and
    match() claimed B's whole run, ``m`` included, which B had said it no longer held."""
    idx = PrefixIndex()
    idx.add_engine("A")
    idx.add_engine("B")
    idx.apply("A", [BlockStored((h(1), h(3)), None, (), 4, "CPU")])
    idx.apply("B", [BlockStored((h(5), h(6), h(3)), None, (), 4, "CPU")])
    idx.apply("B", [BlockRemoved((h(6),), None)])
    assert not idx.holds("B", h(6))
    assert idx.match([h(5), h(6), h(3)], ["B"]).blocks == (1,)
    assert idx.match([h(1), h(3)], ["A"]).blocks == (2,)  # A's own run untouched
    assert not idx.holds("B", h(3))  # refused: it hangs off another parent than B's
    assert idx.stats().dropped == 1


# -- KV events: one feed against a hostile stream ------------------------------------------------
def _msg(seq: int, *events) -> fr.StreamMessage:
    return fr.StreamMessage(b"", seq, encode_batch(EventBatch(0.0, tuple(events))))


class _Publisher:
    """A truthful publisher (a real Mirror, a replay buffer, snapshots) and the state after
    every batch it published, to check the feed's index against."""

    def __init__(self, first_seq: int, after: dict[int, frozenset] | None = None) -> None:
        self.mirror = Mirror(4)
        self.seq = first_seq
        self.buffer: list[fr.StreamMessage] = []
        self.after = {} if after is None else after  # kept across a restart's numbers
        self.publish([AllBlocksCleared()])

    def publish(self, events) -> fr.StreamMessage:
        m = _msg(self.seq, *events)
        self.buffer = (self.buffer + [m])[-50:]
        self.after[self.seq] = frozenset(self.mirror._bits)
        self.seq = fr.next_seq(self.seq)
        return m

    def answer(self, ask) -> list[fr.StreamMessage]:
        if ask.snapshot:
            last = fr.prev_seq(self.seq)
            return [_msg(last, AllBlocksCleared(), *self.mirror.snapshot())]
        return [m for m in self.buffer if fr.seq_diff(m.seq, ask.start_seq) >= 0]


def _serve(f: EngineFeed, pub: _Publisher, ask, now: float) -> None:
    for _ in range(20):
        if ask is None:
            return
        for m in pub.answer(ask):
            assert f.on_reply(m, now) is None
        ask = f.on_reply(None, now)
    raise AssertionError("the feed asked again and again without a pause")


def test_a_garbled_number_ahead_or_a_restart_going_back_does_not_wedge_the_feed():
    """Before: a batch numbered far ahead (a bit flip in its number, an impostor) stayed in
    the feed's queue: after each snapshot it was a gap, its replay came back empty, and the feed
    asked for a snapshot again, then a replay, without end and without back-off; a publisher
    restarted with lower numbers left its predecessor's batches queued the same way."""
    idx = PrefixIndex()
    f = EngineFeed("e", idx, silence_s=None)
    pub = _Publisher(1000)
    _serve(f, pub, f.on_live(pub.buffer[-1], 0.0), 0.0)
    assert f.state == LIVE
    now = 0.0
    for bogus in (pub.seq + (1 << 40), fr.MAX_SEQ, pub.seq + 2):
        _serve(f, pub, f.on_live(_msg(bogus, BlockStored((h(99),), None, (), 4, "CPU")), now), now)
    keys = [h(i) for i in range(1, 6)]
    for i, k in enumerate(keys):
        now += 0.5
        m = pub.publish(pub.mirror.stored("warm", [k], [keys[i - 1] if i else None]))
        _serve(f, pub, f.on_live(m, now), now)
        _serve(f, pub, f.tick(now), now)
    assert f.state == LIVE and f.expected == pub.seq
    assert idx.match(keys).blocks == (5,) and not idx.holds("e", h(99))
    # restarted, numbering from lower down, holding less
    pub = _Publisher(10)
    m = pub.publish(pub.mirror.stored("warm", keys[:2], [None, keys[0]]))
    _serve(f, pub, f.on_live(m, now), now)
    for _ in range(3):
        now += 6
        _serve(f, pub, f.tick(now), now)
    assert f.state == LIVE and f.expected == pub.seq
    assert idx.match(keys).blocks == (2,)


def test_a_feed_under_a_hostile_stream_matches_its_publisher_whenever_live():
    """Random store changes through a real Mirror, delivered with losses, duplicates, old
    batches replayed, garbage payloads, numbers out of range or far off, garbled replies and
    two publisher restarts (numbers going back): the feed never raises, never asks without
    pause, and whenever it is live its index is exactly the publisher's state after the batch
    before the one it expects."""
    rnd = random.Random(11)
    idx = PrefixIndex()
    f = EngineFeed("e", idx, silence_s=None)
    pub = _Publisher(5000)
    universe = [h(i) for i in range(1, 25)]
    roots = universe[::6]
    now = 0.0
    live_checks = 0
    _serve(f, pub, f.on_live(pub.buffer[-1], now), now)
    for step in range(1500):
        now += 0.01
        a = rnd.random()
        if step in (500, 1000):  # a restart, numbering from below where it was (apart)
            pub = _Publisher(2000 if step == 500 else 100, pub.after)
            continue
        if a < 0.55:
            k = rnd.choice(universe)
            i = universe.index(k)
            if rnd.random() < 0.6:
                par = None if k in roots else universe[i - 1]
                ev = pub.mirror.stored(rnd.choice(["warm", "disk"]), [k], [par])
            else:
                ev = pub.mirror.removed(rnd.choice([None, "warm", "disk"]), [k])
            m = pub.publish(ev)
            if rnd.random() < 0.85:
                _serve(f, pub, f.on_live(m, now), now)
        elif a < 0.7 and pub.buffer:  # an old batch again (a replay, a duplicate)
            _serve(f, pub, f.on_live(rnd.choice(pub.buffer), now), now)
        elif a < 0.8:  # garbage where a batch belongs
            payload = rnd.choice([b"", b"\xc1", b"\x93\x00\x90", os.urandom(rnd.randrange(1, 40)),
                                  encode_batch(EventBatch(0.0, ()))[:-1]])
            seq = rnd.choice([pub.seq, fr.prev_seq(pub.seq), rnd.randrange(fr.SEQ_MOD)])
            _serve(f, pub, f.on_live(fr.StreamMessage(b"", seq, payload), now), now)
        elif a < 0.85:  # numbers no batch may carry
            seq = rnd.choice([fr.SEQ_MOD, 1 << 64, -1, "1", None, 2.0])
            _serve(f, pub, f.on_live(fr.StreamMessage(b"", seq, b"\x90"), now), now)
        elif a < 0.9 and f.waiting:  # a reply nobody asked for in that shape
            f.on_reply(fr.StreamMessage(b"", rnd.randrange(fr.SEQ_MOD), b"\xc1"), now)
            _serve(f, pub, f.on_reply(None, now), now)
        else:
            now += rnd.choice([0.01, 0.3, 6.0])
            _serve(f, pub, f.tick(now), now)
        if f.state == LIVE and f.expected is not None:
            want = pub.after.get(fr.prev_seq(f.expected))
            assert want is not None, "live at a number the publisher never published"
            got = frozenset(k for k in universe if idx.holds("e", k))
            assert got == want, f"step {step}: index {len(got)} blocks, publisher {len(want)}"
            live_checks += 1
    assert live_checks > 300
    assert f.stats().bad_messages > 0


# -- KV events: the publisher's sockets ----------------------------------------------------------
def test_a_flood_of_replay_requests_does_not_stall_the_stream(tmp_path):
    """Before: the publisher's thread answered requests while any were waiting; a client
    sending replay requests as fast as they were answered kept it there, so nothing was
    published (a sink's changes, even the heartbeat) and ``flush`` timed out: every router
    then saw the engine fall silent."""
    p = EventPublisher(EventsConfig(f"ipc://{tmp_path}/p", heartbeat_s=0.2))
    sink = p.sink(b"n" * 32, 4)
    ctx = zmq.Context()
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(p.replay_endpoint)
        bodies = [fr.seq_bytes(0), b"\xff" * 8, b"", b"x" * 9, fr.SNAPSHOT_REQUEST]
        while not stop.is_set():
            for i in range(500):
                d.send_multipart([b"", bodies[(i // 50) % 5] if i % 50 == 0 else bodies[0]])
                sent[0] += 1
            try:
                while True:
                    d.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
        d.close()

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        assert wait_until(lambda: p.stats().replays > 1000, timeout=10)
        keys = [h(i) for i in range(4)]
        sink.stored("warm", keys, [None, *keys[:-1]])
        assert p.flush(3.0), "the flood kept the publisher from publishing"
        assert p.stats().blocks == 4
    finally:
        stop.set()
        t.join(10)
        p.close(timeout=0.5)  # the flood's unread answers are not worth lingering for
        ctx.destroy(linger=0)
    assert p.stats().bad_requests > 0


def test_a_late_subscriber_behind_hostile_replies_ends_live_and_exact(tmp_path):
    """A fake publisher whose replay socket answers garbage first (frames missing, the end
    marker with a payload, numbers of 9 bytes, payloads over the subscriber's limit, a snapshot
    whose pieces disagree on their number), then the truth; its live stream has batches that
    were published before the subscriber connected: the subscriber's thread stays up, counts
    the garbage and ends live with exactly the publisher's blocks."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/f")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/f.replay")
    keys = [h(i) for i in range(50, 54)]
    truth = BlockStored(tuple(keys), None, (), 4, "CPU")
    hostile = [
        lambda c: [c, b"", b"x"],
        lambda c: [c, b"", b"", b"\xff" * 8, b"payload"],
        lambda c: [c, b"", b"", b"\x00" * 9, b"\x90"],
        lambda c: [c, b"", b"", fr.seq_bytes(9), b"\x91" + b"\x00" * 5000],
        lambda c: [c, b"", b"", fr.seq_bytes(9), encode_batch(EventBatch(0.0, (truth,)))],
        lambda c: [c, b"", b"", fr.seq_bytes(8), encode_batch(EventBatch(0.0, ()))],
    ]
    answered = [0]
    last = [9]

    def serve() -> None:
        while router.poll(0):
            req = fr.parse_request(router.recv_multipart())
            c = req.client
            if answered[0] < 4:
                for make in hostile:
                    router.send_multipart(make(c))
            elif req.snapshot:
                router.send_multipart(fr.reply(c, _msg(last[0], AllBlocksCleared(), truth)))
            router.send_multipart(fr.end_of_reply(c))  # a replay: nothing kept
            answered[0] += 1

    def send(*events) -> None:
        last[0] += 1
        pub.send_multipart([b"", fr.seq_bytes(last[0]), encode_batch(EventBatch(0.0, events))])

    try:
        with Subscriber([EngineSpec("f", f"ipc://{tmp_path}/f")], silence_s=None,
                        request_timeout_s=0.3, max_payload=4096) as sub:
            def step() -> bool:
                send()
                serve()
                return (sub.stats() and sub.stats()[0].state == LIVE
                        and sub.index.match(keys).blocks == (4,))

            assert wait_until(step, timeout=20), sub.stats()
            assert sub.stats()[0].bad_messages > 0
            assert sub._thread.is_alive()
            send(BlockRemoved((keys[2],), None))
            assert wait_until(lambda: sub.index.match(keys).blocks == (2,), timeout=10)
    finally:
        ctx.destroy(linger=0)
