"""EngineFeed, the per-publisher state machine: first contact, gaps, replays that come up
short, restarts, publishers without snapshots, garbage, silence. No sockets: the test plays
the publisher."""

from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch
from kvstore.events.frames import StreamMessage
from kvstore.routing.feed import LIVE, SILENT, SYNCING, Ask, EngineFeed
from kvstore.routing.index import PrefixIndex


def msg(seq, *events):
    return StreamMessage(b"", seq, encode_batch(EventBatch(0.0, tuple(events))))


def stored(*blocks, parent=None):
    return BlockStored(tuple(blocks), parent, (), 16, "CPU")


def feed(**kw):
    idx = PrefixIndex()
    return EngineFeed("e", idx, **kw), idx


def reply(f, msgs, now=0.0):
    for m in msgs:
        assert f.on_reply(m, now) is None
    return f.on_reply(None, now)


def test_first_contact_takes_a_snapshot_then_the_stream():
    f, idx = feed()
    assert f.on_live(msg(101, stored(3, parent=2)), 0.0) == Ask(True)
    assert f.on_live(msg(102, stored(4, parent=3)), 0.0) is None  # buffered meanwhile
    snap = [msg(100, AllBlocksCleared(), stored(1, 2))]
    assert reply(f, snap) is None
    assert f.state == LIVE and f.expected == 103
    assert idx.match([1, 2, 3, 4]).blocks == (4,)
    assert f.on_live(msg(103, BlockRemoved((4,), "CPU")), 0.0) is None
    assert idx.match([1, 2, 3, 4]).blocks == (3,)
    s = f.stats()
    assert (s.snapshots, s.batches, s.gaps) == (1, 3, 0)


def live_feed():
    f, idx = feed()
    f.on_live(msg(10, stored(1)), 0.0)
    reply(f, [msg(10, AllBlocksCleared(), stored(1))])
    assert f.state == LIVE and f.expected == 11
    return f, idx


def test_a_gap_is_replayed():
    f, idx = live_feed()
    assert f.on_live(msg(13, stored(4, parent=3)), 0.0) == Ask(False, 11)
    assert f.state == SYNCING
    assert reply(f, [msg(11, stored(2, parent=1)), msg(12, stored(3, parent=2)),
                     msg(13, stored(4, parent=3))]) is None
    assert f.state == LIVE and f.expected == 14
    assert idx.match([1, 2, 3, 4]).blocks == (4,)
    assert (f.stats().gaps, f.stats().replays) == (1, 1)


def test_a_replay_that_does_not_continue_the_stream_falls_back_to_a_snapshot():
    f, idx = live_feed()
    assert f.on_live(msg(15, stored(9)), 0.0) == Ask(False, 11)
    # the buffer no longer has 11 (or a restarted publisher answers with its own history)
    assert reply(f, [msg(14, stored(8)), msg(15, stored(9))]) == Ask(True)
    assert reply(f, [msg(15, AllBlocksCleared(), stored(9))]) is None
    assert f.state == LIVE and f.expected == 16
    assert idx.match([1]).blocks == (0,) and idx.match([9]).blocks == (1,)


def test_a_restarted_publisher_is_resynced_from_its_snapshot():
    f, idx = live_feed()
    # a new instance numbers from its own start time: far ahead (or, clock set back, behind)
    for new_seq in (5_000_000, 3):
        ask = f.on_live(msg(new_seq, AllBlocksCleared()), 0.0)
        assert ask == Ask(False, f.expected)
        assert reply(f, []) == Ask(True)
        assert reply(f, [msg(new_seq, AllBlocksCleared(), stored(7))]) is None
        assert f.state == LIVE and f.expected == new_seq + 1
        assert idx.match([7]).blocks == (1,) and idx.match([1]).blocks == (0,)


def test_a_garbled_batch_is_a_gap():
    f, idx = live_feed()
    ask = f.on_live(StreamMessage(b"", 11, b"\xc1garbage"), 0.0)
    assert ask == Ask(False, 11)
    assert f.stats().bad_messages == 1
    assert reply(f, [msg(11, stored(2, parent=1))]) is None
    assert f.state == LIVE and idx.match([1, 2]).blocks == (2,)


def test_a_publisher_without_snapshots_is_followed_from_the_stream():
    """vLLM's publisher answers a snapshot request with the end marker alone."""
    f, idx = feed()
    assert f.on_live(msg(0, stored(1)), 0.0) == Ask(True)
    assert reply(f, []) is None
    assert f.state == LIVE and not f.snapshot_supported and f.expected == 1
    assert idx.match([1]).blocks == (1,)
    # a later gap: a replay if it can, else the entry is emptied and followed again
    assert f.on_live(msg(3, stored(5)), 0.0) == Ask(False, 1)
    assert reply(f, []) is None
    assert f.state == LIVE and f.expected == 4
    assert idx.match([1]).blocks == (0,) and idx.match([5]).blocks == (1,)


def test_silence_makes_an_engine_fall_out_until_it_is_heard_again():
    f, idx = feed(silence_s=5.0)
    f.on_live(msg(10, stored(1)), 0.0)
    reply(f, [msg(10, AllBlocksCleared(), stored(1))], 0.0)
    assert f.tick(4.0) is None and f.state == LIVE
    assert f.tick(5.5) is None and f.state == SILENT
    assert idx.match([1]).blocks == (0,) and f.stats().silences == 1
    assert f.on_live(msg(40, stored(2)), 6.0) == Ask(True)  # back: resync from scratch
    assert reply(f, [msg(40, AllBlocksCleared(), stored(1), stored(2))], 6.0) is None
    assert f.state == LIVE and idx.match([1]).blocks == (1,)


def test_unanswered_requests_are_retried_with_back_off():
    f, _ = feed(request_timeout_s=1.0)
    assert f.on_live(msg(1, stored(1)), 0.0) == Ask(True)
    assert f.tick(0.5) is None and f.waiting
    assert f.tick(1.5) == Ask(True)  # first failure: asked again at once
    assert f.tick(3.0) is None and not f.waiting  # second: waits for the back-off
    ask = None
    t = 3.0
    while ask is None and t < 20:
        t += 0.05
        ask = f.tick(t)
    assert ask == Ask(True) and f.state == SYNCING
    assert f.on_reply(msg(1, AllBlocksCleared()), t) is None
    assert f.on_reply(None, t) is None and f.state == LIVE


def test_late_replies_and_overflow():
    f, _ = feed(max_pending=3)
    assert f.on_reply(None, 0.0) is None  # nothing asked: ignored
    assert f.on_live(msg(1, stored(1)), 0.0) == Ask(True)
    for s in range(2, 8):
        f.on_live(msg(s, stored(s)), 0.0)  # more than the feed keeps while it waits
    ask = reply(f, [msg(1, AllBlocksCleared())])
    assert ask == Ask(True) and f.state == SYNCING  # it cannot join: another snapshot


LAST = 2**64 - 2  # the largest sequence number: 0xFF x 8 is the replay's end marker


def test_a_snapshot_at_the_last_number_continues_with_batch_0():
    f, idx = feed()
    assert f.on_live(msg(LAST - 1, stored(1)), 0.0) == Ask(True)
    f.on_live(msg(LAST, stored(2, parent=1)), 0.0)  # covered by the snapshot: skipped
    f.on_live(msg(0, stored(3, parent=2)), 0.0)  # after it: applied
    assert reply(f, [msg(LAST, AllBlocksCleared(), stored(1, 2))]) is None
    assert f.state == LIVE and f.expected == 1
    for seq in (1, 2):
        assert f.on_live(msg(seq, stored(3 + seq, parent=2 + seq)), 0.0) is None
    assert idx.match([1, 2, 3, 4, 5]).blocks == (5,)
    s = f.stats()
    assert (s.state, s.expected, s.batches, s.gaps) == (LIVE, 3, 3, 0)


def test_a_gap_across_the_wrap_is_replayed():
    f, idx = feed()
    f.on_live(msg(LAST - 2, stored(1)), 0.0)
    reply(f, [msg(LAST - 2, AllBlocksCleared(), stored(1))])
    assert f.expected == LAST - 1
    assert f.on_live(msg(1, stored(5, parent=4)), 0.0) == Ask(False, LAST - 1)
    assert reply(f, [msg(LAST - 1, stored(2, parent=1)), msg(LAST, stored(3, parent=2)),
                     msg(0, stored(4, parent=3)), msg(1, stored(5, parent=4))]) is None
    assert f.state == LIVE and f.expected == 2
    assert idx.match([1, 2, 3, 4, 5]).blocks == (5,)
    # a replay that skips the wrap's neighbour (LAST, then 1) does not continue the stream
    assert f.on_live(msg(4, stored(9)), 0.0) == Ask(False, 2)
    assert reply(f, [msg(2, stored(6, parent=5)), msg(4, stored(7, parent=6))]) == Ask(True)


def test_numbers_out_of_range_are_counted_drops():
    f, idx = live_feed()
    for seq in (2**64 - 1, 2**64, -1, "11", 11.0, None):
        assert f.on_live(StreamMessage(b"", seq, msg(11, stored(2)).payload), 0.0) is None
    assert f.state == LIVE and f.expected == 11 and f.stats().bad_messages == 6
    assert f.on_live(msg(11, stored(2, parent=1)), 0.0) is None
    assert idx.match([1, 2]).blocks == (2,)
    # in a reply as well
    assert f.on_live(msg(13, stored(4)), 0.0) == Ask(False, 12)
    assert f.on_reply(StreamMessage(b"", -5, b""), 0.0) is None
    assert f.stats().bad_messages == 7
    assert reply(f, [msg(12, stored(3, parent=2)), msg(13, stored(4, parent=3))]) is None
    assert f.state == LIVE and idx.match([1, 2, 3, 4]).blocks == (4,)
