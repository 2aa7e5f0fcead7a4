"""The learned (LRB-style) baseline of the replay simulator (kvstore/replay/lrb.py): its order
lists exactly the blocks held, it infers the prefix tree from the store's calls, it labels
its samples from the future (ghosts included), and what it learns pays."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.policy import drive_sim, sim_ops_st

from kvstore.errors import ConfigError
from kvstore.hints import PutHint
from kvstore.replay.baselines import DEFAULT_BASELINES, SIM_ONLY, make_baseline
from kvstore.replay.families import generate
from kvstore.replay.lrb import (
    _F_DEPTH,
    _F_FAN,
    _F_HINT,
    _F_PARENT,
    _F_PLACE,
    _F_RUN,
    FEATURES,
    LRB_CLASSES,
    TREE_FEATURES,
    LRBPolicy,
)
from kvstore.replay.report import ReplayPlan, parse_capacity, run_report
from kvstore.replay.simulate import simulate_belady, simulate_policy


@settings(max_examples=60, deadline=None)
@given(ops=sim_ops_st, slots=st.integers(1, 12), sample=st.integers(0, 8), tail=st.integers(0, 4))
def test_order_lists_exactly_the_keys_held(ops, slots, sample, tail):
    """Whatever the calls, ``victims()`` is every held key once, ``peek()`` its first (the
    same key until the tier changes, though candidates are drawn at random), and a key's
    class stays a use class. Blocks leave leaf first, as the store removes them (a block
    with children by the policy's own inference stays), so an inferred parent is held."""

    def leaf_first(p, held, first):  # the first victim that is no held block's parent
        inner = {p.parent(h) for h in held}
        return next((v for v in ([first] + p.order()) if v not in inner), None)

    def check(p, held):
        for h in held:
            assert 0 <= p.uses_class(h) < LRB_CLASSES
            assert p.parent(h) is None or p.parent(h) in held
        assert len(p.weights) == FEATURES

    drive_sim(LRBPolicy(slots, sample=sample, tail=tail, train_shift=0), ops, leaf_first, check)


def _serve(p: LRBPolicy, chain: list[int], held: set[int]) -> None:
    """One request as the simulator (and the store) calls a policy: the fetch touches the
    held run leaf first, the put touches, inserts root first and touches its new blocks."""
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    if n:
        p.touch(chain[n - 1::-1])
    new = chain[n:]
    if new:
        p.touch(new[::-1])
        for k in new:
            p.insert(k)
            held.add(k)
        p.touch(new[::-1])


def test_it_infers_the_prefix_tree_from_the_calls():
    p = LRBPolicy(100)
    held: set[int] = set()
    _serve(p, [1, 2, 3], held)
    assert [p.parent(k) for k in (1, 2, 3)] == [None, 1, 2]
    _serve(p, [1, 2, 4, 5], held)  # a branch off 2: the fetch found 1, 2
    assert p.parent(4) == 2 and p.parent(5) == 4
    _serve(p, [7, 8], held)  # nothing cached: a new root, not the last put's leaf
    assert p.parent(7) is None and p.parent(8) == 7
    f = dict(zip(TREE_FEATURES, p.features(5)[3:8], strict=True))
    # 5 is the put's leaf (not its first block): known once the put's touch came
    assert f["place"] == _F_PLACE + 2
    assert dict(zip(TREE_FEATURES, p.features(4)[3:8], strict=True))["place"] == _F_PLACE + 1


def test_a_sample_is_labelled_by_its_next_use_ghosts_included():
    p = LRBPolicy(4, horizon=1.0, sample=0, tail=4, train_shift=0)  # horizon: 4 inserts
    for k in range(4):  # four puts of one block each (a touch call between: not a chain)
        p.insert(k)
        p.touch([9])
    victim = p.peek()  # candidates: every key (tail 4), each a pending sample
    assert victim == 0 and p.labels == (0, 0)
    p.remove(0, for_room=True)
    p.insert(0)  # back after eviction within the horizon: a use
    assert p.labels == (0, 1)
    for k in range(10, 20):  # the horizon passes for the others
        p.insert(k)
    p.peek()
    assert p.labels == (3, 1)


def test_it_keeps_a_loop_that_lru_loses_to_a_scan():
    """A loop LRU loses to a scan: the loop's keys come back from the ghost list one class
    up; the model learns that class 0 (the scan) is not asked for again, and keeps them."""
    reqs, new = [], 10**6
    for _ in range(30):
        for i in range(150):
            reqs.append([i])
            reqs.append([new])
            new += 1
    assert simulate_policy(reqs, 200, "lru").hit_ratio == 0.0
    got = simulate_policy(reqs, 200, "lrb").hit_ratio
    assert 0.3 < got <= simulate_belady(reqs, 200).hit_ratio


def test_tree_features_can_be_left_out():
    p = LRBPolicy(10, tree=())
    held: set[int] = set()
    _serve(p, [1, 2, 3], held)
    _serve(p, [1, 2, 3, 4], held)
    firsts = (_F_DEPTH, _F_PLACE, _F_RUN, _F_PARENT, _F_FAN)
    assert p.features(4)[3:8] == firsts  # every tree feature at its first bin
    q = LRBPolicy(10)
    held = set()
    _serve(q, [1, 2, 3], held)
    _serve(q, [1, 2, 3, 4], held)
    assert q.features(4)[3:8] != firsts
    with pytest.raises(ValueError):
        LRBPolicy(10, tree=("color",))


def test_a_put_hinted_to_probation_is_a_feature_not_a_place():
    """The session hint's verdict (a put that branched off its session's last one) is what
    the model learns from; the block joins the order as any other."""
    p = LRBPolicy(10)
    p.insert(1)
    p.touch([1])
    p.insert(2, probation=True)
    p.touch([2])
    assert _F_HINT not in p.features(1) and p.features(2)[-1] == _F_HINT
    assert sorted(p.order()) == [1, 2]


def test_the_simulator_passes_it_hints():
    reqs = [[1, 2], [1, 3], [1, 4], [1, 2]]
    hints = [PutHint(session="a")] * 4
    with_hints = simulate_policy(reqs, 3, "lrb", hints=hints)
    assert with_hints.hints and with_hints.references == 8
    with pytest.raises(ConfigError):
        simulate_policy(reqs, 3, "lhd", hints=hints)


def test_a_report_runs_it_in_each_hint_mode_and_the_others_without():
    trace = generate("batch", 200, 1)
    plan = ReplayPlan(capacities=(parse_capacity("5%"),), policies=("lru",), store=False,
                      baselines=("lrb", "arc"), hints=(False, True))
    row = run_report(trace, plan).rows[0]
    labels = [s.label for s in row.simulated]
    assert {"lrb", "lrb+hints", "arc"} <= set(labels) and "arc+hints" not in labels
    assert row.sim("lrb+hints").hints and not row.sim("lrb").hints


def test_it_is_a_baseline_on_request_only():
    assert "lrb" in SIM_ONLY and "lrb" not in DEFAULT_BASELINES
    assert isinstance(make_baseline("lrb", 8), LRBPolicy)


chains_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1,
                     max_size=80)


@settings(max_examples=40, deadline=None)
@given(paths=chains_st, cap=st.integers(1, 12), hinted=st.booleans())
def test_in_the_simulator_it_never_beats_belady_nor_loses_a_put(paths, cap, hinted):
    """Requests along a small prefix tree (a block id is its path from the root, so equal ids
    are equal prefixes): whatever the model learns, the simulator's rules hold it (leaf
    first, every put kept while a leaf can go) and it hits no more than the farthest-next-use
    bound."""
    reqs = [[tuple(p[:i + 1]) for i in range(len(p))] for p in paths]
    hints = [PutHint(session=str(len(p) % 2)) for p in paths] if hinted else None
    got = simulate_policy(reqs, cap, "lrb", hints=hints)
    assert got.hits <= simulate_belady(reqs, cap).hits
    # a put drops blocks only when nothing else can go: its own chain fills the tier
    assert got.dropped == 0 or max(map(len, reqs)) > cap
