"""Property tests: lookup/fetch exactness and eviction invariants under random operations."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import KVLayout, open_store

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, block_tokens=2)


def kv_for(keys):
    """Block content derived from the key, so any mix-up shows."""
    out = torch.empty(LAY.batch_shape(len(keys)), dtype=torch.int16)
    for i, k in enumerate(keys):
        g = torch.Generator().manual_seed(int.from_bytes(k[:8], "little"))
        out[i] = torch.randint(-(2**15), 2**15, LAY.block_shape, generator=g, dtype=torch.int16)
    return out.view(torch.float16)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=40),
       hot=st.integers(0, 6), warm=st.integers(1, 6))
def test_put_then_lookup_and_fetch_bit_exact(tokens, hot, warm):
    with open_store(None, layout=LAY, model_id="p", device="cpu", gpu_capacity=hot * LAY.block_nbytes,
                    cpu_capacity=warm * LAY.block_nbytes) as s:
        keys = s.block_keys(tokens)
        kv = kv_for(keys)
        stored = s.put(keys, kv).wait()
        n = s.lookup(keys)
        assert n == stored == min(len(keys), hot + warm)
        got = s.fetch(keys).wait()
        assert got.shape[0] == n
        assert torch.equal(got.view(torch.int16), kv[:n].view(torch.int16))


prompt_st = st.lists(st.sampled_from([1, 2, 3]), min_size=2, max_size=14)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.hot_blocks, self.warm_blocks = 3, 4
        self.store = open_store(
            None, layout=LAY, model_id="sm", device="cpu",
            gpu_capacity=self.hot_blocks * LAY.block_nbytes,
            cpu_capacity=self.warm_blocks * LAY.block_nbytes,
        )
        self.chains = []  # every KeyChain ever computed
        self.receipts = []
        self.put_keys = 0

    def teardown(self):
        for r in self.receipts:
            r.release()
        self.store.close()

    @rule(tokens=prompt_st, split=st.integers(0, 7))
    def put(self, tokens, split):
        keys = self.store.block_keys(tokens)
        if not keys:
            return
        self.chains.append(keys)
        start = min(split, self.store.lookup(keys))
        self.put_keys += len(keys) - start
        self.store.put(keys[start:], kv_for(keys[start:])).wait()

    @precondition(lambda self: self.chains)
    @rule(i=st.integers(0, 1000))
    def fetch(self, i):
        keys = self.chains[i % len(self.chains)]
        n = self.store.lookup(keys)
        got = self.store.fetch(keys).wait()
        assert got.shape[0] == n
        assert torch.equal(got.view(torch.int16), kv_for(keys[:n]).view(torch.int16))
        self.store.flush()

    @precondition(lambda self: self.chains)
    @rule(i=st.integers(0, 1000), tier=st.sampled_from([None, "hot", "warm"]))
    def evict(self, i, tier):
        keys = self.chains[i % len(self.chains)]
        self.store.evict(keys[len(keys) // 2 :], tier=tier)

    @precondition(lambda self: self.chains and len(self.receipts) < 3)
    @rule(i=st.integers(0, 1000))
    def pin(self, i):
        keys = self.chains[i % len(self.chains)]
        self.receipts.append(self.store.pin(keys[:2]))

    @precondition(lambda self: self.receipts)
    @rule()
    def unpin(self):
        self.receipts.pop(0).release()

    def _held(self, k):
        return self.store.residency.held(k)

    @invariant()
    def prefix_closed(self):
        self.store.flush()  # background promotions settle: the checks below see a quiet store
        for keys in self.chains:
            held = [self._held(k) for k in keys]
            assert held == sorted(held, reverse=True), "cached set is not prefix-closed"

    @invariant()
    def pinned_survive(self):
        for r in self.receipts:
            for k in r.keys:
                assert self._held(k)

    @invariant()
    def budgets_and_stats(self):
        self.store.flush()
        st_ = self.store.stats()
        hot, warm = st_.tier("hot"), st_.tier("warm")
        assert hot.used_bytes <= hot.capacity_bytes and warm.used_bytes <= warm.capacity_bytes
        assert hot.blocks <= self.hot_blocks and warm.blocks <= self.warm_blocks
        distinct = {k for keys in self.chains for k in keys if self._held(k)}
        assert st_.blocks == len(distinct)
        assert max(hot.blocks, warm.blocks) <= st_.blocks <= hot.blocks + warm.blocks
        pinned = {k for r in self.receipts for k in r.keys}
        assert st_.pinned_blocks == len(pinned)
        assert st_.put_blocks + st_.put_duplicates + st_.put_dropped == self.put_keys


StoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStoreMachine = StoreMachine.TestCase


def test_put_chains_age_leaf_first():
    """A put leaves its chain in LRU order leaf first (root newest), extensions included, so
    eviction from a full tier meets leaves first instead of walking past every descendant."""
    with open_store(None, layout=LAY, model_id="lru", device="cpu", gpu_capacity=0,
                    cpu_capacity=64 * LAY.block_nbytes) as s:
        keys = s.block_keys(list(range(2 * 6)))
        s.put(keys[:4], kv_for(keys[:4])).wait()
        assert s.state.warm.lru_order() == list(reversed(keys[:4]))
        s.put(keys, kv_for(keys)).wait()  # extends the chain by two blocks
        assert s.state.warm.lru_order() == list(reversed(keys))
        other = s.block_keys(list(range(100, 108)))
        s.put(other, kv_for(other)).wait()
        assert s.state.warm.lru_order() == list(reversed(keys)) + list(reversed(other))
