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


# -- probation shadows and the adaptive policy's guarded choice ------------------------------------


def test_probation_shadow_evicts_new_keys_first_and_admits_returning_ones():
    s = ReuseShadow(3, 0.0, probation=True, ghosts=4)
    for k in "ab":
        assert not s.refer(k)
    assert s.refer("a")  # its second use lifts "a" off probation
    assert not s.refer("c") and not s.refer("d")  # full: "b" (still on probation) goes first
    assert s._uses.get("b") is None and s._uses["a"] == 1
    assert not s.refer("b")  # back from the ghost list: joins normally, not on probation
    assert s._uses["b"] == 1 and "b" not in s._prob


def test_make_shadow_gives_lru_only_without_probation():
    assert isinstance(make_shadow(8, 0.0), LRUShadow)
    p = make_shadow(8, 0.0, True)
    assert isinstance(p, ReuseShadow) and p._prob is not None


class Scripted:
    """A shadow whose hits are given: ``hit(key)`` decides."""

    def __init__(self, hit):
        self.hit = hit

    def refer(self, key):
        return self.hit(key)


def _guarded(hits_of, n_cands=3):
    cands = tuning.SCALE_CANDIDATES[:n_cands - 1] + ((0.0, True),)
    shadows = iter(hits_of)
    return ScaleTuner(4_096, 0.0, lambda n, s, p: Scripted(next(shadows)),
                      guard=tuning.ADAPTIVE_GUARD, candidates=cands, mask=0)


def test_guarded_tuner_takes_a_shadow_only_on_evidence():
    """A shadow that leads by a few hits (as a small sample does by chance) is not taken; one
    whose wins over LRU's are many standard deviations beyond its losses is, at once."""
    never = lambda k: False  # noqa: E731
    # wins 1.1 % of the references, loses 1 %: it hits more, but not beyond chance
    lucky = lambda k: k % 100 == 0 or k % 1000 == 555  # noqa: E731
    t = _guarded([lambda k: k % 100 == 1, lucky, never])
    for i in range(t._period * 3):
        t.reference(i)
    assert t._won[1] > t._lost[1] > 0
    assert (t.scale, t.probation) == (0.0, False)
    t = _guarded([never, never, lambda k: k % 3 == 0])  # wins a third of the references
    for i in range(t._period):
        t.reference(i)
    assert (t.scale, t.probation) == (0.0, True)


def test_guarded_tuner_falls_back_to_lru_when_the_evidence_fades():
    phase = {"lru_wins": False}
    lru = lambda k: phase["lru_wins"]  # noqa: E731
    other = lambda k: not phase["lru_wins"]  # noqa: E731
    t = _guarded([lru, lambda k: False, other])
    for i in range(t._period * 2):
        t.reference(i)
    assert t.probation
    phase["lru_wins"] = True  # the probation shadow now loses every reference to LRU's
    for i in range(t._period * 3):
        t.reference(i)
    assert (t.scale, t.probation) == (0.0, False)


def test_candidates_must_start_with_lru():
    import pytest

    with pytest.raises(ValueError, match="LRU"):
        ScaleTuner(4_096, 0.0, candidates=((1.0, False),))
