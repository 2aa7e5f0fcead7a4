"""The reuse scale's tuner (kvstore/tiers/tuning.py): its sample, its shadow caches, its
decisions."""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.tiers import tuning
from kvstore.tiers.tuning import LRUShadow, ReuseShadow, ScaleTuner, make_shadow, sample_mask

refs_st = st.lists(st.integers(0, 40), max_size=300)


def test_sample_is_one_in_32_until_the_shadows_would_be_big():
    for slots in (tuning.MIN_SLOTS, 5_000, 32_767):
        assert sample_mask(slots) == 31
    for slots in (32_768, 50_000, 100_000, 262_143):
        rate = sample_mask(slots) + 1
        assert rate > 32 and rate & (rate - 1) == 0  # a power of two: a mask of the last byte
        assert tuning.SHADOW_KEYS <= slots // rate < 2 * tuning.SHADOW_KEYS
    assert sample_mask(10**9) == 255  # one byte decides


def test_tuner_shadows_are_sized_by_the_sample():
    t = ScaleTuner(50_000, 0.0)
    assert t.mask == sample_mask(50_000)
    assert isinstance(t._shadows[0], LRUShadow)
    assert all(isinstance(s, ReuseShadow) for s in t._shadows[1:])
    assert t._shadows[1]._slots == 50_000 // (t.mask + 1)


@settings(max_examples=100, deadline=None)
@given(refs=refs_st, slots=st.integers(1, 12))
def test_lru_shadow_is_an_lru_cache(refs, slots):
    shadow, model = LRUShadow(slots), OrderedDict()
    for k in refs:
        hit = k in model
        if hit:
            model.move_to_end(k)
        else:
            if len(model) >= slots:
                model.popitem(last=False)
            model[k] = None
        assert shadow.refer(k) == hit
    assert list(shadow._lru) == list(model)


@settings(max_examples=100, deadline=None)
@given(refs=refs_st, slots=st.integers(1, 12), scale=st.sampled_from([0.5, 1.0, 4.0]))
def test_reuse_shadow_hits_what_it_holds_and_holds_at_most_its_slots(refs, slots, scale):
    shadow = ReuseShadow(slots, scale, ghosts=2)
    held: set[int] = set()
    for k in refs:
        assert shadow.refer(k) == (k in held)
        held = set(shadow._uses)
        assert k in held and len(held) <= slots
        assert sum(len(d) for d in shadow._lists) == len(held)
        for c, d in enumerate(shadow._lists):  # each key in the list of its use class
            assert all(shadow._uses[x] == c for x in d)
            assert list(d.values()) == sorted(d.values())  # oldest use first
        assert len(shadow._ghost) + len(shadow._ghost_old) <= 2 * slots


def test_reuse_shadow_keeps_a_reused_key_through_a_scan_lru_does_not():
    reuse, lru = make_shadow(8, 1.0), make_shadow(8, 0.0)
    for s in (reuse, lru):
        s.refer("hot")
        s.refer("hot")  # a use
        for i in range(7):  # under one turnover of one-time keys
            s.refer(i)
        s.refer("hot")
        for i in range(7, 20):
            s.refer(i)
    assert reuse.refer("hot") and not lru.refer("hot")


def test_tuner_stays_put_without_a_clear_lead():
    """Every shadow hits alike (a stream that fits them all): no move off the start."""
    t = ScaleTuner(4_096, 0.0)
    for i in range(20_000):
        t.reference(i % 50)
    assert t.scale == 0.0
