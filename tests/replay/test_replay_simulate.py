"""The offline simulators (kvstore/replay/simulate.py) and what they show of the default
eviction policy on the second workload, a synthetic multi-turn chat."""

import pytest

from kvstore.replay.simulate import simulate_belady, simulate_policy, unbounded
from kvstore.replay.workloads import ChatWorkload, chat_trace
from kvstore.tiers.policy import DEFAULT_EVICTION
from kvstore.tiers.tuning import MIN_SLOTS


@pytest.fixture(scope="module")
def chat():
    return [list(r.hash_ids) for r in chat_trace(ChatWorkload(requests=4_000)).requests]


def _unique(reqs):
    return len({b for r in reqs for b in r})


@pytest.mark.parametrize("share", [0.05, 0.10])
def test_default_does_not_lose_to_lru_on_chat(chat, share):
    """Regression (issue 18): the tuned default lost 1-2 % to LRU on chat at 5 % and 10 %.
    Uses predict little there; the tier must stay (near enough) LRU."""
    cap = int(_unique(chat) * share)
    assert cap >= MIN_SLOTS  # a tuned tier
    ours = simulate_policy(chat, cap, DEFAULT_EVICTION)
    lru = simulate_policy(chat, cap, "lru")
    assert ours.hit_ratio >= lru.hit_ratio
    assert ours.references == lru.references and ours.dropped == lru.dropped == 0


def test_policies_sit_between_nothing_and_the_bounds(chat):
    cap = int(_unique(chat) * 0.05)
    top = unbounded(chat).hit_ratio
    bound = simulate_belady(chat, cap).hit_ratio
    for name in ("lru", DEFAULT_EVICTION):
        r = simulate_policy(chat, cap, name)
        assert 0 < r.hit_ratio <= bound <= top
        assert r.evictions > 0
