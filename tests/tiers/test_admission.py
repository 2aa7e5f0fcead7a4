"""Memory-tier admission (kvstore/tiers/admission.py): the doorkeeper, probation in each
eviction policy, ``open_store(admission=...)`` per tier, and scan resistance through a store.
The store-level invariants under second-hit admission are also checked by the stateful
machines of tests/tiers/test_policy_properties.py (``TestPolicyStore_*_second_hit``)."""

import pytest
import torch
from hypothesis import given, settings
from support.policy import BN, LAY, drive, kv_for, ops_st

from kvstore import open_store
from kvstore.errors import ConfigError
from kvstore.store.config import resolve_admission
from kvstore.tiers.admission import (
    ADMISSIONS,
    DOORKEEPER_PER_SLOT,
    PROBATION,
    AlwaysAdmit,
    SecondHitAdmit,
    make_admission,
)
from kvstore.tiers.memory import MemoryTier
from kvstore.tiers.policy import EVICTIONS, LRUPolicy, ProbationLRU, make_policy
from kvstore.tiers.reuse_policy import ReusePolicy


# -- the doorkeeper ----------------------------------------------------------------------------
def test_second_hit_admits_a_key_seen_lately():
    d = SecondHitAdmit(10)
    assert not d.admit("a")
    assert d.admit("a")
    d.evicted("b")  # evicted: seen, so its next insert is normal
    assert d.admit("b")
    assert not d.admit("c")


def test_doorkeeper_is_bounded_and_forgets_the_oldest_generation():
    d = SecondHitAdmit(10)  # two generations of 20 keys
    cap = DOORKEEPER_PER_SLOT * 10 // 2
    for i in range(1000):
        d.admit(i)
        assert len(d) < 2 * cap
    assert d.admit(999) and not d.admit(0)


def test_make_admission():
    assert isinstance(make_admission("always", 8), AlwaysAdmit)
    assert isinstance(make_admission("second-hit", 8), SecondHitAdmit)
    with pytest.raises(ConfigError, match="'always', 'second-hit'"):
        make_admission("third-hit", 8)


# -- probation in the policies -------------------------------------------------------------------
@pytest.mark.parametrize("make", [ProbationLRU, lambda: ReusePolicy(100, tune=False)])
def test_probation_survives_the_inserts_own_touch_and_the_next_touch_lifts_it(make):
    p = make()
    for k in ["a", "b", "c"]:
        p.insert(k)
    p.touch(["c", "b", "a"])
    p.touch([])  # a later touch call: a use of the chain's blocks would count now
    for k in ["x", "y"]:  # a new chain x -> y, neither seen by the tier
        p.insert(k, probation=True)
    assert p.order()[:2] in (["x", "y"], ["y", "x"])  # at the victim end at once
    p.touch(["y", "x"])  # the put's own touch after its inserts
    assert p.order()[:2] == ["y", "x"]  # still first, the chain's leaf first
    p.touch(["z"])  # another call: not these keys, they stay on probation
    assert p.order()[:2] == ["y", "x"]
    p.touch(["y", "x"])  # used again: lifted like any touched block
    assert p.order()[-2:] == ["y", "x"]
    assert sorted(p.order()) == ["a", "b", "c", "x", "y"]


def test_probation_of_a_republished_key_is_ignored():
    for p in (ProbationLRU(), ReusePolicy(100, tune=False)):
        p.insert("a")
        p.insert("b")
        p.touch(["b", "a"])
        p.insert("b", probation=True)  # held: republished under another slot
        p.touch(["b"])
        assert p.order()[-1] == "b"


def test_reuse_key_back_from_the_ghost_list_is_not_on_probation():
    p = ReusePolicy(4, tune=False)
    p.insert("g")
    p.touch(["g"])
    p.touch([])
    p.touch(["g"])  # one use
    p.remove("g", for_room=True)  # into the ghost list with it
    p.insert("n")
    p.touch(["n"])
    p.insert("g", probation=True)
    p.touch(["g"])
    assert p.uses("g") == 2 and p.order()[-1] == "g"


def test_removed_probation_keys_are_forgotten():
    for p in (ProbationLRU(), ReusePolicy(100, tune=False)):
        p.insert("a", probation=True)
        p.remove("a", for_room=True)
        p.insert("a")  # back normally before any touch: no stale probation for it
        p.insert("b")
        p.touch(["b"])
        p.touch(["a"])
        assert p.order() == ["b", "a"]


class CountingTuner:
    """Stands in for a ReusePolicy's ScaleTuner: records what the policy samples."""

    def __init__(self, scale, mask):
        self.scale, self.mask, self.refs = scale, mask, []
        self.probation = False

    def reference(self, key):
        self.refs.append(key)


def test_probation_keeps_the_tuners_sampling():
    """A probation insert is a miss of the tier, the use that lifts it a hit, the settling
    of the insert's own touch neither (as without probation)."""
    def run(probation):
        p = ReusePolicy(600)
        p._tuner = tuner = CountingTuner(p.scale, 0)
        p._mask = 0  # every key sampled
        for k in ["a", "b"]:
            p.insert(k, probation=probation)
        p.touch(["b", "a"])  # the insert's own touch
        p.touch(["z"])
        p.touch(["b", "a"])  # a use of both
        return tuner.refs

    assert run(True) == run(False) == ["a", "b", "b", "a"]


def test_always_consults_no_doorkeeper_and_unhinted_puts_never_go_on_probation():
    t = MemoryTier("warm", LAY, 4 * BN, torch.device("cpu"), eviction="lru")
    # the policy takes probation (a put's hint may ask for it), the tier has no doorkeeper
    assert t.admission is None and isinstance(t.policy, ProbationLRU)
    for i in range(3):
        t.insert(bytes([i]) * 32, t.allocate(1)[0])
    assert not t.policy._prob and t.lru_order() == [bytes([i]) * 32 for i in range(3)]
    t.insert(b"h" * 32, t.allocate(1)[0], start=PROBATION)  # a hinted put: the victim end
    assert t.lru_order()[0] == b"h" * 32
    with pytest.raises(TypeError, match="probation=True"):
        LRUPolicy().insert(b"k", probation=True)  # a policy without probation: not ignored
    t2 = MemoryTier("warm", LAY, 4 * BN, torch.device("cpu"), admission="second-hit")
    assert isinstance(t2.admission, SecondHitAdmit) and isinstance(t2.policy, ProbationLRU)


# -- the policies alone under the doorkeeper: a property test ----------------------------------------


@settings(max_examples=80, deadline=None)
@given(ops=ops_st)
@pytest.mark.parametrize("name", EVICTIONS)
def test_probation_keeps_the_policy_exact_bounded_and_deterministic(name, ops):
    def run():
        return drive(make_policy(name, 6, probation=True), ops, door=SecondHitAdmit(6))

    assert run() == run()


# -- open_store(admission=) ----------------------------------------------------------------------
def test_resolve_admission():
    assert resolve_admission("second-hit") == ("always", "always", "second-hit")
    assert resolve_admission({"warm": "second-hit"}) == ("always", "second-hit", "always")
    assert resolve_admission({"hot": "second-hit", "disk": "second-hit"}) == (
        "second-hit", "always", "second-hit")


@pytest.mark.parametrize("admission, match", [
    ({"ssd": "always"}, r"\['ssd'\].*'hot', 'warm', 'disk'"),
    ({"warm": "sometimes"}, r"warm tier must be one of 'always', 'second-hit', got 'sometimes'"),
    ("sometimes", r"disk tier must be one of 'always', 'second-hit'"),
    ({"hot": 2}, r"hot tier must be one of"),
    (["warm"], r"a mapping of tier to name, got list"),
])
def test_bad_admission(admission, match):
    with pytest.raises(ConfigError, match=match):
        resolve_admission(admission)
    with pytest.raises(ConfigError, match=match):
        open_store(None, layout=LAY, model_id="adm", device="cpu", admission=admission)


def test_store_config_per_tier():
    with open_store(None, layout=LAY, model_id="adm", device="cpu", gpu_capacity=4 * BN,
                    cpu_capacity=4 * BN, admission={"warm": "second-hit"}) as s:
        c = s.state.config
        assert (c.hot_admission, c.warm_admission, c.admission) == (
            "always", "second-hit", "always")
        assert s.state.hot.admission is None and s.state.warm.admission is not None
    assert set(ADMISSIONS) == {"always", "second-hit"}


@pytest.mark.parametrize("eviction", EVICTIONS)
@pytest.mark.parametrize("admission", ADMISSIONS)
def test_a_one_time_scan_does_not_push_out_a_block_used_twice(eviction, admission):
    """A chain put and then fetched (used twice), then a scan of single-use prompts bigger
    than the tier: under second-hit the scan goes through the victim end and the chain stays;
    under always the scan pushes it out."""
    with open_store(None, layout=LAY, model_id="scan", device="cpu", cpu_capacity=8 * BN,
                    eviction=eviction, admission={"warm": admission}) as s:
        hot = s.block_keys([1, 2, 3, 4])  # 2 blocks
        s.put(hot, kv_for(hot)).wait()
        assert s.fetch(hot).wait().shape[0] == 2  # its second use
        for i in range(12):  # 24 blocks, used once each
            scan = s.block_keys([100 + i, 7, 8, 9])
            got = s.fetch(scan).wait().shape[0]
            assert got == 0
            s.put(scan, kv_for(scan)).wait()
        kept = s.lookup(hot)
        if admission == "second-hit":
            assert kept == 2
            got = s.fetch(hot).wait()
            assert torch.equal(got.view(torch.int16), kv_for(hot).view(torch.int16))
        else:
            assert kept == 0
        assert s.stats().tier("warm").blocks <= 8
