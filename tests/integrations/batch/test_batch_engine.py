"""The token-batched transformers engine: outputs equal per-prompt ``model.generate``.

A tiny Llama with seeded random weights (float32, widened init so greedy choices are not
float-noise ties), built from ``LlamaConfig``: no downloads.
"""

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.integrations.batch import BatchRequest, SamplingParams  # noqa: E402
from kvstore.integrations.batch.engines.transformers import TransformersEngine  # noqa: E402

VOCAB = 512


def make_model(seed=0, family="llama", **over):
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    kw.update(over)
    cfg = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[family](**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    return model


@pytest.fixture(scope="module")
def model():
    return make_model()


def toks(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def hf_generate(model, prompt, max_new, eos=None, **kw):
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=kw.pop("do_sample", False), eos_token_id=eos, pad_token_id=0,
                         **kw)
    return out[0, ids.shape[1]:].tolist()


def run(engine, prompts, params):
    reqs = [BatchRequest(str(i), tuple(p), params[i] if isinstance(params, list) else params)
            for i, p in enumerate(prompts)]
    got = {}
    rep = engine.run(reqs, on_done=lambda i, c: got.__setitem__(i, c))
    assert sorted(got) == list(range(len(reqs)))
    return [got[i] for i in range(len(reqs))], rep


def workloads(seed=0):
    """Scaled-down versions of the issue's three workloads, and one of very mixed lengths."""
    rng = random.Random(seed)
    doc = toks(rng, 300)
    w1 = [doc + toks(rng, rng.randrange(4, 30)) for _ in range(12)]
    instr = toks(rng, 120)
    w2 = [instr + toks(rng, rng.randrange(4, 30)) for _ in range(20)]
    docs = [toks(rng, rng.randrange(100, 250)) for _ in range(4)]
    w3 = [d + toks(rng, rng.randrange(3, 20)) for d in docs for _ in range(4)]
    rng.shuffle(w3)
    system = toks(rng, 40)
    w4 = [system + toks(rng, rng.randrange(1, 400)) for _ in range(6)] + [toks(rng, n) for n in (1, 2, 700)]
    w4 += [system + docs[0] + toks(rng, 5), system + docs[0] + toks(rng, 9)]
    rng.shuffle(w4)
    return {"doc": w1, "instr": w2, "docs": w3, "mixed": w4}


@pytest.mark.parametrize("name", ["doc", "instr", "docs", "mixed"])
def test_greedy_equals_per_prompt_generate(model, name):
    prompts = workloads()[name]
    engine = TransformersEngine(model, eos_token_id=(), max_batch_tokens=256, max_batch_rows=8)
    outs, rep = run(engine, prompts, SamplingParams(max_tokens=6))
    for p, c in zip(prompts, outs, strict=True):
        assert list(c.token_ids) == hf_generate(model, p, 6)
        assert c.finish_reason == "length" and c.prompt_tokens == len(p)
    assert rep.generated_tokens == 6 * len(prompts)
    assert rep.computed_tokens <= rep.prompt_tokens
    if name != "mixed":  # every shared prefix computed once: nothing is computed twice
        from kvstore.integrations.batch import unique_tokens

        assert rep.computed_tokens == unique_tokens(prompts)


def test_one_forward_per_group_and_packing(model):
    """Token batching: 4 groups of 4 fit one batch: 4 prefix forwards + 1 prefill + 5 decode."""
    prompts = workloads()["docs"]
    engine = TransformersEngine(model, eos_token_id=())
    _, rep = run(engine, prompts, SamplingParams(max_tokens=6))
    assert rep.forwards == 4 + 1 + 5
    # a budget of one row per batch: 16 prefills and decodes, still 4 prefix forwards
    small = TransformersEngine(model, eos_token_id=(), max_batch_rows=1)
    outs_small, rep_small = run(small, prompts, SamplingParams(max_tokens=6))
    assert rep_small.forwards == 4 + 16 * 6
    assert rep_small.computed_tokens == rep.computed_tokens


def test_eos_at_different_steps_and_list_eos(model):
    prompts = workloads()["doc"] + workloads()["mixed"]
    plain = [hf_generate(model, p, 8) for p in prompts]
    # end-of-sequence tokens that some prompts hit at different steps (and others never)
    eos = sorted({plain[0][2], plain[3][5], plain[5][1]})
    engine = TransformersEngine(model, eos_token_id=eos, max_batch_rows=5)
    outs, _ = run(engine, prompts, SamplingParams(max_tokens=8))
    steps = set()
    for p, c in zip(prompts, outs, strict=True):
        ref = hf_generate(model, p, 8, eos=eos)
        assert list(c.token_ids) == ref
        stopped = ref[-1] in eos
        assert c.finish_reason == ("stop" if stopped else "length")
        steps.add(len(ref))
    assert len(steps) >= 3  # EOS really came at different steps
    # ignore_eos runs to max_tokens
    outs, _ = run(engine, prompts[:3], SamplingParams(max_tokens=8, ignore_eos=True))
    assert all(len(c.token_ids) == 8 for c in outs)


def test_default_eos_is_the_generation_config(model):
    prompts = workloads()["instr"][:6]
    plain = [hf_generate(model, p, 8) for p in prompts]
    m = make_model()
    m.generation_config.eos_token_id = [plain[0][3], plain[1][2]]  # a list
    outs, _ = run(TransformersEngine(m), prompts, SamplingParams(max_tokens=8))
    for p, c in zip(prompts, outs, strict=True):
        assert list(c.token_ids) == hf_generate(m, p, 8, eos=m.generation_config.eos_token_id)
    assert len(outs[0].token_ids) == 4 and len(outs[1].token_ids) == 3


def test_stop_token_ids_and_per_request_max_tokens(model):
    prompts = workloads()["doc"][:5]
    plain = [hf_generate(model, p, 8) for p in prompts]
    params = [SamplingParams(max_tokens=k + 1) for k in range(4)]
    params.append(SamplingParams(max_tokens=8, stop_token_ids=(plain[4][3],)))
    outs, _ = run(TransformersEngine(model, eos_token_id=()), prompts, params)
    for k in range(4):
        assert list(outs[k].token_ids) == plain[k][: k + 1]
        assert outs[k].finish_reason == "length"
    stop = plain[4][3]
    assert list(outs[4].token_ids) == plain[4][: plain[4].index(stop) + 1]
    assert outs[4].finish_reason == "stop" and outs[4].stop_reason == stop


def test_sampling_reproducible_and_equal_to_hf_sampling(model):
    prompts = workloads()["doc"][:6]
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, top_k=k, seed=100 + i)
              for i, k in enumerate([0, 0, 20, 0, 50, 0])]
    engine = TransformersEngine(model, eos_token_id=())
    a, _ = run(engine, prompts, params)
    # the same requests in another batch composition (reversed, one row per batch)
    alone = TransformersEngine(model, eos_token_id=(), max_batch_rows=1)
    b, _ = run(alone, prompts[::-1], params[::-1])
    assert [c.token_ids for c in a] == [c.token_ids for c in b[::-1]]
    for p, sp, c in zip(prompts, params, a, strict=True):
        torch.manual_seed(sp.seed)
        ref = hf_generate(model, p, 8, do_sample=True, temperature=sp.temperature,
                          top_p=sp.top_p, top_k=sp.top_k)
        assert list(c.token_ids) == ref
    greedy, _ = run(engine, prompts[:1], SamplingParams(max_tokens=8))
    assert a[0].token_ids != greedy[0].token_ids  # it did sample


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_families_and_sliding_window(family):
    over = {"sliding_window": 48} if family == "mistral" else {}
    m = make_model(family=family, **over)
    prompts = workloads(seed=3)["docs"][:8]
    outs, _ = run(TransformersEngine(m, eos_token_id=(), max_batch_rows=3), prompts,
                  SamplingParams(max_tokens=5))
    for p, c in zip(prompts, outs, strict=True):
        assert list(c.token_ids) == hf_generate(m, p, 5)


def test_context_limit_ends_with_length(model):
    m = make_model(max_position_embeddings=64)
    rng = random.Random(5)
    base = toks(rng, 40)
    prompts = [base + toks(rng, 20), base + toks(rng, 10)]
    outs, _ = run(TransformersEngine(m, eos_token_id=()), prompts, SamplingParams(max_tokens=50))
    assert [len(c.token_ids) for c in outs] == [64 - 60, 64 - 50]
    assert all(c.finish_reason == "length" for c in outs)


def test_prefixes_from_and_to_a_store(model, tmp_path):
    from kvstore.integrations.transformers import open_store_for

    prompts = workloads()["docs"]
    with open_store_for(model, tmp_path / "s", block_tokens=8, device="cpu", gpu_capacity=0,
                        cpu_capacity="8MiB", disk_capacity="64MiB") as store:
        first, rep1 = run(TransformersEngine(model, store=store, eos_token_id=()), prompts,
                          SamplingParams(max_tokens=4))
        assert rep1.stored_tokens == 0
    with open_store_for(model, tmp_path / "s", block_tokens=8, device="cpu", gpu_capacity=0,
                        cpu_capacity="8MiB", disk_capacity="64MiB") as store:
        again, rep2 = run(TransformersEngine(model, store=store, eos_token_id=()), prompts,
                          SamplingParams(max_tokens=4))
        other, rep3 = run(TransformersEngine(model, store=store, salt="b", eos_token_id=()),
                          prompts, SamplingParams(max_tokens=4))
    assert [c.token_ids for c in again] == [c.token_ids for c in first] == [c.token_ids for c in other]
    assert rep2.stored_tokens > 0 and rep2.computed_tokens < rep1.computed_tokens
    assert rep3.stored_tokens == 0  # another salt: none of the first job's blocks


def test_store_layout_mismatch_is_refused(model):
    from kvstore.errors import ConfigError
    from kvstore.integrations.transformers import open_store_for

    other = make_model(num_key_value_heads=4)
    with open_store_for(other, None, device="cpu", gpu_capacity=0, cpu_capacity="1MiB") as store, \
            pytest.raises(ConfigError, match="does not match"):
        TransformersEngine(model, store=store)


def test_run_follows_the_cores_left_to_it(model):
    """Threads not fixed: each run starts on the cores other processes leave it (a fresh
    look), and a forward switches when the share changes; restored after the run."""
    from support.cores import FakeCores

    from kvstore.integrations.batch.engines.split import wide_threads

    m = FakeCores()
    engine = TransformersEngine(model, eos_token_id=())
    engine._share = m.share(2)
    seen = []
    h = model.model.layers[0].register_forward_pre_hook(
        lambda mod, args: seen.append(wide_threads() or torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        m.advance(1.0, others=1.0, own=0.0)  # another process keeps one core busy
        _, rep = run(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
        assert set(seen) == {1} and torch.get_num_threads() == before
        assert rep.threads == (1, 1)
        seen.clear()
        m.advance(1.0, others=0.0, own=0.5)  # it stopped
        _, rep = run(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
        assert set(seen) == {2} and rep.threads == (2, 2)
        seen.clear()
        # it comes back during the run: the next forward (a second on) runs on one thread
        busy = model.model.layers[1].register_forward_pre_hook(
            lambda mod, args: m.advance(1.0, others=1.0, own=1.0))
        try:
            _, rep = run(engine, [[5, 6, 7]], SamplingParams(max_tokens=3))
        finally:
            busy.remove()
        assert seen == [2, 1, 1] and rep.threads == (1, 2)
    finally:
        h.remove()
        torch.set_num_threads(before)
    fixed = TransformersEngine(model, eos_token_id=(), threads=1)
    assert fixed._share is None  # threads= fixes the count: no looks


def test_run_sets_threads_and_packs_linears_then_restores(model):
    from kvstore.integrations.batch.engines.linear import packing_available

    seen = {}
    lin = model.model.layers[0].mlp.up_proj

    def hook(mod, args):
        seen["threads"] = torch.get_num_threads()
        seen["packed"] = "forward" in lin.__dict__

    h = model.model.layers[0].register_forward_pre_hook(hook)
    before = torch.get_num_threads()
    try:
        engine = TransformersEngine(model, eos_token_id=(), threads=1)
        run(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        h.remove()
    assert seen["threads"] == 1 and torch.get_num_threads() == before
    assert seen["packed"] == packing_available()
    assert "forward" not in lin.__dict__  # the model is as it was


def test_packed_linears_match_and_follow_weight_changes():
    from kvstore.integrations.batch.engines.linear import PackedLinears, packing_available

    if not packing_available():
        pytest.skip("no oneDNN in this torch")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 40, bias=False))
    x = torch.randn(1, 9, 64)
    p = PackedLinears(m)
    for _ in range(2):
        with torch.no_grad():
            want = m(x)
            with p.active() as n:
                got = m(x)
        assert n == 2
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            m[0].weight.mul_(-2.0)  # packed again on the next use


def test_linears_are_packed_when_the_engine_is_built(model):
    """Packing happens at construction (as vLLM packs at load), not in a run's time."""
    from kvstore.integrations.batch.engines import linear

    if not linear.packing_available():
        pytest.skip("no oneDNN in this torch")
    engine = TransformersEngine(model, eos_token_id=())
    n = sum(1 for m in model.modules() if linear._packable(m))
    packed = {m: t for m, (_, t) in engine._linears._packed.items()}
    assert n and len(packed) == n
    run(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
    assert all(engine._linears._packed[m][1] is t for m, t in packed.items())  # none again


def test_heap_reuse_during_a_run_then_glibc_ceiling(model, monkeypatch):
    """A run keeps large freed blocks in the heap (glibc's mallopt), nested blocks share the
    setting, and the thresholds drop to glibc's own ceiling afterwards."""
    from kvstore.integrations.batch.engines import allocator

    calls = []

    class Lib:
        def mallopt(self, what, value):
            calls.append((what, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(allocator, "_libc", Lib())
    engine = TransformersEngine(model, eos_token_id=())
    with allocator.heap_reuse() as on:
        assert on
        run(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))  # nested: no change, no trim
        assert calls == [(-3, allocator.RUN_THRESHOLD), (-1, allocator.RUN_THRESHOLD)]
    assert calls[2:] == [(-3, allocator.AFTER_MMAP), (-1, allocator.AFTER_TRIM), ("trim", 0)]
    calls.clear()
    run(engine, [[5, 6, 7]], SamplingParams(max_tokens=2))
    assert len(calls) == 5 and calls[-1] == ("trim", 0)
    monkeypatch.setattr(allocator, "_libc", False)  # not glibc: nothing to set
    with allocator.heap_reuse() as on:
        assert not on


def test_heap_reuse_on_this_libc():
    import sys

    from kvstore.integrations.batch.engines import allocator

    with allocator.heap_reuse() as on:
        big = torch.ones(8 << 20)  # 32 MiB: from the heap, not a fresh mapping
        del big
    assert on == (sys.platform.startswith("linux") and allocator._glibc() is not None)


def test_gated_mlp_runs_fused_and_matches(model):
    from kvstore.integrations.batch.engines import linear

    if not linear.packing_available():
        pytest.skip("no oneDNN in this torch")
    mlp = model.model.layers[0].mlp
    assert linear._gated_silu(mlp)
    x = torch.randn(1, 7, model.config.hidden_size)
    with torch.no_grad():
        want = mlp(x)
        p = linear.PackedLinears(model)
        with p.active():
            assert "forward" in mlp.__dict__
            got = mlp(x)
    assert "forward" not in mlp.__dict__
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not linear._gated_silu(torch.nn.Linear(4, 4))


def test_gated_mlp_in_row_chunks_matches(model, monkeypatch):
    """A fused MLP over more rows than ``_MLP_WHOLE`` runs in chunks (the last one short)."""
    from kvstore.integrations.batch.engines import linear

    if not linear.packing_available():
        pytest.skip("no oneDNN in this torch")
    monkeypatch.setattr(linear, "_MLP_WHOLE", 8)
    monkeypatch.setattr(linear, "_MLP_CHUNK", 5)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 23, model.config.hidden_size)
    with torch.no_grad():
        want = mlp(x)
        with linear.PackedLinears(model).active():
            got = mlp(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_small_forwards_split_threads(model, monkeypatch):
    """A decode step's element-wise operations run on one thread, its linear layers on the
    run's threads; a forward over SMALL_FORWARD tokens runs wholly on them; greedy outputs
    as HF's; the threads are restored after."""
    from kvstore.integrations.batch.engines import linear, split
    from kvstore.integrations.batch.engines import transformers as tf

    if not linear.packing_available():
        pytest.skip("no oneDNN in this torch")
    seen = {"norm": set(), "linear": set()}
    op = torch.ops.mkldnn._linear_pointwise
    real_wide = split.wide

    def spy_wide(fn, *a, **kw):
        def call(*a, **kw):
            if fn is op:
                seen["linear"].add(torch.get_num_threads())
            return fn(*a, **kw)
        return real_wide(call, *a, **kw)

    monkeypatch.setattr(linear, "wide", spy_wide)
    monkeypatch.setattr(tf, "SMALL_FORWARD", 8)
    norm = model.model.layers[1].input_layernorm
    def hook(mod, args):
        seen["norm"].add((args[0].shape[1], torch.get_num_threads()))

    engine = TransformersEngine(model, eos_token_id=(), threads=2)  # (its probe forward)
    h = norm.register_forward_pre_hook(hook)
    prompt = list(range(5, 25))
    try:
        before = torch.get_num_threads()
        out, _ = run(engine, [prompt], SamplingParams(max_tokens=3))
    finally:
        h.remove()
    assert torch.get_num_threads() == before and split.wide_threads() == 0
    assert seen["norm"] == {(20, 2), (1, 1)}  # the prefill on 2 threads, decode steps on 1
    assert seen["linear"] == {2}
    assert list(out[0].token_ids) == hf_generate(model, prompt, 3)
    with split.small_ops(1) as on:  # one thread: nothing to split
        assert not on and split.wide(lambda: torch.get_num_threads()) == torch.get_num_threads()
