"""Property tests: every eviction policy, under each memory-tier admission, keeps the store's
guarantees (prefix closure, pins, byte budgets, no dirty block lost) and is deterministic;
the policies themselves list exactly the blocks held, children before parents."""

import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.policy import BN, LAY, drive, kv_for, ops_st

from kvstore import open_store
from kvstore.tiers.adaptive_policy import AdaptivePolicy
from kvstore.tiers.admission import ADMISSIONS
from kvstore.tiers.policy import EVICTIONS, LRUPolicy
from kvstore.tiers.reuse_policy import ReusePolicy

prompt_st = st.lists(st.sampled_from([1, 2, 3]), min_size=2, max_size=14)


class PolicyStoreMachine(RuleBasedStateMachine):
    """A hot, a warm and a disk tier (so blocks go dirty and wait for the writer) under one
    eviction policy; small tiers, so nearly every put evicts."""

    eviction = "reuse"
    admission = "always"  # of both memory tiers (the disk tier's stays "always")

    def __init__(self):
        super().__init__()
        self.hot_blocks, self.warm_blocks = 3, 5
        self.dir = tempfile.mkdtemp(prefix="kvstore-policy-")
        self.store = open_store(self.dir, layout=LAY, model_id="pp", device="cpu",
                                gpu_capacity=self.hot_blocks * BN,
                                cpu_capacity=self.warm_blocks * BN, disk_capacity="1MiB",
                                eviction=self.eviction,
                                admission={"hot": self.admission, "warm": self.admission})
        self.chains = []
        self.receipts = []

    def teardown(self):
        for r in self.receipts:
            r.release()
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(tokens=prompt_st)
    def request(self, tokens):
        """As an engine does: fetch the cached prefix, put the rest."""
        keys = self.store.block_keys(tokens)
        if not keys:
            return
        self.chains.append(keys)
        got = self.store.fetch(keys).wait()
        n = got.shape[0]
        assert torch.equal(got.view(torch.int16), kv_for(keys[:n]).view(torch.int16))
        if n < len(keys):
            self.store.put(keys[n:], kv_for(keys[n:])).wait()

    @precondition(lambda self: self.chains and len(self.receipts) < 2)
    @rule(i=st.integers(0, 1000))
    def pin(self, i):
        self.receipts.append(self.store.pin(self.chains[i % len(self.chains)][:2]))

    @precondition(lambda self: self.receipts)
    @rule()
    def unpin(self):
        self.receipts.pop(0).release()

    @rule()
    def flush(self):
        self.store.flush()

    def _in_memory(self, k):
        return self.store.residency.held(k)

    @invariant()
    def prefix_closed(self):
        """Every block memory holds is reachable: its whole prefix is held (in memory or,
        once written, on disk), so the lookup's leading run covers it."""
        self.store.flush()
        for keys in self.chains:
            n = self.store.lookup(keys)
            assert not any(self._in_memory(k) for k in keys[n:]), "unreachable block in memory"

    @invariant()
    def pins_survive(self):
        for r in self.receipts:
            assert all(self._in_memory(k) for k in r.keys)

    @invariant()
    def budgets(self):
        st_ = self.store.stats()
        hot, warm = st_.tier("hot"), st_.tier("warm")
        assert hot.blocks <= self.hot_blocks and warm.blocks <= self.warm_blocks
        assert hot.used_bytes <= hot.capacity_bytes and warm.used_bytes <= warm.capacity_bytes

    @invariant()
    def no_dirty_block_lost(self):
        st_ = self.store.stats()
        assert st_.dirty_dropped == 0 and st_.disk_write_dropped == 0


for _ev in EVICTIONS:
    for _adm in ADMISSIONS:
        _name = _ev if _adm == "always" else f"{_ev}_{_adm.replace('-', '_')}"
        _machine = type(f"PolicyStoreMachine_{_name}", (PolicyStoreMachine,),
                        {"eviction": _ev, "admission": _adm})
        _machine.TestCase.settings = settings(
            max_examples=25, stateful_step_count=25, deadline=None,
            suppress_health_check=[HealthCheck.too_slow])
        globals()[f"TestPolicyStore_{_name}"] = _machine.TestCase


# -- the policies alone ----------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(ops=ops_st)
@pytest.mark.parametrize("make", [LRUPolicy, lambda: ReusePolicy(6, tune=False),
                                  lambda: ReusePolicy(6, scale=4.0, tune=False),
                                  lambda: ReusePolicy(600)])
def test_policy_lists_exactly_the_held_blocks_and_is_deterministic(make, ops):
    assert drive(make(), ops) == drive(make(), ops)


@settings(max_examples=80, deadline=None)
@given(ops=ops_st)
@pytest.mark.parametrize("make", [lambda: ReusePolicy(6, tune=False),
                                  lambda: AdaptivePolicy(6, scale=2.0, tune=False)],
                         ids=["reuse", "adaptive"])
def test_touched_chain_keeps_children_before_parents(make, ops):
    p = make()
    drive(p, ops)
    keys = [(0,), (0, 1), (0, 1, 2)]
    for k in keys:
        if k not in p:
            p.insert(k)
    p.touch(keys[::-1])
    order = p.order()
    assert order.index((0, 1, 2)) < order.index((0, 1)) < order.index((0,))


@settings(max_examples=40, deadline=None)
@given(seq=st.lists(prompt_st, min_size=1, max_size=20))
def test_store_replay_is_deterministic(seq):
    def run():
        with open_store(None, layout=LAY, model_id="det", device="cpu",
                        cpu_capacity=5 * BN, eviction="reuse") as s:
            found = []
            for tokens in seq:
                keys = s.block_keys(tokens)
                n = s.fetch(keys).wait().shape[0]
                found.append(n)
                if n < len(keys):
                    s.put(keys[n:], kv_for(keys[n:])).wait()
            return found, s.state.warm.lru_order()

    assert run() == run()
