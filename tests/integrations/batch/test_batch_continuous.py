"""Continuous batching in the transformers engine: rows join the running ones as soon as the
budgets leave room, one forward mixing their prefill with the others' decode steps, and rows
leave as they finish. Outputs stay those of per-prompt ``model.generate``."""

import random

import pytest
import torch

pytest.importorskip("transformers")

from test_batch_engine import hf_generate, make_model, run, toks

from kvstore.integrations.batch import SamplingParams
from kvstore.integrations.batch.engines import attention as A
from kvstore.integrations.batch.engines.transformers import TransformersEngine


@pytest.fixture(scope="module")
def model():
    return make_model()


def job(seed=0, n=24):
    """Prompts on 3 system prompts, shuffled, with 1-10 new tokens each (so rows finish at
    different steps and others can take their place)."""
    rng = random.Random(seed)
    systems = [toks(rng, rng.randrange(20, 60)) for _ in range(3)]
    prompts = [rng.choice(systems) + toks(rng, rng.randrange(3, 40)) for _ in range(n)]
    new = [rng.randrange(1, 11) for _ in range(n)]
    return prompts, new


class Spy:
    """Records each forward of an engine: its parts (suffix buffers) and their rows."""

    def __init__(self, engine, monkeypatch):
        self.forwards: list[list[A.PartSpec]] = []
        real = A.make_parts_plan

        def spy(groups, specs, *, device):
            self.forwards.append(list(specs))
            return real(groups, specs, device=device)

        monkeypatch.setattr("kvstore.integrations.batch.engines.transformers.make_parts_plan", spy)

    def mixed(self) -> int:
        """Forwards where fresh rows (starting at column 0) ran beside decoding rows."""
        return sum(any(any(s == 0 for s in sp.starts) for sp in f)
                   and any(any(s > 0 for s in sp.starts) for sp in f) for f in self.forwards)


def test_rows_join_running_ones_and_outputs_equal_generate(model, monkeypatch):
    prompts, new = job()
    params = [SamplingParams(max_tokens=k) for k in new]
    engine = TransformersEngine(model, eos_token_id=(), max_batch_tokens=96, max_batch_rows=6)
    spy = Spy(engine, monkeypatch)
    outs, rep = run(engine, prompts, params)
    for p, k, c in zip(prompts, new, outs, strict=True):
        assert list(c.token_ids) == hf_generate(model, p, k)
        assert c.finish_reason == "length"
    assert spy.mixed() >= 3  # prefills really ran beside decode steps
    assert max(len(f) for f in spy.forwards) >= 2  # rows of several suffix buffers at once
    # within the budgets: a forward's tokens (each decoding row's one counts) and its rows
    for f in spy.forwards[1:]:
        if any(s > 0 for sp in f for s in sp.starts):  # not a prefix forward
            assert sum(sum(sp.counts) for sp in f) <= 96
            assert sum(len(sp.rows) for sp in f) <= 6
    assert rep.generated_tokens == sum(new)

    static = TransformersEngine(model, eos_token_id=(), max_batch_tokens=96, max_batch_rows=6,
                                continuous=False)
    outs_s, rep_s = run(static, prompts, params)
    assert [c.token_ids for c in outs_s] == [c.token_ids for c in outs]
    assert rep.computed_tokens == rep_s.computed_tokens
    assert rep.forwards < rep_s.forwards  # decode steps rode along with prefills


def test_eos_and_stop_tokens_free_places_mid_run(model):
    prompts, _ = job(seed=1, n=16)
    plain = [hf_generate(model, p, 8) for p in prompts]
    eos = sorted({plain[0][1], plain[5][4]})
    params = [SamplingParams(max_tokens=8, stop_token_ids=(plain[3][2],)) if i == 3
              else SamplingParams(max_tokens=8) for i in range(len(prompts))]
    engine = TransformersEngine(model, eos_token_id=eos, max_batch_tokens=80, max_batch_rows=4)
    outs, _ = run(engine, prompts, params)
    for i, (p, c) in enumerate(zip(prompts, outs, strict=True)):
        ref = hf_generate(model, p, 8, eos=eos)
        if i == 3 and plain[3][2] in ref:
            ref = ref[: ref.index(plain[3][2]) + 1]
        assert list(c.token_ids) == ref


def test_a_suffix_over_the_token_budget_runs_alone(model, monkeypatch):
    rng = random.Random(3)
    system = toks(rng, 40)
    prompts = [system + toks(rng, 10), system + toks(rng, 150), system + toks(rng, 12)]
    engine = TransformersEngine(model, eos_token_id=(), max_batch_tokens=64)
    spy = Spy(engine, monkeypatch)
    outs, _ = run(engine, prompts, SamplingParams(max_tokens=4))
    for p, c in zip(prompts, outs, strict=True):
        assert list(c.token_ids) == hf_generate(model, p, 4)
    big = [f for f in spy.forwards if sum(sum(sp.counts) for sp in f) > 64]
    assert len(big) == 1 and sum(len(sp.rows) for sp in big[0]) == 1


def test_prefix_budget_holds_prefixes_back(model, monkeypatch):
    """Rows of a second prefix wait while the first prefix's rows hold the whole prefix
    budget; the answers are unchanged."""
    rng = random.Random(4)
    a, b = toks(rng, 64), toks(rng, 64)
    prompts = [a + toks(rng, 5) for _ in range(3)] + [b + toks(rng, 5) for _ in range(3)]
    engine = TransformersEngine(model, eos_token_id=(), block_tokens=16, max_prefix_tokens=64)
    held: list[int] = []
    real = engine._forward

    def forward(parts, prefixes):
        if -2 not in prefixes:  # not a prefix's own forward (its base under -2)
            held.append(sum(int(kv[0][0].shape[1]) for kv in prefixes.values() if kv))
        return real(parts, prefixes)

    monkeypatch.setattr(engine, "_forward", forward)
    outs, _ = run(engine, prompts, SamplingParams(max_tokens=3))
    for p, c in zip(prompts, outs, strict=True):
        assert list(c.token_ids) == hf_generate(model, p, 3)
    assert max(held) <= 64


def test_sampled_rows_draw_the_same_whatever_joins_them(model):
    prompts, new = job(seed=2, n=12)
    params = [SamplingParams(max_tokens=k, temperature=0.8, top_k=30, seed=7 + i)
              for i, k in enumerate(new)]
    cont = TransformersEngine(model, eos_token_id=(), max_batch_tokens=64, max_batch_rows=4)
    static = TransformersEngine(model, eos_token_id=(), continuous=False)
    a, _ = run(cont, prompts, params)
    b, _ = run(static, prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_sliding_window_model_with_rows_of_several_buffers():
    m = make_model(family="mistral", sliding_window=24)
    prompts, new = job(seed=5, n=12)
    engine = TransformersEngine(m, eos_token_id=(), max_batch_tokens=64, max_batch_rows=4)
    outs, _ = run(engine, prompts, [SamplingParams(max_tokens=k) for k in new])
    for p, k, c in zip(prompts, new, outs, strict=True):
        assert list(c.token_ids) == hf_generate(m, p, k)


def test_plan_of_two_buffers_equals_two_plans():
    """A forward over two suffix buffers attends each token as the one-buffer plan would."""
    torch.manual_seed(0)
    L, H, D = 1, 2, 8
    kv1 = A.SuffixKV(L, 2, H, 6, D, dtype=torch.float32, device=torch.device("cpu"))
    kv2 = A.SuffixKV(L, 1, H, 6, D, dtype=torch.float32, device=torch.device("cpu"))
    for kv in (kv1, kv2):
        kv.k[0].normal_()
        kv.v[0].normal_()
    s1 = A.PartSpec(kv1, (0, 1), (3, 2), (1, 1), (0, 0))  # two rows decoding
    s2 = A.PartSpec(kv2, (0,), (0,), (4,), (0,))  # one row's prefill
    both = A.make_parts_plan([A.GroupSlice(0, 6, (), 0)], [s1, s2], device=torch.device("cpu"))
    assert [(p.start, p.stop) for p in both.parts] == [(0, 2), (2, 6)]
    assert both.positions.tolist() == [3, 2, 0, 1, 2, 3]
    q = torch.randn(H, 1, 6, D)
    o, lse = A._suffix_part(both, 0, q, D ** -0.5, None, None)
    one = A.make_parts_plan([A.GroupSlice(0, 2, (), 0)], [s1], device=torch.device("cpu"))
    two = A.make_parts_plan([A.GroupSlice(0, 4, (), 0)], [s2], device=torch.device("cpu"))
    o1, l1 = A._suffix_part(one, 0, q[:, :, :2], D ** -0.5, None, None)
    o2, l2 = A._suffix_part(two, 0, q[:, :, 2:], D ** -0.5, None, None)
    torch.testing.assert_close(o, torch.cat((o1, o2), 2))
    torch.testing.assert_close(lse, torch.cat((l1, l2), 2))
    with pytest.raises(ValueError, match="at least one"):
        A.make_parts_plan([], [], device=torch.device("cpu"))
    with pytest.raises(ValueError, match=">= 1 token"):
        A.make_parts_plan([], [A.PartSpec(kv2, (0,), (0,), (0,), (0,))], device=torch.device("cpu"))


def test_a_group_of_scattered_tokens_attends_its_prefix_as_a_contiguous_one():
    """Decode tokens of one prefix spread over a forward (rows of several buffers) form one
    group by index: the same result as each token in a group of its own."""
    torch.manual_seed(1)
    L, H, G, D, P = 1, 2, 2, 8, 5
    pa = (torch.randn(H, P, D), torch.randn(H, P, D))
    pb = (torch.randn(H, P + 2, D), torch.randn(H, P + 2, D))
    kv = A.SuffixKV(L, 4, H, 6, D, dtype=torch.float32, device=torch.device("cpu"))
    spec = A.PartSpec(kv, (0, 1, 2, 3), (2, 3, 1, 4), (1, 1, 1, 1), (P, P + 2, P, P + 2))
    cpu = torch.device("cpu")
    scattered = A.make_parts_plan(
        [A.GroupSlice(0, 0, (pa,), P, torch.tensor([0, 2])),
         A.GroupSlice(0, 0, (pb,), P + 2, torch.tensor([1, 3]))], [spec], device=cpu)
    single = A.make_parts_plan(
        [A.GroupSlice(i, i + 1, (pa,) if i % 2 == 0 else (pb,), P if i % 2 == 0 else P + 2)
         for i in range(4)], [spec], device=cpu)
    q = torch.randn(H, G, 4, D)
    o1, l1 = A._prefix_part(scattered, 0, q, D ** -0.5, None, None)
    o2, l2 = A._prefix_part(single, 0, q, D ** -0.5, None, None)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
    assert torch.isfinite(l1).all()  # every token met its prefix


def test_a_stopped_row_gives_its_slot_to_the_last_running_row():
    """Running rows stay in a buffer's leading rows (attention reads them as a slice): the
    last one moves into a stopped row's slot, with its K/V."""
    from kvstore.integrations.batch.engines import transformers as T

    kv = A.SuffixKV(2, 3, 1, 4, 2, dtype=torch.float32, device=torch.device("cpu"))
    for t in (*kv.k, *kv.v):
        for i in range(3):
            t[i] = i + 1
    buf = T._Buffer(kv)
    buf.rows = [T._Live(None, None, buf, i, 2 + i) for i in range(3)]
    first, mid, last = buf.rows
    buf.leave(mid)
    assert buf.rows == [first, last] and last.slot == 1
    for t in (*kv.k, *kv.v):
        assert (t[1] == 3).all() and (t[0] == 1).all()  # its 4 columns (length 4) moved
    buf.leave(last)  # the last row itself: nothing moves
    assert buf.rows == [first] and (kv.k[0][0] == 1).all()


def test_a_buffer_mostly_stopped_moves_its_rows_to_one_of_their_size():
    from kvstore.integrations.batch.engines import transformers as T

    kv = A.SuffixKV(2, 8, 1, 4, 2, dtype=torch.float32, device=torch.device("cpu"))
    for t in (*kv.k, *kv.v):
        for i in range(8):
            t[i] = i + 1
    buf = T._Buffer(kv)
    buf.rows = [T._Live(None, None, buf, i, 4) for i in range(8)]
    for _ in range(5):
        buf.leave(buf.rows[0])  # row 0's slot: the last row moves in each time
    assert buf.kv is kv and len(buf.rows) == 3  # 3 of 8 still run: kept
    buf.leave(buf.rows[0])
    assert buf.kv is not kv and buf.kv.rows == 2 and buf.kv.capacity == 4
    assert [lv.slot for lv in buf.rows] == [0, 1]
    # the two running rows' K/V (the old buffer's leading rows) came along
    for old, new in zip((*kv.k, *kv.v), (*buf.kv.k, *buf.kv.v), strict=True):
        assert torch.equal(new, old[:2])
