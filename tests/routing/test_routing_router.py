"""Router and policies: Preble's exploit/explore within a load band, round-robin, rendezvous
hashing of the first blocks; token ids keyed like the engines key them."""

import pytest
import torch

from kvstore import KVLayout
from kvstore.errors import ConfigError
from kvstore.events import BlockStored
from kvstore.keys import block_keys
from kvstore.namespace import Namespace
from kvstore.routing import FirstBlocksHash, PrefixAware, PrefixIndex, RoundRobin, Router
from kvstore.routing.loads import LoadTracker
from kvstore.routing.policies import EXPLOIT, EXPLORE, make_policy

E = ("a", "b", "c", "d")
KEYS = [bytes([i]) * 32 for i in range(10)]


def choose(policy, cached, loads, n=10):
    return policy.choose(KEYS[:n], E, cached, loads)


def test_prefix_policy_exploits_the_longest_prefix():
    p = PrefixAware(16)
    c = choose(p, [2, 8, 8, 0], [100, 100, 50, 100])
    assert (c.index, c.mode) == (2, EXPLOIT)  # longest prefix, least loaded of the two


def test_prefix_policy_explores_when_little_is_cached():
    p = PrefixAware(16)
    c = choose(p, [1, 1, 1, 1], [300, 100, 200, 250])
    assert (c.index, c.mode) == (1, EXPLORE)  # nothing worth it: the least loaded
    c = choose(p, [3, 0, 0, 0], [100, 100, 100, 100])
    assert (c.index, c.mode) == (0, EXPLORE)  # a partial hit is still the least work


def test_prefix_policy_keeps_the_load_band():
    p = PrefixAware(16, imbalance=0.1)
    # the holder is loaded past 1.1 x the mean: the request goes where the band allows
    c = choose(p, [9, 2, 0, 0], [200, 100, 100, 100], n=9)
    assert c.index == 1
    c = choose(p, [9, 2, 0, 0], [110, 100, 100, 100], n=9)  # within 1.1 x the mean
    assert (c.index, c.mode) == (0, EXPLOIT)


def test_prefix_policy_sends_what_nobody_holds_to_its_home_within_the_band():
    p, h = PrefixAware(16, imbalance=0.1, home_blocks=2), FirstBlocksHash(blocks=2)
    prompts = [[bytes([i, j]) * 16 for j in range(6)] for i in range(64)]
    homes = [h.choose(k, E, (), ()).index for k in prompts]
    assert len(set(homes)) == 4
    for k, home in zip(prompts, homes, strict=True):
        c = p.choose(k, E, [0] * 4, [0.0] * 4)
        assert (c.index, c.mode) == (home, EXPLORE)  # the same head, the same engine
        loads = [0.0] * 4
        loads[home] = 10_000.0  # its home is overloaded: the home among the others
        c = p.choose(k, E, [0] * 4, loads)
        rest = tuple(e for i, e in enumerate(E) if i != home)
        assert E[c.index] == rest[h.choose(k, rest, (), ()).index]


def test_the_home_is_never_an_engine_the_band_passed_over():
    # regression: engine 2 holds 10 of 15 blocks but is past the band; the home rule must
    # not bring it back (it did, through a band recomputed without the cached blocks)
    p = PrefixAware(512, imbalance=0.2)
    keys = [bytes([11, i]) * 16 for i in range(15)]  # its home over all four is engine 2
    loads = [94245.0, 94782.0, 157350.0, 156048.0]
    c = p.choose(keys, E, [0, 0, 10, 0], loads)
    assert c.index != 2 and c.mode == EXPLORE


def test_round_robin_cycles():
    p = RoundRobin()
    assert [choose(p, [0] * 4, [0] * 4).index for _ in range(6)] == [0, 1, 2, 3, 0, 1]


def test_hash_policy_is_sticky_and_moves_only_a_leaving_engines_share():
    p = FirstBlocksHash(blocks=2)
    prompts = [[bytes([i, j]) * 16 for j in range(5)] for i in range(200)]
    before = {i: E[p.choose(k, E, (), ()).index] for i, k in enumerate(prompts)}
    assert len(set(before.values())) == 4  # spread
    # the first two blocks decide: what follows does not
    assert all(E[p.choose(k[:2] + [b"z" * 32], E, (), ()).index] == before[i]
               for i, k in enumerate(prompts))
    rest = ("a", "b", "d")
    after = {i: rest[p.choose(k, rest, (), ()).index] for i, k in enumerate(prompts)}
    assert all(after[i] == before[i] for i in before if before[i] != "c")
    assert p.choose([7, 8], E, (), ()).index in range(4)  # vLLM's int hashes too


def test_policy_arguments():
    for bad in (lambda: PrefixAware(0), lambda: PrefixAware(16, imbalance=-1),
                lambda: FirstBlocksHash(0), lambda: make_policy("random")):
        with pytest.raises(ConfigError):
            bad()


def test_load_tracker_window():
    t = LoadTracker(window_s=10)
    t.add("a", 100, now=0)
    t.add("b", 50, now=5)
    assert t.loads(["a", "b", "c"], now=9) == [100, 50, 0]
    assert t.loads(["a", "b"], now=12) == [0, 50]
    assert t.loads(["a", "b"], now=16) == [0, 0]


LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, block_tokens=4)
NS = Namespace.create("m", LAYOUT)


def test_router_routes_token_ids_by_what_the_index_holds():
    idx = PrefixIndex()
    for e in E:
        idx.add_engine(e)
    tokens = list(range(40))
    keys = block_keys(NS.id, tokens, 4)
    idx.apply("c", [BlockStored(tuple(keys[:8]), None, (), 4, "CPU")])
    idx.apply("a", [BlockStored(tuple(keys[:3]), None, (), 4, "CPU")])
    r = Router(E, idx, namespace=NS)
    route = r.route(tokens)
    assert (route.engine, route.mode, route.blocks, route.cached_blocks,
            route.best_cached_blocks) == ("c", EXPLOIT, 10, 8, 8)
    assert r.route(keys) == route  # keys or tokens: the same decision
    assert r.route(keys, loads={"c": 1e9}).engine == "a"  # c overloaded: a's 3 blocks
    # with a salt the keys differ: nobody holds them
    assert r.route(tokens, salt="tenant").best_cached_blocks == 0
    assert r.tracker.loads(list(E)) != [0.0] * 4  # its own record of the work it sent


def test_router_candidates_follow_liveness():
    idx = PrefixIndex()
    for e in E:
        idx.add_engine(e)
    idx.apply("c", [BlockStored(tuple(KEYS[:8]), None, (), 4, "CPU")])
    alive = ["a", "b"]
    r = Router(E, idx, live=lambda: alive)
    assert r.route(KEYS).engine in ("a", "b")
    alive[:] = []
    assert r.candidates() == E  # none live: everyone is a candidate rather than nobody


def test_router_arguments():
    with pytest.raises(ConfigError, match="at least one"):
        Router([], PrefixIndex())
    with pytest.raises(ConfigError, match="unique"):
        Router(["a", "a"], PrefixIndex())
    with pytest.raises(ConfigError, match="PrefixIndex"):
        Router(["a"], None, "prefix")
    with pytest.raises(ConfigError, match="namespace"):
        Router(["a"], None, "round-robin").route([1, 2, 3])
    assert Router(["a"], None, "round-robin").route([]).engine == "a"
