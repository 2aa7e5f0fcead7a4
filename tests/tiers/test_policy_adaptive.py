"""The adaptive eviction policy (the default): one LRU list per use class, ranks computed at
eviction time, the scale chosen by shadows; and the simulator's baselines (ARC, S3-FIFO)."""

import pytest
from hypothesis import given, settings
from support.policy import drive, ops_st

from kvstore.replay.baselines import ARCPolicy, S3FIFOPolicy
from kvstore.replay.families import FAMILIES, generate, write_trace
from kvstore.replay.simulate import simulate_belady, simulate_policy
from kvstore.replay.trace import load_trace
from kvstore.tiers.adaptive_policy import AdaptivePolicy
from kvstore.tiers.policy import DEFAULT_EVICTION, LRUPolicy, make_policy
from kvstore.tiers.tuning import adaptive_mask


def test_adaptive_is_the_default():
    assert DEFAULT_EVICTION == "adaptive"
    assert make_policy("adaptive", 1000).name == "adaptive"


def test_scale_zero_evicts_exactly_as_lru():
    a, lru = AdaptivePolicy(10, scale=0.0, tune=False), LRUPolicy()
    ops = [("request", [0, 1, 2]), ("request", [0, 1]), ("request", [3, 1, 2]),
           ("request", [0, 2, 2, 1]), ("evict", [0]), ("request", [3, 3])]
    assert drive(a, ops, slots=5) == drive(lru, ops, slots=5)


def test_a_used_block_outlives_newer_unused_ones_at_scale_one():
    p = AdaptivePolicy(4, scale=1.0, tune=False)
    p.insert("a")
    p.touch(["a"])  # the insert's own touch: no use
    p.touch(["x"])
    p.touch(["a"])  # a use
    for k in "bcd":
        p.insert(k)
    assert p.uses("a") == 1
    assert p.peek() == "b" and p.order()[-1] == "a"


def test_a_new_scale_applies_to_every_block_at_once():
    p = AdaptivePolicy(4, scale=4.0, tune=False)
    p.insert("a")
    p.touch(["x"])
    p.touch(["a"])
    p.insert("b")
    assert p.peek() == "b"
    p._off = [0] * 4  # what the tuner's switch to LRU does
    assert p.peek() == "a"


def test_a_parent_joins_its_childs_class():
    p = AdaptivePolicy(8, scale=1.0, tune=False)
    p.insert("child")
    p.touch(["y"])
    for _ in range(3):
        p.touch(["child"])
        p.touch(["y"])
    p.insert("parent")
    p.touch(["child", "parent"])  # leaf first
    p.touch(["y"])
    p.touch(["child", "parent"])
    assert p.uses("parent") >= p.uses("child")
    order = p.order()
    assert order.index("child") < order.index("parent")


def test_ghost_uses_come_back():
    p = AdaptivePolicy(2, scale=1.0, tune=False)
    p.insert("a")
    p.touch(["x"])
    p.touch(["a"])
    p.remove("a", for_room=True)
    p.insert("a")
    assert p.uses("a") == 2


def test_second_hit_candidate_starts_only_unknown_keys_on_probation():
    """When the shadows pick a second-hit candidate, a new key the ghost list does not know
    starts at the victim end; one it knows, and a put hinted to start with uses, do not."""
    p = AdaptivePolicy(8, scale=0.0, tune=False, probation=True)
    p.insert("seen")
    p.touch(["seen"])
    p.remove("seen", for_room=True)  # now in the ghost list
    p.insert("old")
    p.touch(["old"])
    p._second = True  # what the tuner's choice of (scale, probation=True) sets
    for k, uses in (("new", 0), ("seen", 0), ("hinted", 2)):
        p.insert(k, uses=uses)
        p.touch([k])  # the put's own touch
    assert p.order()[0] == "new" and set(p.order()[1:]) == {"old", "seen", "hinted"}
    p.touch(["x"])
    p.touch(["new"])  # its second use lifts it (behind "old", used before it)
    order = p.order()
    assert order.index("old") < order.index("new")
    p._second = False
    p.insert("later")
    p.touch(["later"])
    assert p.order()[-1] == "later"  # off again: a new key joins at the newest end


def test_tuned_policy_offers_second_hit_candidates_only_with_probation():
    from kvstore.tiers import tuning

    with_prob = AdaptivePolicy(4_096, probation=True)._tuner
    without = AdaptivePolicy(4_096)._tuner
    assert with_prob._cands == tuning.ADAPTIVE_CANDIDATES
    assert any(p for _, p in tuning.ADAPTIVE_CANDIDATES)
    assert without._cands == tuning.SCALE_CANDIDATES


def test_probation_blocks_go_first_until_touched_again():
    p = AdaptivePolicy(8, scale=1.0, tune=False, probation=True)
    p.insert("old")
    p.insert("new", probation=True)
    p.touch(["new"])  # its insert's own touch: stays on probation
    assert p.peek() == "new"
    p.touch(["z"])
    p.touch(["new"])  # lifted
    assert p.peek() == "old"
    with pytest.raises(TypeError):
        AdaptivePolicy(8).insert("k", probation=True)


def test_small_tiers_sample_every_key_big_ones_thin():
    assert adaptive_mask(200) == 0
    assert adaptive_mask(2_000) == 7
    assert adaptive_mask(50_000) == 255
    assert adaptive_mask(10**8) == 255


@settings(max_examples=80, deadline=None)
@given(ops=ops_st)
@pytest.mark.parametrize("make", [lambda: AdaptivePolicy(6, tune=False),
                                  lambda: AdaptivePolicy(6, scale=4.0, tune=False),
                                  lambda: AdaptivePolicy(600),
                                  lambda: ARCPolicy(6), lambda: S3FIFOPolicy(6)])
def test_policies_list_exactly_the_held_blocks_and_are_deterministic(make, ops):
    assert drive(make(), ops) == drive(make(), ops)


# -- the trace families ----------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_are_deterministic_per_seed_and_share_prefixes(family):
    a = generate(family, 300, seed=1)
    assert a == generate(family, 300, seed=1)
    assert a != generate(family, 300, seed=2)
    assert len(a.requests) == 300
    ts = [r.timestamp_ms for r in a.requests]
    assert ts == sorted(ts)
    blocks = [r.hash_ids for r in a.requests]
    seen, shared = set(), 0
    for b in blocks:
        shared += b[0] in seen
        seen.update(b)
    assert shared > 30  # requests that start on a prefix seen before


def test_a_written_family_loads_back_with_its_sessions(tmp_path):
    t = generate("agentic", 120, seed=3)
    p = tmp_path / "a.jsonl"
    write_trace(t, p)
    back = load_trace(p)
    assert [r.hash_ids for r in back.requests] == [r.hash_ids for r in t.requests]
    assert [r.session for r in back.requests] == [r.session for r in t.requests]
    assert len({r.session for r in back.requests}) > 1


@pytest.mark.parametrize("family", ["rag", "batch"])
def test_adaptive_is_not_worse_than_lru_on_a_family_slice(family):
    blocks = [r.hash_ids for r in generate(family, 800, seed=11).requests]
    cap = 300
    lru = simulate_policy(blocks, cap, "lru").hit_ratio
    ours = simulate_policy(blocks, cap, "adaptive").hit_ratio
    for b in ("arc", "s3fifo", "adaptive"):
        assert simulate_policy(blocks, cap, b).hit_ratio <= simulate_belady(blocks, cap).hit_ratio
    assert ours >= 0.99 * lru


def test_stats_name_each_memory_tiers_policy_across_the_wire():
    import torch

    from kvstore import KVLayout, open_store
    from kvstore.wire.stats import store_stats_from_wire, store_stats_to_wire

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, block_tokens=2)
    with open_store(None, layout=lay, model_id="pol", device="cpu",
                    gpu_capacity=4 * lay.block_nbytes, cpu_capacity=8 * lay.block_nbytes,
                    eviction={"hot": "lru", "warm": "adaptive"}) as s:
        st = s.stats()
    assert [(t.name, t.policy) for t in st.tiers] == [("hot", "lru"), ("warm", "adaptive")]
    wire = store_stats_to_wire(st)
    assert [t.policy for t in store_stats_from_wire(wire).tiers] == ["lru", "adaptive"]
    states = [t.policy_state for t in st.tiers]
    assert states == ["", "scale 1, fixed"]  # LRU says nothing; an 8-slot tier is not tuned
    assert [t.policy_state for t in store_stats_from_wire(wire).tiers] == states
    del wire["tier_policies"]  # an older daemon's reply
    del wire["tier_policy_states"]
    assert [t.policy for t in store_stats_from_wire(wire).tiers] == ["", ""]
    assert [t.policy_state for t in store_stats_from_wire(wire).tiers] == ["", ""]


def test_policy_state_names_the_tuners_choice():
    p = AdaptivePolicy(4_096, probation=True)
    assert p.state() == "scale 0"
    p._scale, p._second = 2.0, True
    assert p.state() == "scale 2, second-hit"
    assert AdaptivePolicy(8, tune=False).state() == "scale 1, fixed"
    assert LRUPolicy().state() == ""
