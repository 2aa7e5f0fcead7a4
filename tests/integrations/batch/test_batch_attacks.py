"""Adversarial reliability pass, round 7a: the transformers batch engine with continuous
batching (rows join running ones within the token, row and prefix budgets; a stopped row's
slot goes to the last running row; a buffer shrinks once a quarter or less of its rows run).

Attacked: budgets of 1 and budgets exactly a row's size; identical prompts, a prompt that is a
prefix of another, one-token prompts; prompts at the model's context with a large
``max_tokens``; ``max_tokens=1`` over hundreds of tiny rows; EOS, stop tokens and
``max_tokens`` ending rows at every step; nested shared prefixes with rows finishing first,
last and in the middle of their buffer; Mistral with windows of 1 to 20 and Qwen2 with mixed
full / sliding layers; a store holding part of a prefix, or a damaged block of it;
``continuous=False`` against ``continuous=True``; bad input through the Python API.

The promise: greedy outputs equal per-prompt ``model.generate`` in float32 (or, where
``generate``'s own cache is wrong, the model's forward without a cache); a seeded sampled row
draws the same tokens whatever shares its batch; every request gets exactly one completion;
the report's counts are right (computed tokens equal the unique-token lower bound when every
prefix is shared); bad input is a clear ``ValueError`` before any forward; nothing hangs.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from test_batch_continuous import Spy
from test_batch_engine import VOCAB, hf_generate, make_model, run, toks

from kvstore.integrations.batch import BatchRequest, SamplingParams, unique_tokens
from kvstore.integrations.batch.engines import transformers as T
from kvstore.integrations.batch.engines.transformers import TransformersEngine

pytestmark = pytest.mark.timeout(120)  # a scheduling loop that never ends fails, not hangs


@pytest.fixture(scope="module")
def model():
    return make_model()


def counted(engine, prompts, params):
    """``run``, also checking that each request got exactly one completion and that the
    report's counts agree with the completions."""
    calls: Counter[int] = Counter()
    real = engine.run

    def once(reqs, on_done=None, **kw):
        def done(i, c):
            calls[i] += 1
            on_done(i, c)
        return real(reqs, on_done=done, **kw)

    engine.run = once
    try:
        outs, rep = run(engine, prompts, params)
    finally:
        del engine.run
    assert calls == Counter(range(len(prompts)))  # each exactly once
    assert rep.requests == len(prompts) and rep.prompt_tokens == sum(map(len, prompts))
    assert rep.generated_tokens == sum(len(c.token_ids) for c in outs)
    for p, c in zip(prompts, outs, strict=True):
        assert c.prompt_tokens == len(p) and 0 <= c.cached_tokens < len(p)
    return outs, rep


def nested_job(seed, docs=3, per_doc=4, system=24, doc=24):
    """Questions on documents under one system prompt (two levels of shared prefix), plus a
    question on the system prompt alone, shuffled."""
    rng = random.Random(seed)
    # distinct first tokens after each prefix: prompts part exactly where the plan's shared
    # prefixes end (a token two questions share by chance is computed for each, as the plan
    # shares whole blocks only; the lower bound counts it once)
    first = iter(rng.sample(range(3, VOCAB), docs * per_doc + docs + 1))
    sysp = toks(rng, system)
    ds = [[next(first), *toks(rng, doc - 1 + i)] for i in range(docs)]  # told apart by length
    prompts = [sysp + d + [next(first), *toks(rng, rng.randrange(0, 9))]
               for d in ds for _ in range(per_doc)]
    prompts.append(sysp + [next(first), *toks(rng, 4)])
    rng.shuffle(prompts)
    return prompts, rng


@pytest.fixture(scope="module")
def nested(model):
    prompts, rng = nested_job(11)
    new = [rng.choice([1, 2, 3, 7]) for _ in prompts]
    refs = [hf_generate(model, p, k) for p, k in zip(prompts, new, strict=True)]
    return prompts, [SamplingParams(max_tokens=k) for k in new], refs


def row_forwards(spy):
    """Each forward the spy saw (a prefix's own forward included: one row of its tokens) as
    (tokens, rows)."""
    return [(sum(sum(sp.counts) for sp in f), sum(len(sp.rows) for sp in f)) for f in spy.forwards]


# -- budgets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("budgets", [
    {"max_batch_tokens": 1}, {"max_batch_rows": 1}, {"max_prefix_tokens": 1},
    {"max_batch_tokens": 1, "max_batch_rows": 1, "max_prefix_tokens": 1},
    {"max_batch_tokens": 1, "max_batch_rows": 1, "max_prefix_tokens": 1, "continuous": False},
])
def test_budgets_of_one(model, nested, monkeypatch, budgets):
    """Every budget at its smallest: each prefix is still computed once, outputs unchanged.
    A token or row budget of 1 runs rows one at a time (prefill, then each decode step); a
    prefix budget of 1 runs one prefix's rows at a time, together."""
    prompts, params, refs = nested
    engine = TransformersEngine(model, eos_token_id=(), **budgets)
    spy = Spy(engine, monkeypatch)
    outs, rep = counted(engine, prompts, params)
    assert [list(c.token_ids) for c in outs] == refs
    assert rep.computed_tokens == unique_tokens(prompts)  # every prefix shared: the bound
    prefix_forwards = 1 + 3  # the system prompt, then each document on top of it
    alone = prefix_forwards + sum(p.max_tokens for p in params)
    if budgets.keys() == {"max_prefix_tokens"}:
        assert rep.forwards < alone
        for f in spy.forwards:  # rows of one prefix (the prefixes' lengths differ) per forward
            assert len({n for sp in f for n in sp.prefix}) == 1
    else:
        assert rep.forwards == alone
        # one row in flight: every forward (prefix forwards are one sequence too) has one
        assert all(rows == 1 for _, rows in row_forwards(spy))


@pytest.mark.parametrize("continuous", [True, False])
def test_rows_of_a_held_prefix_batch_under_a_prefix_budget_below_it(model, continuous):
    """Before: with ``max_prefix_tokens`` below one prefix's length (63 for a 64-token
    document), the rows of that one prefix ran one at a time (16 rows x 4 new tokens: 65
    forwards instead of 5, 2.5x the time), as if each row added the prefix again."""
    rng = random.Random(25)
    doc = toks(rng, 64)
    prompts = [doc + toks(rng, 5) for _ in range(16)]
    engine = TransformersEngine(model, eos_token_id=(), max_prefix_tokens=63,
                                continuous=continuous)
    outs, rep = counted(engine, prompts, SamplingParams(max_tokens=4))
    assert rep.forwards == 1 + 4  # the document, one prefill, three decode steps
    assert [list(c.token_ids) for c in outs] == [hf_generate(model, p, 4) for p in prompts]


def test_budgets_exactly_a_rows_size(model, monkeypatch):
    """A token budget of one running row + one joining suffix admits both (the boundary is
    inclusive); one token less keeps them apart. Same for the prefix budget at two prefixes."""
    rng = random.Random(12)
    a, b = toks(rng, 32), toks(rng, 32)
    prompts = [a + toks(rng, 6) for _ in range(3)] + [b + toks(rng, 6) for _ in range(3)]
    params = SamplingParams(max_tokens=3)
    refs = [hf_generate(model, p, 3) for p in prompts]
    seen = {}
    for budget in (7, 6):  # 1 decode token + 6 suffix tokens
        engine = TransformersEngine(model, eos_token_id=(), max_batch_tokens=budget)
        spy = Spy(engine, monkeypatch)
        outs, rep = counted(engine, prompts, params)
        assert [list(c.token_ids) for c in outs] == refs
        assert rep.computed_tokens == unique_tokens(prompts)
        shapes = row_forwards(spy)
        assert all(t <= budget for t, _ in shapes if t <= 7)  # prefixes (32) run alone
        seen[budget] = shapes
    assert (7, 2) in seen[7]  # exactly at the budget: joined
    assert all(rows == 1 for _, rows in seen[6])
    for budget, together in ((64, True), (63, False)):  # the two prefixes held at once?
        engine = TransformersEngine(model, eos_token_id=(), max_prefix_tokens=budget)
        spy = Spy(engine, monkeypatch)
        outs, _ = counted(engine, prompts, params)
        assert [list(c.token_ids) for c in outs] == refs
        rows = [r for t, r in row_forwards(spy) if t != 32]
        assert (max(rows) == 6) is together  # all six rows in one prefill


def test_row_budget_exactly_the_rows_of_a_prefix(model, monkeypatch):
    """A row budget of exactly the job's rows: all of them prefill together, then decode."""
    prompts = nested_job(13, docs=1, per_doc=4)[0]
    params = SamplingParams(max_tokens=4)
    refs = [hf_generate(model, p, 4) for p in prompts]
    engine = TransformersEngine(model, eos_token_id=(), max_batch_rows=len(prompts))
    spy = Spy(engine, monkeypatch)
    outs, rep = counted(engine, prompts, params)
    assert [list(c.token_ids) for c in outs] == refs
    shapes = row_forwards(spy)
    assert max(r for _, r in shapes) == len(prompts)  # all rows in flight at once
    assert rep.forwards == 2 + 4  # two prefixes, one prefill, three decode steps


# -- prompt shapes ------------------------------------------------------------------------------
def test_identical_prompts_prefixes_of_others_and_one_token_prompts(model):
    """The shared prefix stops one short of the shortest prompt (its last token must be
    computed for its logits), so a prompt that ends inside another costs its last token again:
    the counts below are exact, and outputs equal ``generate``."""
    rng = random.Random(14)
    a = toks(rng, 37)
    cases = [
        ([a, a, a], 36 + 3),  # 36 shared, then each row's last token
        ([a[:20], a, a + toks(rng, 3)], 19 + 17 + 1 + 1 + 4),  # nested: 19, then 36
        ([[5], [5], [7], [5, 6]], 5),  # nothing to share before a last token
        ([a, a[:1], a[:2], a[:3]], 37 + 1 + 2 + 3),  # prefixes of 1-2 tokens: no node
    ]
    for prompts, computed in cases:
        for continuous in (True, False):
            engine = TransformersEngine(model, eos_token_id=(), continuous=continuous)
            outs, rep = counted(engine, prompts, SamplingParams(max_tokens=4))
            assert [list(c.token_ids) for c in outs] == [hf_generate(model, p, 4) for p in prompts]
            assert rep.computed_tokens == computed, prompts


def test_prompts_at_the_context_with_a_large_max_tokens():
    """Each row stops at the model's context (the last token at position context - 1), whatever
    its max_tokens; rows one token short of it decode once."""
    m = make_model(max_position_embeddings=48)
    rng = random.Random(15)
    base = toks(rng, 20)
    prompts = [base + toks(rng, 27), base + toks(rng, 10), base + toks(rng, 26), toks(rng, 47),
               base + toks(rng, 1)]
    for kw in ({}, {"max_batch_rows": 2}, {"max_batch_tokens": 1}, {"continuous": False}):
        outs, _ = counted(TransformersEngine(m, eos_token_id=(), **kw), prompts,
                          SamplingParams(max_tokens=1000))
        for p, c in zip(prompts, outs, strict=True):
            assert list(c.token_ids) == hf_generate(m, p, 48 - len(p))
            assert c.finish_reason == "length" and len(p) + len(c.token_ids) == 48


def test_max_tokens_one_over_hundreds_of_tiny_rows(model, monkeypatch):
    """320 rows of 1-3 suffix tokens (under one 16-token system prompt, and one-token prompts
    without it), one new token each: no decode step at all, every row completes once."""
    rng = random.Random(16)
    sysp = toks(rng, 16)
    prompts = [sysp + toks(rng, rng.randrange(1, 4)) for _ in range(300)]
    prompts += [toks(rng, 1) for _ in range(20)]
    refs = [hf_generate(model, p, 1) for p in prompts]
    for kw in ({"max_batch_rows": 7, "max_batch_tokens": 12}, {}, {"continuous": False,
                                                                    "max_batch_rows": 7}):
        engine = TransformersEngine(model, eos_token_id=(), **kw)
        spy = Spy(engine, monkeypatch)
        outs, rep = counted(engine, prompts, SamplingParams(max_tokens=1))
        assert [list(c.token_ids) for c in outs] == refs
        assert rep.generated_tokens == len(prompts)
        # every forward but the prefix's is a prefill: rows start at column 0
        assert all(s == 0 for f in spy.forwards for sp in f for s in sp.starts)
        budget = kw.get("max_batch_tokens", 8192), kw.get("max_batch_rows", 256)
        shapes = row_forwards(spy)
        shapes.remove((16, 1))  # the system prompt's own forward
        assert all(t <= budget[0] and r <= budget[1] for t, r in shapes)


@pytest.mark.parametrize("kw", [{"max_batch_rows": 3}, {"max_batch_tokens": 8}, {},
                                {"continuous": False, "max_batch_rows": 4}])
def test_eos_stop_tokens_and_max_tokens_end_rows_at_every_step(model, kw):
    prompts, rng = nested_job(17, docs=3, per_doc=5)
    plain = [hf_generate(model, p, 10) for p in prompts]
    eos = sorted({plain[i][i % 10] for i in range(0, len(prompts), 2)})
    params = []
    for i in range(len(prompts)):
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=10, stop_token_ids=(plain[i][(7 * i) % 10],)))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=1 + i % 10))
        else:
            params.append(SamplingParams(max_tokens=10, ignore_eos=True))
    refs = []
    for p, sp in zip(prompts, params, strict=True):
        r = hf_generate(model, p, sp.max_tokens, eos=None if sp.ignore_eos else eos)
        cut = next((j for j, t in enumerate(r) if t in sp.stop_token_ids), None)
        refs.append(r if cut is None else r[: cut + 1])
    assert len({len(r) for r in refs}) >= 6  # rows really end at many different steps
    outs, rep = counted(TransformersEngine(model, eos_token_id=eos, **kw), prompts, params)
    assert [list(c.token_ids) for c in outs] == refs
    assert rep.computed_tokens == unique_tokens(prompts)
    for c, sp in zip(outs, params, strict=True):
        last = c.token_ids[-1]
        at_eos = not sp.ignore_eos and last in eos
        assert c.finish_reason == ("stop" if at_eos or last in sp.stop_token_ids else "length")
        # an EOS that is also a stop token reads as EOS (no stop_reason), as in vLLM
        assert c.stop_reason == (last if last in sp.stop_token_ids and not at_eos else None)


@pytest.mark.parametrize("pattern", ["first", "last", "middle", "falling", "rising"])
def test_rows_finishing_first_last_or_in_the_middle_of_their_buffer(model, monkeypatch, pattern):
    """Waves of 8 rows (one suffix buffer each) where the long answer sits in the first, last
    or a middle slot, or lengths fall or rise along the slots: stopped rows hand their slots to
    the last running one, the buffer shrinks to the survivors, later waves join meanwhile."""
    prompts, rng = nested_job(18, docs=4, per_doc=6)
    n = len(prompts)
    long = {"first": 0, "last": 7, "middle": 3}.get(pattern)
    new = []
    for i in range(n):
        j = i % 8
        if long is not None:
            new.append(12 if j == long else 1 + j % 2)
        else:
            new.append(2 + (7 - j if pattern == "falling" else j))
    refs = [hf_generate(model, p, k) for p, k in zip(prompts, new, strict=True)]
    moves, shrinks = [], []
    real = T._Buffer.leave

    def leave(buf, lv):
        kv, last = buf.kv, buf.rows[-1]
        real(buf, lv)
        moves.append(last is not lv)
        shrinks.append(buf.kv is not kv)

    monkeypatch.setattr(T._Buffer, "leave", leave)
    engine = TransformersEngine(model, eos_token_id=(), max_batch_rows=8, max_batch_tokens=80)
    outs, rep = counted(engine, prompts, [SamplingParams(max_tokens=k) for k in new])
    assert [list(c.token_ids) for c in outs] == refs
    assert rep.computed_tokens == unique_tokens(prompts)
    assert any(moves)
    if pattern in ("first", "last", "middle"):
        assert any(shrinks)  # 1 of 8 left: moved to a buffer of its size


# -- other model families -----------------------------------------------------------------------
@pytest.mark.parametrize("family, over", [
    ("mistral", {"sliding_window": 3}),
    ("mistral", {"sliding_window": 20}),
    ("qwen2", {}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
])
def test_sliding_windows_and_qwen2_with_nested_prefixes(family, over):
    m = make_model(family=family, **over)
    prompts, rng = nested_job(19, docs=2, per_doc=4)
    new = [rng.choice([1, 2, 3, 20]) for _ in prompts]
    refs = [hf_generate(m, p, k) for p, k in zip(prompts, new, strict=True)]
    params = [SamplingParams(max_tokens=k) for k in new]
    for kw in ({"max_batch_rows": 3}, {"max_batch_tokens": 1}, {"continuous": False}):
        outs, rep = counted(TransformersEngine(m, eos_token_id=(), **kw), prompts, params)
        assert [list(c.token_ids) for c in outs] == refs, kw
        assert rep.computed_tokens == unique_tokens(prompts)


def test_a_window_of_one_token_equals_the_uncached_forward():
    """Mistral with ``sliding_window=1`` (each token sees only itself): the engine equals the
    model's own forward run without a cache, token by token. (``generate``'s cached path
    differs there, transformers 5.x: its sliding cache keeps window - 1 = 0 tokens.)"""
    m = make_model(family="mistral", sliding_window=1)
    prompts, rng = nested_job(20, docs=2, per_doc=2)
    refs = []
    for p in prompts:
        ids = list(p)
        for _ in range(4):
            with torch.no_grad():
                ids.append(int(m(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        refs.append(ids[len(p):])
    outs, _ = counted(TransformersEngine(m, eos_token_id=(), max_batch_rows=3), prompts,
                      SamplingParams(max_tokens=4))
    assert [list(c.token_ids) for c in outs] == refs


# -- sampling -----------------------------------------------------------------------------------
def test_seeded_sampling_does_not_depend_on_the_batch(model):
    prompts, rng = nested_job(21, docs=2, per_doc=4)
    params = [SamplingParams(max_tokens=rng.choice([1, 3, 9]), temperature=1.1, top_p=0.9,
                             top_k=40 * (i % 2), seed=i) if i % 3 else
              SamplingParams(max_tokens=5) for i in range(len(prompts))]
    alone = [counted(TransformersEngine(model, eos_token_id=()), [p], [sp])[0][0].token_ids
             for p, sp in zip(prompts, params, strict=True)]
    for kw in ({}, {"max_batch_rows": 1}, {"max_batch_tokens": 1}, {"max_prefix_tokens": 1},
               {"max_batch_rows": 3, "max_batch_tokens": 20}, {"continuous": False}):
        outs, _ = counted(TransformersEngine(model, eos_token_id=(), **kw), prompts, params)
        assert [c.token_ids for c in outs] == alone, kw
    greedy = [hf_generate(model, p, sp.max_tokens) for p, sp in zip(prompts, params, strict=True)]
    assert any(list(a) != g for a, g in zip(alone, greedy, strict=True))  # it did sample


# -- a store ------------------------------------------------------------------------------------
STORE = {"block_tokens": 8, "device": "cpu", "gpu_capacity": 0, "cpu_capacity": "8MiB",
         "disk_capacity": "64MiB"}


def _store_jobs():
    rng = random.Random(22)
    doc = toks(rng, 100)
    first = [doc[:40] + toks(rng, 10) for _ in range(3)]  # leaves doc's first 5 blocks
    second = [doc + toks(rng, rng.randrange(2, 8)) for _ in range(4)]
    return first, second


def test_a_store_holding_part_of_a_prefix(model, tmp_path):
    from kvstore.integrations.transformers import open_store_for

    first, second = _store_jobs()
    refs = [hf_generate(model, p, 3) for p in second]
    with open_store_for(model, tmp_path / "s", **STORE) as store:
        counted(TransformersEngine(model, store=store, eos_token_id=()), first,
                SamplingParams(max_tokens=3))
        outs, rep = counted(TransformersEngine(model, store=store, eos_token_id=()), second,
                            SamplingParams(max_tokens=3))
        assert [list(c.token_ids) for c in outs] == refs
        assert rep.stored_tokens == 40  # the 5 blocks the first job left, the rest computed
        assert rep.computed_tokens + rep.stored_tokens == unique_tokens(second)
        again, rep = counted(TransformersEngine(model, store=store, eos_token_id=(),
                                                continuous=False), second,
                             SamplingParams(max_tokens=3))
        assert [list(c.token_ids) for c in again] == refs
        assert rep.stored_tokens == 96  # the second job's 12 full blocks
        assert rep.computed_tokens + rep.stored_tokens == unique_tokens(second)


def test_a_damaged_block_in_the_store_is_computed_again(model, tmp_path):
    from kvstore.integrations.transformers import open_store_for

    first, second = _store_jobs()
    refs = [hf_generate(model, p, 3) for p in second]
    path = tmp_path / "s"
    with open_store_for(model, path, **STORE) as store:
        counted(TransformersEngine(model, store=store, eos_token_id=()), first,
                SamplingParams(max_tokens=3))
    seg = sorted((path / "segments").iterdir())[0]
    data = bytearray(seg.read_bytes())
    at = len(data) // 2  # inside a block of the first job's five (the third, as laid out)
    data[at:at + 64] = bytes(b ^ 0xFF for b in data[at:at + 64])
    seg.write_bytes(bytes(data))
    with open_store_for(model, path, **STORE) as store:
        outs, rep = counted(TransformersEngine(model, store=store, eos_token_id=()), second,
                            SamplingParams(max_tokens=3))
        assert [list(c.token_ids) for c in outs] == refs
        assert 0 < rep.stored_tokens < 40  # the run up to the damaged block
        assert rep.computed_tokens + rep.stored_tokens == unique_tokens(second)
        healed, rep = counted(TransformersEngine(model, store=store, eos_token_id=()), second,
                              SamplingParams(max_tokens=3))
        assert [list(c.token_ids) for c in healed] == refs
        assert rep.stored_tokens == 96  # the damaged block was put again


# -- bad input ----------------------------------------------------------------------------------
def _never(i, c):
    raise AssertionError(f"request {i} completed: the bad input was not refused up front")


def test_a_plan_for_fewer_prompts_is_refused(model):
    """Before: ``run(reqs, plan=plan_of_one)`` with two requests ran one and returned, the
    other getting no completion and no error."""
    rng = random.Random(23)
    a = toks(rng, 40)
    engine = TransformersEngine(model, eos_token_id=())
    reqs = [BatchRequest("x", tuple(a + [5])), BatchRequest("y", tuple(a + [6]))]
    with pytest.raises(ValueError, match="the plan is for 1 prompts, got 2"):
        engine.run(reqs, plan=engine.plan(reqs[:1]), on_done=_never)
    with pytest.raises(ValueError, match="the plan is for 3 prompts, got 2"):
        engine.run(reqs, plan=engine.plan([*reqs, reqs[0]]), on_done=_never)


def test_a_plan_for_other_prompts_is_refused(model):
    """Before: a plan made for other prompts of the same count ran, and a row whose prompt does
    not start with the prefix the plan gives it decoded against another prompt's K/V
    (silently wrong tokens)."""
    rng = random.Random(24)
    a, b = toks(rng, 40), toks(rng, 40)
    engine = TransformersEngine(model, eos_token_id=())
    planned = [BatchRequest("x", tuple(a + [5])), BatchRequest("y", tuple(a + [6]))]
    reqs = [BatchRequest("x", tuple(a + [5])), BatchRequest("y", tuple(b + [6]))]
    with pytest.raises(ValueError, match="prompt 1 does not start with the 40 tokens"):
        engine.run(reqs, plan=engine.plan(planned), on_done=_never)
    # the plan of the same prompts (another engine's, say) is taken
    got = {}
    engine.run(planned, plan=engine.plan(planned), on_done=got.__setitem__)
    assert [list(got[i].token_ids) for i in range(2)] == [
        hf_generate(model, r.token_ids, 16) for r in planned]


def test_prompts_the_model_cannot_take_are_refused_before_any_forward():
    """Before: a prompt as long as the context decoded one token past it, and a token id
    outside the vocabulary failed in the embedding (``IndexError: index out of range in
    self``) after the requests before it had completed."""
    m = make_model(max_position_embeddings=48)
    engine = TransformersEngine(m, eos_token_id=())
    ok = BatchRequest("ok", (1, 2, 3))
    cases = [
        ((5,) * 48, "request 'bad' has 48 prompt tokens; the model's context is 48"),
        ((1, 2, 512), r"request 'bad' has token id 512, outside the model's vocabulary \[0, 512\)"),
        ((1, -1), "request 'bad' has token id -1"),
        ((), "every prompt needs at least one token"),
    ]
    for ids, msg in cases:
        with pytest.raises(ValueError, match=msg):
            engine.run([ok, BatchRequest("bad", ids)], on_done=_never)


@pytest.mark.parametrize("kw, msg", [
    ({"max_tokens": 0}, "max_tokens must be a whole number >= 1, got 0"),
    ({"max_tokens": -3}, "max_tokens must be"),
    ({"max_tokens": 2.5}, "max_tokens must be"),
    ({"temperature": -1.0}, "temperature must be a finite number >= 0, got -1.0"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in"),
    ({"top_k": -1}, "top_k must be a whole number >= 0"),
    ({"seed": 2**64}, r"seed must be a whole number in \[-2\*\*63, 2\*\*64\)"),
])
def test_bad_sampling_params_are_refused(kw, msg):
    """Before: ``max_tokens=0`` (or -3) generated one token, a negative temperature sampled the
    least likely tokens, a NaN one raised in ``torch.multinomial`` half way through the job,
    ``top_k=-1`` ran as off and ``top_p=0`` as greedy."""
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_bad_budgets_are_refused(model):
    """Before: ``max_prefix_tokens=0`` silently became the default (32 x max_batch_tokens)."""
    for kw in ({"max_prefix_tokens": 0}, {"max_prefix_tokens": -5}):
        with pytest.raises(ValueError, match="max_prefix_tokens must be >= 1"):
            TransformersEngine(model, **kw)
    for kw in ({"max_batch_tokens": 0}, {"max_batch_rows": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            TransformersEngine(model, **kw)
