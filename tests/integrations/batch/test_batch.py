"""kvstore.batch: prefix tree, plan invariants (hypothesis), and the runner on a real model."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.batch import BatchPlan, PlanStep, SharedPrefix, plan_batch, simulate
from kvstore.keys import block_keys

T = 4
NS = b"test-batch".ljust(32, b"\0")


def chains_of(prompts, block_tokens=T):
    return [list(block_keys(NS, p, block_tokens)) for p in prompts]


def usable(length, block_tokens=T):
    return (length - 1) // block_tokens


def computed_blocks(plan, prompts, chains):
    """For each step: the block indices the model computes (from reuse_blocks to the end)."""
    out = []
    for s in plan.steps:
        n = len(prompts[s.prompt])
        out.append((s, range(s.reuse_blocks, -(-n // T))))
    return out


# prompts built from a few shared segments, so that prefixes really are shared
segments = st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=14), min_size=1, max_size=5)


@st.composite
def batches(draw):
    segs = draw(segments)
    n = draw(st.integers(1, 14))
    prompts = []
    for _ in range(n):
        picks = draw(st.lists(st.integers(0, len(segs) - 1), min_size=0, max_size=4))
        tail = draw(st.lists(st.integers(0, 50), min_size=0 if picks else 1, max_size=6))
        p = [t for i in picks for t in segs[i]] + tail
        prompts.append(p or [0])
    return prompts


def check_plan_invariants(plan: BatchPlan, prompts):
    n = len(prompts)
    # every prompt covered exactly once
    assert sorted(plan.order) == list(range(n))
    assert plan.num_prompts == n
    assert plan.naive_tokens == sum(len(p) for p in prompts)
    for s in plan.steps:
        length = len(prompts[s.prompt])
        assert 0 <= s.reuse_blocks <= usable(length)  # never the whole prompt
        assert s.compute_tokens == length - s.reuse_blocks * T >= 1
    assert plan.planned_tokens == sum(s.compute_tokens for s in plan.steps)
    assert plan.planned_tokens <= plan.naive_tokens
    assert plan.arrival_tokens <= plan.naive_tokens
    pos = {p: j for j, p in enumerate(plan.order)}
    chains = chains_of(prompts)
    for g in plan.groups:
        assert len(g.prompts) >= 2 and g.blocks >= 1
        # every member starts with the shared prefix, and the group runs back to back
        prefix = chains[g.first][: g.blocks]
        assert all(chains[i][: g.blocks] == prefix for i in g.prompts)
        js = sorted(pos[i] for i in g.prompts)
        assert js == list(range(js[0], js[0] + len(js)))
        assert g.saved_tokens == (len(g.prompts) - 1) * g.blocks * T
        if g.parent >= 0:
            parent = plan.groups[g.parent]
            assert set(g.prompts) <= set(parent.prompts) and parent.blocks < g.blocks
        # no prompt outside the group shares the whole prefix (the group is maximal)
        others = set(range(n)) - set(g.prompts)
        assert all(chains[i][: g.blocks] != prefix for i in others)
    # pins and releases are balanced and nested
    open_groups = []
    for s in plan.steps:
        open_groups += list(s.pin_after)
        for g in s.release_after:
            assert g in open_groups
            open_groups.remove(g)
    assert not open_groups


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=batches(), budget=st.one_of(st.none(), st.integers(0, 40)))
def test_plan_invariants(prompts, budget):
    plan = plan_batch(prompts, block_tokens=T, budget_blocks=budget)
    check_plan_invariants(plan, prompts)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=batches(), extra=st.one_of(st.none(), st.integers(0, 10)))
def test_shared_prefix_computed_once_when_the_budget_holds_a_prompt(prompts, extra):
    longest = max(-(-len(p) // T) for p in prompts)
    budget = None if extra is None else longest + extra
    plan = plan_batch(prompts, block_tokens=T, budget_blocks=budget)
    check_plan_invariants(plan, prompts)
    chains = chains_of(prompts)
    # every block of the prefix tree is computed once, apart from a prompt's own last block
    # when the prompt ends on a block boundary (its last token must always be computed)
    times: dict[bytes, int] = {}
    for s in plan.steps:
        length, chain = len(prompts[s.prompt]), chains[s.prompt]
        for b in range(s.reuse_blocks, len(chain)):
            if b >= usable(length):
                continue
            times[chain[b]] = times.get(chain[b], 0) + 1
    assert all(c == 1 for c in times.values()), times
    # hence no order does better: not arrival order under the same budget, nor an unlimited one
    assert plan.planned_tokens <= plan.arrival_tokens
    unlimited = plan_batch(prompts, block_tokens=T, budget_blocks=None)
    assert plan.planned_tokens == unlimited.planned_tokens <= unlimited.arrival_tokens


def test_docqa_tree_groups_and_savings():
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(8)]  # 2 blocks
    docs = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]  # 10 blocks each
    prompts = [system + d + [rng.randrange(1000) for _ in range(rng.randrange(1, 3))]
               for _ in range(4) for d in docs]  # arrival: interleaved documents
    plan = plan_batch(prompts, block_tokens=T, budget_blocks=None)
    check_plan_invariants(plan, prompts)
    by_blocks = sorted((g.blocks, len(g.prompts)) for g in plan.groups)
    assert by_blocks == [(2, 12), (12, 4), (12, 4), (12, 4)]
    outer = next(g for g in plan.groups if g.blocks == 2)
    assert all(g.parent == outer.group for g in plan.groups if g is not outer)
    # system prompt once, each document once, each question's tail
    expect = 8 + 3 * 40 + sum(len(p) - 48 for p in prompts)
    assert plan.planned_tokens == expect == plan.arrival_tokens  # unlimited cache: same
    # under a budget of one prompt, arrival order thrashes and the plan does not
    tight = plan_batch(prompts, block_tokens=T, budget_blocks=13)
    assert tight.planned_tokens == expect < tight.arrival_tokens
    # arrival order keeps the system prompt (an ancestor: leaves go first) but every
    # document is evicted before its next question arrives
    assert tight.arrival_tokens == tight.naive_tokens - 11 * 8
    assert 0 < tight.saved_fraction < 1


def test_plan_is_frozen_and_deterministic():
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10], [7, 7, 7, 7, 7]]
    a = plan_batch(prompts, block_tokens=T)
    b = plan_batch(prompts, block_tokens=T)
    assert a == b
    for obj, attr in ((a, "planned_tokens"), (a.steps[0], "prompt"), (a.groups[0], "blocks")):
        with pytest.raises(AttributeError):
            setattr(obj, attr, 0)
    assert isinstance(a.steps[0], PlanStep) and isinstance(a.groups[0], SharedPrefix)
    assert a.groups[0].blocks == 2 and a.groups[0].prompts == (0, 1)


def test_exact_multiple_prompt_runs_before_its_extension():
    base = list(range(8))  # exactly 2 blocks
    prompts = [base + [99], base]  # arrival: the extension first
    plan = plan_batch(prompts, block_tokens=T, budget_blocks=None)
    assert plan.order == (1, 0)
    assert plan.planned_tokens == 8 + 1 < plan.arrival_tokens == 9 + 4


def test_simulate_leaf_first_and_pins():
    prompts = [list(range(12)) + [50], list(range(12)) + [51], list(range(100, 113))]
    chains = chains_of(prompts)
    lengths = [len(p) for p in prompts]
    # budget 3: the third prompt evicts the first chain, so running the first again recomputes
    assert simulate(chains, lengths, [0, 2, 1], block_tokens=T, budget_blocks=3) == [0, 0, 0]
    # pinned after step 0, the first chain survives and the third prompt's put is dropped
    g = SharedPrefix(group=0, blocks=3, prompts=(0, 1), parent=-1, saved_tokens=12)
    reused = simulate(chains, lengths, [0, 2, 1], block_tokens=T, budget_blocks=3,
                      pins=[((0,), ()), ((), ()), ((), (0,))], groups=[g])
    assert reused == [0, 0, 3]


def test_plan_validation():
    with pytest.raises(ValueError):
        plan_batch([[1, 2], []], block_tokens=T)
    with pytest.raises(ValueError):
        plan_batch([[1, 2]], block_tokens=0)
    with pytest.raises(ValueError):
        plan_batch([[1, 2]], block_tokens=T, budget_blocks=-3)
    with pytest.raises(ValueError):
        plan_batch([[1, 2]], block_tokens=T, min_shared_blocks=0)


def test_min_shared_blocks_skips_short_groups():
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]  # share one block
    assert len(plan_batch(prompts, block_tokens=T).groups) == 1
    assert plan_batch(prompts, block_tokens=T, min_shared_blocks=2).groups == ()


# -- the runner, through the transformers bridge ------------------------------------------
def _model():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=1024,
                                   initializer_range=0.1)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_runner_matches_plan_and_uncached_outputs():
    from kvstore.batch import BatchRunner
    from kvstore.integrations.transformers import PrefixCachedModel, layout_for, open_store_for

    model = _model()
    rng = random.Random(1)
    system = [rng.randrange(256) for _ in range(8)]
    docs = [[rng.randrange(256) for _ in range(40)] for _ in range(3)]
    prompts = [system + d + [rng.randrange(256) for _ in range(rng.randrange(2, 9))]
               for _ in range(3) for d in docs]
    lay = layout_for(model, block_tokens=8)
    budget = 2 * max(-(-len(p) // 8) for p in prompts)
    results = {}
    for order in ("planned", "arrival", "naive"):
        with open_store_for(model, None, block_tokens=8, device="cpu", gpu_capacity=0,
                            cpu_capacity=budget * lay.block_nbytes) as store:
            plan = plan_batch(prompts, store=store)
            assert plan.budget_blocks == budget  # from the store's memory tier
            results[order] = BatchRunner(PrefixCachedModel(model, store)).run(
                plan, prompts, order=order, max_new_tokens=3 if order != "arrival" else 0)
            assert store.stats().pinned_blocks == 0  # every pin released
    planned, arrival, naive = results["planned"], results["arrival"], results["naive"]
    # the real store computed exactly what the plan's simulation said, for both orders
    assert planned.computed_tokens == plan.planned_tokens
    assert arrival.computed_tokens == plan.arrival_tokens
    assert naive.computed_tokens == plan.naive_tokens
    assert planned.computed_tokens < arrival.computed_tokens < naive.computed_tokens
    assert planned.order == plan.order and arrival.order == tuple(range(len(prompts)))
    for got, ref in zip(planned.outputs, naive.outputs, strict=True):
        assert got.tokens == ref.tokens
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
    assert planned.next_tokens == naive.next_tokens == arrival.next_tokens


def test_runner_rejects_mismatched_plan():
    from kvstore.batch import BatchRunner
    from kvstore.integrations.transformers import PrefixCachedModel, open_store_for

    model = _model()
    with open_store_for(model, None, block_tokens=8, device="cpu", gpu_capacity=0,
                        cpu_capacity="1MiB") as store:
        runner = BatchRunner(PrefixCachedModel(model, store))
        plan = plan_batch([[1] * 20, [1] * 21], block_tokens=4)
        with pytest.raises(ValueError, match="block size"):
            runner.run(plan, [[1] * 20, [1] * 21])
        plan = plan_batch([[1] * 20, [1] * 21], store=store)
        with pytest.raises(ValueError, match="2 prompts"):
            runner.run(plan, [[1] * 20])
        with pytest.raises(ValueError, match="order"):
            runner.run(plan, [[1] * 20, [1] * 21], order="random")


# -- token-level tree, schedule and packing ---------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(prompts=batches())
def test_unique_tokens_is_the_token_trie_size(prompts):
    from kvstore.integrations.batch.tree import common_prefix_len, unique_tokens

    trie = {tuple(p[:k]) for p in prompts for k in range(1, len(p) + 1)}
    assert unique_tokens(prompts) == len(trie)
    for a in prompts[:3]:
        for b in prompts[:3]:
            n = common_prefix_len(a, b)
            assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=batches(), max_tokens=st.integers(1, 40), max_rows=st.integers(1, 6),
       max_prefix=st.integers(1, 60))
def test_schedule_and_pack_cover_every_prompt_once(prompts, max_tokens, max_rows, max_prefix):
    from kvstore.integrations.batch.engines.schedule import pack, schedule

    plan = plan_batch(prompts, block_tokens=T, budget_blocks=None)
    lengths = [len(p) for p in prompts]
    sched = schedule(plan, lengths)
    for node in sched.nodes:
        members = [r.prompt for r in sched.rows if r.node == node.node]
        assert node.rows == len(members)
        src = prompts[node.source][: node.prefix_len]
        assert all(prompts[i][: node.prefix_len] == src for i in members)
        if node.parent >= 0:
            assert sched.nodes[node.parent].prefix_len < node.prefix_len
            assert node.parent < node.node  # parents first
    seen = []
    for b in pack(sched, lengths, max_tokens=max_tokens, max_rows=max_rows,
                  max_prefix_tokens=max_prefix):
        assert 1 <= len(b.rows) <= max_rows
        suffix = sum(lengths[r.prompt] - r.prefix_len for r in b.rows)
        assert len(b.rows) == 1 or suffix <= max_tokens
        held = sum(sched.nodes[n].prefix_len for n in b.nodes)
        assert len(b.nodes) <= 1 or held <= max_prefix
        nodes = [r.node for r in b.rows]
        assert nodes == sorted(nodes, key=lambda n: -1 if n < 0 else b.nodes.index(n))  # grouped
        for r in b.rows:
            assert 0 <= r.prefix_len < lengths[r.prompt]
            seen.append(r.prompt)
    assert sorted(seen) == list(range(len(prompts)))


def test_shared_tokens_extend_past_the_block_boundary():
    base = list(range(10))  # 2 full blocks + 2 tokens shared
    plan = plan_batch([base + [50, 51], base + [60]], block_tokens=T, budget_blocks=None)
    (g,) = plan.groups
    assert g.blocks == 2 and g.shared_tokens == 10
    # capped one short of the shortest prompt (its last token must be computed)
    plan = plan_batch([base, base + [7, 8]], block_tokens=T, budget_blocks=None)
    assert plan.groups[0].shared_tokens == 9 and plan.lower_bound_tokens == 12


# -- fixes found while trying the runner (issue 17) ---------------------------------------------
def test_runner_pins_with_the_models_salt():
    """Regression: with PrefixCachedModel(salt=...) every pin asked for blocks under no salt
    and pinned none."""
    from kvstore.batch import BatchRunner
    from kvstore.integrations.transformers import PrefixCachedModel, open_store_for

    model = _model()
    prompts = [[3] * 40 + [i] for i in range(4)]
    with open_store_for(model, None, block_tokens=8, device="cpu", gpu_capacity=0,
                        cpu_capacity="1MiB") as store:
        plan = plan_batch(prompts, store=store, salt="tenant-a")
        pinned = []
        runner = BatchRunner(PrefixCachedModel(model, store, salt="tenant-a"))
        runner.run(plan, prompts, progress=lambda: pinned.append(store.stats().pinned_blocks))
        assert pinned[0] == plan.groups[0].blocks == 5  # pinned after the first prompt
        assert pinned[-1] == 0


def test_simulation_counts_the_answer_blocks_generation_puts():
    """Regression: with max_new_tokens the prompt + answer blocks store_generated puts were
    not simulated (a tight budget computed more than the plan said). The planned order, whose
    prefixes are pinned, is now exact; arrival order is far closer than without them (the
    store may evict answer blocks in another order among themselves)."""
    from kvstore.batch import BatchRunner
    from kvstore.integrations.transformers import PrefixCachedModel, layout_for, open_store_for

    model = _model()
    model.generation_config.eos_token_id = None  # every prompt generates max_new_tokens
    model.config.eos_token_id = None
    rng = random.Random(2)
    docs = [[rng.randrange(256) for _ in range(30)] for _ in range(3)]
    prompts = [d + [rng.randrange(256) for _ in range(rng.randrange(1, 6))]
               for _ in range(3) for d in docs]
    lay = layout_for(model, block_tokens=8)
    # a budget where arrival order keeps more documents when answers are not stored
    budget = max(-(-len(p) // 8) for p in prompts) + 5
    real = {}
    for order in ("planned", "arrival"):
        with open_store_for(model, None, block_tokens=8, device="cpu", gpu_capacity=0,
                            cpu_capacity=budget * lay.block_nbytes) as store:
            plan = plan_batch(prompts, store=store, max_new_tokens=20)
            real[order] = BatchRunner(PrefixCachedModel(model, store)).run(
                plan, prompts, order=order, max_new_tokens=20).computed_tokens
    without = plan_batch(prompts, block_tokens=8, budget_blocks=budget)
    assert real["planned"] == plan.planned_tokens
    assert abs(real["arrival"] - plan.arrival_tokens) < abs(real["arrival"] - without.arrival_tokens)
