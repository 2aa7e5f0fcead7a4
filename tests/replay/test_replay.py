"""kvstore replay: traces, the simulators, the replay through a real store, the report."""

import json

import pytest
from conftest import REPO

from kvstore.errors import ConfigError
from kvstore.replay import (
    ReplayPlan,
    StoreSpec,
    TraceError,
    load_trace,
    parse_capacity,
    replay,
    run_report,
    simulate_belady,
    simulate_policy,
    unbounded,
)
from kvstore.replay.driver import replay_layout, replay_namespace, session_hint
from kvstore.replay.families import generate
from kvstore.replay.trace import Request, Trace, block_tokens_of, facts, store_keys
from kvstore.replay.workloads import ChatWorkload, chat_trace

MOONCAKE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
NS = replay_namespace(512).id
BN = replay_layout(512).block_nbytes


def write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def req(ts, ids):
    return json.dumps({"timestamp": ts, "input_length": 512 * len(ids), "output_length": 1,
                       "hash_ids": ids})


@pytest.fixture(scope="module")
def chat():
    return chat_trace(ChatWorkload(requests=400, seed=3, rate_per_s=0.5))


# -- traces ---------------------------------------------------------------------------------
def test_load_trace_sorts_by_timestamp_keeping_ties_in_file_order(tmp_path):
    t = load_trace(write(tmp_path, [req(5, [0, 1]), req(0, [0, 2]), "", req(5, [0, 3])]))
    assert [r.hash_ids for r in t.requests] == [(0, 2), (0, 1), (0, 3)]
    assert t.duration_ms == 5
    assert len(load_trace(write(tmp_path, [req(0, [0]), req(1, [1])]), limit=1).requests) == 1


@pytest.mark.parametrize("line,match", [
    ("{not json", r"t.jsonl:1: not JSON"),
    ('{"timestamp": 0}', "missing field 'hash_ids'"),
    ('{"timestamp": -1, "hash_ids": [1]}', "non-negative integers"),
    ('{"timestamp": 0, "hash_ids": [1, "x"]}', "hash_ids must be a list"),
    ("[1, 2]", "a JSON object per line"),
])
def test_bad_trace_lines_name_the_line(tmp_path, line, match):
    with pytest.raises(TraceError, match=match):
        load_trace(write(tmp_path, [line]))


def test_empty_or_missing_trace(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, [""]))
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")


def test_equal_ids_give_equal_tokens_and_keys():
    a, b = block_tokens_of([7, 8], 512), block_tokens_of([7, 9], 512)
    assert (a[:512] == b[:512]).all() and not (a[512:] == b[512:]).all()
    t = Trace((Request(0, 1024, 0, (7, 8)), Request(1, 1024, 0, (7, 9))), "x")
    k = store_keys(t, NS, 512)
    assert k[0][0] == k[1][0] and k[0][1] != k[1][1]


def test_block_tokens_cut_and_join_trace_blocks():
    t = Trace((Request(0, 1536, 0, (1, 2, 3)),), "x")
    assert len(store_keys(t, NS, 256)[0]) == 6
    assert len(store_keys(t, NS, 1024)[0]) == 1  # the last 512 tokens are no full block


# -- simulators -----------------------------------------------------------------------------
def test_lru_by_hand():
    # capacity 2: [a b] miss miss; [a c]: a hits, c evicts b (leaf); [a b]: a hits, b misses
    reqs = [["a", "b"], ["a", "c"], ["a", "b"]]
    r = simulate_policy(reqs, 2, "lru")
    assert (r.hits, r.references, r.evictions) == (2, 6, 2)


def test_bounds_order(chat):
    blocks = store_keys(chat, NS, 512)
    fx = facts(blocks, 512)
    top = unbounded(blocks)
    assert top.hit_ratio == pytest.approx(fx.unbounded_hit_ratio)
    for n in (20, 200):
        bound = simulate_belady(blocks, n).hit_ratio
        for p in ("lru", "reuse"):
            assert simulate_policy(blocks, n, p).hit_ratio <= bound <= top.hit_ratio
    everything = fx.unique_blocks
    assert simulate_policy(blocks, everything, "reuse").hits == top.hits
    assert simulate_belady(blocks, everything).hits == top.hits


# -- through the store ----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["lru", "reuse", "adaptive"])
def test_store_replay_equals_the_simulator(chat, policy):
    blocks = store_keys(chat, NS, 512)
    n = 40
    sim = simulate_policy(blocks, n, policy)
    got = replay(chat, StoreSpec(policy, n * BN), keys=blocks)
    assert got.wrong_blocks == 0
    assert (got.hits, got.references) == (sim.hits, sim.references)
    assert got.tiers[0].name == "warm" and got.tiers[0].hit_blocks == got.hits
    assert got.tiers[0].evictions == sim.evictions


@pytest.mark.parametrize("policy", ["lru", "reuse", "adaptive"])
def test_store_replay_equals_the_simulator_under_second_hit_admission(chat, policy):
    blocks = store_keys(chat, NS, 512)
    for n in (10, 40, 120):
        sim = simulate_policy(blocks, n, policy, admission="second-hit")
        got = replay(chat, StoreSpec(policy, n * BN, admission="second-hit"), keys=blocks)
        assert got.wrong_blocks == 0 and got.label == sim.label == f"{policy}+second-hit"
        assert (got.hits, got.tiers[0].evictions) == (sim.hits, sim.evictions)


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the Mooncake trace is not in ../shared")
def test_mooncake_slice_store_equals_simulator():
    t = load_trace(MOONCAKE, limit=250)
    blocks = store_keys(t, NS, 512)
    n = max(1, facts(blocks, 512).unique_blocks // 20)
    for policy in ("lru", "reuse", "adaptive"):
        for adm in ("always", "second-hit"):
            got = replay(t, StoreSpec(policy, n * BN, admission=adm), keys=blocks)
            sim = simulate_policy(blocks, n, policy, admission=adm)
            assert got.hits == sim.hits and got.wrong_blocks == 0


def test_replay_with_hot_and_disk_tiers(chat, tmp_path):
    got = replay(chat, StoreSpec("reuse", 30 * BN, hot_bytes=10 * BN, disk_bytes=400 * BN,
                                 path=str(tmp_path)))
    names = [t.name for t in got.tiers]
    assert names == ["hot", "warm", "disk"]
    assert got.wrong_blocks == 0
    assert sum(t.hit_blocks for t in got.tiers) == got.hits
    disk = got.tiers[2]
    assert disk.bytes_written > 0 and disk.hit_blocks > 0
    assert list(tmp_path.iterdir()) == []  # the replay's store is removed afterwards


def test_smaller_store_blocks_replay_like_the_simulator(chat):
    short = chat.head(120)
    blocks = store_keys(short, replay_namespace(128).id, 128)
    got = replay(short, StoreSpec("reuse", 100 * replay_layout(128).block_nbytes,
                                  block_tokens=128), keys=blocks)
    assert got.hits == simulate_policy(blocks, 100, "reuse").hits


@pytest.mark.parametrize("family", ["rag", "agentic"])
def test_tuned_adaptive_tier_replays_like_the_simulator(family):
    """A tier big enough to tune (its shadows sample every key and switch scales): the store
    still equals the simulator block for block, evictions included."""
    t = generate(family, 500, seed=5)
    blocks = store_keys(t, NS, 512)
    n = 160
    sim = simulate_policy(blocks, n, "adaptive")
    got = replay(t, StoreSpec("adaptive", n * BN), keys=blocks)
    assert got.wrong_blocks == 0
    assert (got.hits, got.tiers[0].evictions) == (sim.hits, sim.evictions)
    assert sim.evictions > 0


# -- the report -----------------------------------------------------------------------------
def test_report_rows(chat):
    plan = ReplayPlan(capacities=(parse_capacity("5%"), parse_capacity(f"{30 * BN}")))
    seen = []
    rep = run_report(chat.head(150), plan, progress=lambda what, d, t: seen.append(what))
    assert [r.capacity for r in rep.rows] == ["5%", str(30 * BN)]
    row = rep.rows[1]
    assert row.blocks == 30 and row.nbytes == 30 * BN
    assert [s.policy for s in row.simulated] == ["lru", "reuse", "adaptive", "arc", "s3fifo",
                                                 "belady", "unbounded"]
    assert [r.eviction for r in row.replayed] == ["lru", "reuse", "adaptive"]
    for p in ("lru", "reuse", "adaptive"):
        assert row.store(p).hits == row.sim(p).hits
    assert any("store reuse" in w for w in seen)


@pytest.mark.parametrize("text,match", [("0%", "a share must be"), ("x%", "a share must be"),
                                        ("lots", "or a share of the trace's unique")])
def test_bad_capacity(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_capacity(text)


def test_capacity_below_one_block(chat):
    with pytest.raises(ConfigError, match="smaller than one block"):
        run_report(chat.head(10), ReplayPlan(capacities=(parse_capacity("100"),)))


def test_report_baselines_are_simulated_only(chat):
    plan = ReplayPlan(capacities=(parse_capacity("10%"),), policies=("lru",),
                      baselines=("arc",), store=False)
    row = run_report(chat.head(150), plan).rows[0]
    assert [s.policy for s in row.simulated] == ["lru", "arc", "belady", "unbounded"]
    assert row.sim("arc").hit_ratio <= row.sim("belady").hit_ratio
    with pytest.raises(ConfigError, match="unknown baseline"):
        run_report(chat.head(10), ReplayPlan(capacities=(parse_capacity("10%"),),
                                             baselines=("fifo",), store=False))


def test_chat_workload_is_deterministic_and_shares_prefixes():
    a = chat_trace(ChatWorkload(requests=200, seed=1))
    assert a == chat_trace(ChatWorkload(requests=200, seed=1))
    assert a != chat_trace(ChatWorkload(requests=200, seed=2))
    blocks = [r.hash_ids for r in a.requests]
    assert unbounded(blocks).hit_ratio > 0.3
    ts = [r.timestamp_ms for r in a.requests]
    assert ts == sorted(ts)


@pytest.mark.parametrize("policy", ["lru", "reuse", "adaptive"])
@pytest.mark.parametrize("admission", ["always", "second-hit"])
def test_store_replay_with_session_hints_equals_the_simulator(policy, admission):
    # the batch family: batch jobs' prompts branch off their session's last put (probation),
    # chat sessions extend theirs; the store's HintAdmission and the simulator's agree
    t = generate("batch", 500, 3)
    blocks = store_keys(t, NS, 512)
    hints = [session_hint(r) for r in t.requests]
    for n in (30, 150):
        sim = simulate_policy(blocks, n, policy, admission=admission, hints=hints)
        got = replay(t, StoreSpec(policy, n * BN, admission=admission, hints=True), keys=blocks)
        assert got.wrong_blocks == 0 and got.label == sim.label and got.label.endswith("+hints")
        assert (got.hits, got.tiers[0].evictions) == (sim.hits, sim.evictions)


def test_session_hints_keep_a_batch_scan_from_flushing_the_chat_sessions():
    # measured claim of docs/benchmarks.md: on the batch family the hints lift LRU's hit
    # ratio at 5 % (scans and evaluation re-runs go on probation, conversations stay)
    t = generate("batch", 2_000, 5)
    blocks = store_keys(t, NS, 512)
    n = facts(blocks, 512).unique_blocks // 20
    hints = [session_hint(r) for r in t.requests]
    for policy in ("lru", "adaptive"):
        plain = simulate_policy(blocks, n, policy).hit_ratio
        hinted = simulate_policy(blocks, n, policy, hints=hints).hit_ratio
        assert hinted > plain * 1.02, (policy, plain, hinted)


def test_hints_need_sessions_and_are_refused_for_baselines():
    t = generate("batch", 50, 1)
    blocks = store_keys(t, NS, 512)
    with pytest.raises(ConfigError, match="without hints"):
        simulate_policy(blocks, 10, "arc", hints=[None] * len(blocks))
    # a trace without sessions: every hint is None and nothing changes
    chat = chat_trace(ChatWorkload(requests=100, seed=1))
    cb = store_keys(chat, NS, 512)
    assert (simulate_policy(cb, 20, "adaptive", hints=[None] * len(cb)).hits
            == simulate_policy(cb, 20, "adaptive").hits)
