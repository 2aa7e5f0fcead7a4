"""Put hints: PutHint's validation, HintAdmission's placement, a hinted put through the
store, the wire and a daemon client."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import ConfigError, KVLayout, PutHint, open_store
from kvstore.hints import MAX_PRIORITY, MAX_SESSION_CHARS, MIN_PRIORITY
from kvstore.tiers.admission import PROBATION, HintAdmission
from kvstore.wire import messages as m
from kvstore.wire.errors import BadRequest

LAY = KVLayout(num_layers=1, block_tokens=4, num_kv_heads=1, head_dim=4, dtype=torch.float16)


# -- PutHint ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    ({"session": ""}, "non-empty str"),
    ({"session": 7}, "non-empty str"),
    ({"session": "x" * (MAX_SESSION_CHARS + 1)}, f"at most {MAX_SESSION_CHARS}"),
    ({"priority": MIN_PRIORITY - 1}, r"priority must be an int in \[-1, 3\]"),
    ({"priority": MAX_PRIORITY + 1}, r"priority must be an int in \[-1, 3\]"),
    ({"priority": True}, "priority must be an int"),
    ({"priority": 1.0}, "priority must be an int"),
])
def test_a_bad_hint_says_what_to_change(kw, match):
    with pytest.raises(ConfigError, match=match):
        PutHint(**kw)


# -- HintAdmission ------------------------------------------------------------------------------
def k(i):
    return bytes([i]) * 32


def test_placement_by_priority_and_session():
    h = HintAdmission()
    held = {k(i) for i in (1, 2, 3, 4, 6, 9)}.__contains__
    assert h.start(None, [k(1)], None, held) == 0
    assert h.start(PutHint(priority=-1), [k(1)], None, held) == PROBATION
    assert h.start(PutHint(priority=2), [k(1)], None, held) == 2
    s = PutHint(session="s")
    assert h.start(s, [k(1), k(2)], None, held) == 0  # a session's first put
    assert h.start(s, [k(3)], k(2), held) == 0  # hangs off its last block: extends
    assert h.start(s, [k(2), k(3), k(4)], k(1), held) == 0  # contains it: extends
    assert h.start(s, [k(5)], k(9), held) == PROBATION  # branches off elsewhere
    assert h.start(PutHint("s", 3), [k(6)], k(9), held) == PROBATION  # a branch beats priority
    assert h.start(s, [k(7)], k(6), held) == 0  # extends the branch: as usual again
    assert h.start(PutHint(session="t"), [k(5)], k(9), held) == 0  # sessions are separate


def test_a_gone_last_block_keeps_the_sessions_last_verdict():
    h = HintAdmission()
    held = {k(1), k(2)}.__contains__
    s = PutHint(session="job")
    h.start(s, [k(1)], None, held)
    assert h.start(s, [k(10)], k(2), held) == PROBATION  # branched (k(1) held, not its parent)
    assert h.start(s, [k(11)], k(2), held) == PROBATION  # k(10) gone: still a branching job
    c = HintAdmission()
    c.start(s, [k(1)], None, held)
    assert c.start(s, [k(12)], k(1), held) == 0
    assert c.start(s, [k(13)], k(2), held) == 0  # k(12) gone: still a conversation


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 3), st.integers(0, 20),
                              st.booleans()), max_size=60))
def test_placement_is_bounded_and_in_range(ops):
    h = HintAdmission(sessions=3)
    held: set[bytes] = set()
    for sess, prio, key, keep in ops:
        got = h.start(PutHint(f"s{sess}", prio), [k(key)], None, held.__contains__)
        assert got == PROBATION or 0 <= got <= MAX_PRIORITY
        assert got == PROBATION or got == prio  # a put is never lifted above its priority
        assert len(h) <= 3
        if keep:
            held.add(k(key))


# -- through the store ----------------------------------------------------------------------------
def kv(n, fill=1.0):
    return torch.full(LAY.batch_shape(n), fill, dtype=LAY.dtype)


def test_a_branching_sessions_blocks_go_first_and_hints_never_change_bytes():
    s = open_store(None, layout=LAY, model_id="m", cpu_capacity=8 * LAY.block_nbytes,
                   eviction="lru")
    try:
        chat = s.block_keys(list(range(16)))  # 4 blocks: a conversation
        s.put(chat, kv(4, 1.0), PutHint(session="chat")).wait()
        job1 = s.block_keys([100 + i for i in range(8)])  # a batch job's two prompts
        job2 = s.block_keys([200 + i for i in range(8)])
        s.put(job1, kv(2, 2.0), PutHint(session="job")).wait()
        s.put(job2, kv(2, 3.0), PutHint(session="job")).wait()  # branches: probation
        # the next conversation turn needs room for 2: the job's branch goes, not the chat
        more = s.block_keys(list(range(24)))
        s.put(more, kv(6, 1.0), PutHint(session="chat")).wait()
        assert s.lookup(job2) == 0 and s.lookup(more) == 6 and s.lookup(job1) == 2
        got = s.fetch(more).wait()
        assert torch.equal(got, kv(6, 1.0))
    finally:
        s.close()


def test_a_bad_hint_is_refused_before_anything_is_stored():
    s = open_store(None, layout=LAY, model_id="m", cpu_capacity=8 * LAY.block_nbytes)
    try:
        keys = s.block_keys(list(range(8)))
        with pytest.raises(ConfigError, match="kvstore.PutHint"):
            s.put(keys, kv(2), {"session": "x"})  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="kvstore.PutHint"):
            s.grant_put(keys, "x")  # type: ignore[arg-type]
        assert s.lookup(keys) == 0 and s.stats().put_blocks == 0
    finally:
        s.close()


# -- the wire -----------------------------------------------------------------------------------
def test_a_put_carries_its_hint_and_reads_the_hintless_form():
    keys = k(1) + k(2)
    plain = m.Put(keys, None)
    assert plain.to_wire() == [keys, None] and m.Put.from_wire([keys, None]).hint is None
    hinted = m.Put(keys, k(0), "conv-7", -1)
    back = m.Put.from_wire(hinted.to_wire())
    assert back == hinted and back.hint == PutHint("conv-7", -1)
    assert m.Put.from_wire([keys, None, None, 2]).hint == PutHint(priority=2)


@pytest.mark.parametrize("args,match", [
    ([k(1), None, None], "2 arguments"),
    ([k(1), None, "", 0], "non-empty"),
    ([k(1), None, 5, 0], "session must be a str"),
    ([k(1), None, "x" * (MAX_SESSION_CHARS + 1), 0], "session must be a str"),
    ([k(1), None, "s", 4], r"priority must be an int in \[-1, 3\]"),
    ([k(1), None, "s", True], "priority must be an int"),
])
def test_a_bad_hint_on_the_wire_is_a_bad_request(args, match):
    with pytest.raises(BadRequest, match=match):
        m.Put.from_wire(args)
