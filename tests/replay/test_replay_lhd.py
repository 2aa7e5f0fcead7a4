"""The LHD-style baseline of the replay simulator (kvstore/replay/lhd.py): its order lists
exactly the blocks held, the densities it learns, and that it learns past eviction."""

from hypothesis import given, settings
from hypothesis import strategies as st
from support.policy import drive_sim, sim_ops_st

from kvstore.replay.baselines import DEFAULT_BASELINES, SIM_ONLY, make_baseline
from kvstore.replay.lhd import LHD_CLASSES, LHDPolicy, hit_density
from kvstore.replay.simulate import simulate_belady, simulate_policy


def test_hit_density_is_hits_past_an_age_per_lifetime_to_come():
    # two lifetimes end by a hit at age 1, two end unused at age 0
    assert hit_density([0.0, 2.0], [2.0, 0.0]) == [2.0 / 6.0, 1.0]
    assert hit_density([0.0, 0.0], [1.0, 1.0]) == [0.0, 0.0]  # never hit
    assert hit_density([0.0, 0.0], [0.0, 0.0]) == [0.0, 0.0]  # no data


@settings(max_examples=60, deadline=None)
@given(ops=sim_ops_st, slots=st.integers(1, 12))
def test_order_lists_exactly_the_keys_held(ops, slots):
    """Whatever the calls, ``victims()`` is every held key once, ``peek()`` its first, and a
    key's class stays a use class."""

    def check(p, held):
        assert all(0 <= p.uses_class(h) < LHD_CLASSES for h in held)
        assert all(d >= 0 for c in range(LHD_CLASSES) for d in p.density(c))

    drive_sim(LHDPolicy(slots, bins=4, span=2), ops, lambda p, held, first: first, check)


def test_a_key_back_from_the_ghost_list_is_a_hit_at_its_age_one_class_up():
    p = LHDPolicy(64, bins=64)  # one insert per age bin
    for k in range(10):
        p.insert(k)
    p.remove(0, for_room=True)
    p.insert(0)  # asked for again while remembered, 10 inserts after its last use
    assert p.uses_class(0) == 1
    hits, ends = p.lifetimes(0)
    assert hits[10] == 1.0 and sum(hits) == 1.0 and sum(ends) == 0.0
    p.touch([3])  # its insert's own touch (no use), at clock 11
    p.insert(20)
    p.insert(21)
    p.touch([5])
    p.touch([3])  # a use in a later call: a hit in the tier, 2 inserts on
    assert p.lifetimes(0)[0][2] == 1.0 and p.uses_class(3) == 1
    p.remove(1, for_room=False)  # removed on request: forgotten
    p.insert(1)
    assert p.uses_class(1) == 0


def _loop_and_scan(hot: int, cycles: int) -> list[list[int]]:
    """A loop over ``hot`` keys, a new (never again used) key after each: LRU's reuse
    distance is 2 x hot."""
    reqs, new = [], 10**6
    for _ in range(cycles):
        for i in range(hot):
            reqs.append([i])
            reqs.append([new])
            new += 1
    return reqs


def test_it_keeps_a_loop_that_lru_loses_to_a_scan():
    """LRU holds fewer keys than the loop's reuse distance and never hits; the loop's keys,
    back from the ghost list, rank by their own class's density and stay."""
    reqs = _loop_and_scan(150, 30)
    lru = simulate_policy(reqs, 200, "lru").hit_ratio
    lhd = simulate_policy(reqs, 200, "lhd").hit_ratio
    assert lru == 0.0
    assert lhd > 0.3  # of at most 0.5: every other reference is a one-time key
    assert lhd <= simulate_belady(reqs, 200).hit_ratio


def test_it_is_a_baseline_on_request_only():
    assert "lhd" in SIM_ONLY and "lhd" not in DEFAULT_BASELINES
    assert isinstance(make_baseline("lhd", 8), LHDPolicy)
