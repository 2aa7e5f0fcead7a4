"""The batched engine's float32 attention kernel (``kvstore._attention`` through
``engines.flash``): equal to a float64 reference to float32 rounding on every shape it takes,
the same on any number of threads, ``None`` (torch's kernel) for what it does not take, and
the engine's greedy outputs equal HF ``generate`` with it in every attention call."""

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.integrations.batch import BatchRequest, SamplingParams  # noqa: E402
from kvstore.integrations.batch.engines import flash  # noqa: E402
from kvstore.integrations.batch.engines.transformers import TransformersEngine  # noqa: E402

needs_kernel = pytest.mark.skipif(not flash.kernel_available(),
                                  reason="kvstore._attention was not built (no C compiler)")


def reference(q, k, v, scale, causal):
    G = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(G, 1).double()
    vv = v.repeat_interleave(G, 1).double()
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    M, K = s.shape[-2:]
    if causal:  # query i sees keys j <= i + K - M
        seen = torch.arange(K).unsqueeze(0) <= torch.arange(M).unsqueeze(1) + (K - M)
        s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vv).float(), lse.float()


SHAPES = [  # B, Hq, Hkv, M, K, D, causal
    (1, 4, 2, 70, 70, 64, True),  # GQA, one key block, a query tail
    (1, 6, 2, 130, 400, 64, True),  # causal over two key blocks, the last rows see all
    (1, 6, 2, 600, 600, 64, True),
    (2, 3, 3, 5, 300, 128, False),  # batch of two, D 128
    (1, 2, 2, 300, 33, 64, False),  # keys past no tile boundary
    (1, 3, 1, 1, 1000, 64, False),  # one query
    (1, 2, 1, 1, 1, 64, False),  # one key
    (1, 1, 1, 7, 520, 64, True),  # causal with fewer queries than keys
]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_a_float64_reference_on_any_thread_count(monkeypatch, shape):
    monkeypatch.setattr(flash, "MIN_WORK", 0)
    B, Hq, Hkv, M, K, D, causal = shape
    g = torch.Generator().manual_seed(M * 7 + K)
    q = torch.randn(B, Hq, M, D, generator=g) * 3  # sharp softmaxes too
    k, v = torch.randn(B, Hkv, K, D, generator=g), torch.randn(B, Hkv, K, D, generator=g)
    ref_o, ref_lse = reference(q, k, v, D ** -0.5, causal)
    one = flash.attend(q, k, v, D ** -0.5, causal, threads=1)
    assert one is not None
    torch.testing.assert_close(one[0], ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(one[1], ref_lse, rtol=0, atol=1e-5)
    for threads in (2, 3):  # each work item is one thread's: the same bits
        o, lse = flash.attend(q, k, v, D ** -0.5, causal, threads=threads)
        assert torch.equal(o, one[0]) and torch.equal(lse, one[1])


@needs_kernel
def test_takes_the_layouts_transformers_hands_it(monkeypatch):
    """Queries as transformers gives them (``[B, N, H, D]`` transposed: heads not outermost)
    and keys sliced out of a longer buffer: strides, not copies."""
    monkeypatch.setattr(flash, "MIN_WORK", 0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 90, 6, 64, generator=g).transpose(1, 2)  # [1, 6, 90, 64], strided
    buf = torch.randn(3, 2, 128, 64, generator=g)
    k, v = buf[1:2, :, :90], buf[2:3, :, :90]
    o, lse = flash.attend(q, k, v, 0.125, True)
    ref_o, ref_lse = reference(q, k, v, 0.125, True)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)


def test_what_it_does_not_take_goes_to_torch(monkeypatch):
    monkeypatch.setattr(flash, "MIN_WORK", 0)
    q, k = torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)
    assert flash.attend(q.double(), k.double(), k.double(), 0.1, False) is None
    assert flash.attend(q.bfloat16(), k.bfloat16(), k.bfloat16(), 0.1, False) is None
    assert flash.attend(torch.randn(1, 2, 8, 96), torch.randn(1, 2, 8, 96),
                        torch.randn(1, 2, 8, 96), 0.1, False) is None  # D not a multiple of 64
    assert flash.attend(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, k, 0.1,
                        False) is None  # last dimension strided
    assert flash.attend(q.requires_grad_(), k, k, 0.1, False) is None
    assert flash.attend(torch.randn(1, 3, 8, 64), k, k, 0.1, False) is None  # 3 heads on 2
    monkeypatch.setattr(flash, "MIN_WORK", 1 << 21)
    assert flash.attend(torch.randn(1, 2, 8, 64), k, k, 0.1, False) is None  # too small to gain
    monkeypatch.setattr(flash, "MIN_WORK", 0)
    monkeypatch.setattr(flash, "_kernel", None)  # a build without it
    assert flash.attend(torch.randn(1, 2, 8, 64), k, k, 0.1, False) is None


@needs_kernel
def test_bad_arguments_are_a_value_error():
    from kvstore import _attention

    with pytest.raises(ValueError, match="threads >= 1"):
        _attention.attend(1, 1, 1, 1, 1, 1, 2, 2, 1, 1, 64, (1, 1, 1), (1, 1, 1), (1, 1, 1),
                          0.1, False, 0)
    with pytest.raises(ValueError, match="multiple of 64"):
        _attention.attend(1, 1, 1, 1, 1, 1, 2, 2, 1, 1, 96, (1, 1, 1), (1, 1, 1), (1, 1, 1),
                          0.1, False, 1)


def rows_reference(q, k, v, qstart, mlen, krow, klen, scale, causal):
    """Per sequence: its queries (rows of ``q [Hq, N, D]``) against its buffer row's keys."""
    outs = []
    for a, m, r, n in zip(qstart, mlen, krow, klen, strict=True):
        o, lse = reference(q[:, a:a + m].unsqueeze(0), k[r:r + 1, :, :n], v[r:r + 1, :, :n],
                           scale, causal)
        outs.append((a, m, o[0], lse[0]))
    return outs


ROWS = [  # Hkv, G, D, per sequence (queries, keys), causal
    (4, 3, 64, [(1, 120), (1, 7), (1, 300), (1, 1)], True),  # a decode step: one query each
    (2, 7, 64, [(1, 250), (1, 33)], True),  # 7 query heads on a KV head (a 0.5B's 14 / 2)
    (2, 2, 128, [(5, 5), (70, 70), (3, 140)], True),  # prefills and a multi-token step
    (1, 1, 64, [(65, 300), (2, 2)], False),
]


@needs_kernel
@pytest.mark.parametrize("shape", ROWS)
def test_rows_equal_a_float64_reference_per_sequence(shape):
    """Sequences of different lengths, each against its own (not leading) buffer row, queries
    strided as the packed forward hands them; rows no sequence covers are left alone."""
    Hkv, G, D, seqs, causal = shape
    g = torch.Generator().manual_seed(len(seqs) * 13 + D)
    C = max(n for _, n in seqs) + 3
    k = torch.randn(len(seqs) + 2, Hkv, C, D, generator=g)
    v = torch.randn(len(seqs) + 2, Hkv, C, D, generator=g)
    qstart, at = [], 1
    for m, _ in seqs:
        qstart.append(at)
        at += m + 1  # a gap between sequences
    q = (torch.randn(at, Hkv * G, D, generator=g) * 3).transpose(0, 1)  # [Hq, N, D], strided
    krow = list(range(len(seqs) + 1, 1, -1))[:len(seqs)]
    idx = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    mlen, klen = [m for m, _ in seqs], [n for _, n in seqs]
    args = (q, k, v, idx(qstart), idx(mlen), idx(krow), idx(klen), D ** -0.5, causal)
    one = flash.attend_rows(*args, threads=1)
    assert one is not None
    for a, m, ro, rl in rows_reference(q, k, v, qstart, mlen, krow, klen, D ** -0.5, causal):
        torch.testing.assert_close(one[0][:, a:a + m], ro, rtol=0, atol=2e-5)
        torch.testing.assert_close(one[1][:, a:a + m], rl, rtol=0, atol=2e-5)
    two = flash.attend_rows(*args, threads=2)
    for a, m, *_ in rows_reference(q, k, v, qstart, mlen, krow, klen, D ** -0.5, causal):
        assert torch.equal(two[0][:, a:a + m], one[0][:, a:a + m])


@needs_kernel
def test_rows_outside_their_tensors_are_a_value_error():
    q, k = torch.randn(2, 10, 64), torch.randn(3, 2, 16, 64)
    idx = lambda *xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    ok = (idx(0), idx(4), idx(2), idx(16))
    assert flash.attend_rows(q, k, k, *ok, 0.1) is not None
    for bad in ((idx(8), idx(4), idx(2), idx(16)),  # queries past N
                (idx(0), idx(4), idx(3), idx(16)),  # no buffer row 3
                (idx(0), idx(4), idx(2), idx(17)),  # more keys than columns
                (idx(0), idx(0), idx(2), idx(16))):  # no query
        with pytest.raises(ValueError, match="outside"):
            flash.attend_rows(q, k, k, *bad, 0.1)
    assert flash.attend_rows(q, k, k, idx(0), idx(4), idx(2).int(), idx(16), 0.1) is None


@needs_kernel
def test_keys_transposed_once_give_the_same_bits(monkeypatch):
    """A shared prefix's keys transposed once (kept across decode steps) against the kernel
    transposing them itself; no call is then too small for the kernel."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 12, 64, generator=g)
    k, v = torch.randn(1, 4, 301, 64, generator=g), torch.randn(1, 4, 301, 64, generator=g)
    kt = flash.transposed_keys(k)
    assert kt.shape == (1, 4, 64, 320) and not kt[..., 301:].any()
    with_kt = flash.attend(q, k, v, 0.125, False, kt=kt)
    assert with_kt is not None  # 12 x 301 x 4 is below MIN_WORK: taken for kt's sake
    monkeypatch.setattr(flash, "MIN_WORK", 0)
    plain = flash.attend(q, k, v, 0.125, False)
    assert torch.equal(with_kt[0], plain[0]) and torch.equal(with_kt[1], plain[1])
    with pytest.raises(ValueError, match="transposed_keys"):
        flash.attend(q, k, v, 0.125, False, kt=kt[..., :300])


BUILDS = ("_attention", "_attention_avx2", "_attention_avx512")


def _build(name):
    import importlib

    runs = {"_attention": True, "_attention_avx2": torch.backends.cpu.get_cpu_capability()
            in ("AVX2", "AVX512"), "_attention_avx512":
            torch.backends.cpu.get_cpu_capability() == "AVX512"}
    if not runs[name]:
        pytest.skip(f"this CPU does not run kvstore.{name}")
    try:
        return importlib.import_module(f"kvstore.{name}")
    except ImportError:
        pytest.skip(f"kvstore.{name} was not built")


@pytest.mark.parametrize("name", BUILDS)
def test_every_build_equals_the_reference(monkeypatch, name):
    """The generic, AVX2 and AVX-512 builds of ext/attention.c: the same results."""
    monkeypatch.setattr(flash, "_kernel", _build(name))
    monkeypatch.setattr(flash, "MIN_WORK", 0)
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(1, 6, 130, 64, generator=g), torch.randn(1, 2, 400, 64, generator=g)
    v = torch.randn(1, 2, 400, 64, generator=g)
    o, lse = flash.attend(q, k, v, 0.125, True)
    ref_o, ref_lse = reference(q, k, v, 0.125, True)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    idx = lambda *xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    o, lse = flash.attend_rows(q[0, :, :3], k, v, idx(0, 1), idx(1, 2), idx(0, 0), idx(7, 400),
                               0.125)
    for a, m, ro, rl in rows_reference(q[0, :, :3], k, v, (0, 1), (1, 2), (0, 0), (7, 400),
                                       0.125, True):
        torch.testing.assert_close(o[:, a:a + m], ro, rtol=0, atol=1e-5)
        torch.testing.assert_close(lse[:, a:a + m], rl, rtol=0, atol=1e-5)


def test_the_best_build_the_cpu_runs_is_imported(monkeypatch):
    """By torch's CPU capability, never a build for an instruction set the CPU lacks (it would
    die of SIGILL); a build that is missing gives way to the next."""
    import importlib

    tried = []

    def fake(name):
        tried.append(name)
        if name.endswith("avx512"):
            raise ImportError(name)
        return name

    monkeypatch.setattr(importlib, "import_module", fake)
    assert flash._load("AVX512") == "kvstore._attention_avx2"
    assert flash._load("AVX2") == "kvstore._attention_avx2"
    assert flash._load("DEFAULT") == "kvstore._attention"
    assert flash._load("ZVECTOR") == "kvstore._attention"
    assert tried == ["kvstore._attention_avx512", "kvstore._attention_avx2",
                     "kvstore._attention_avx2", "kvstore._attention", "kvstore._attention"]
    monkeypatch.setattr(importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(name)))
    assert flash._load("AVX512") is None


VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A Llama with head_dim 64 (the kernel's) and GQA."""
    from support.batch_jobs import spread_saved

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        pad_token_id=0)
    return spread_saved(cfg, tmp_path_factory.mktemp("llama-d64"))


@needs_kernel
@pytest.mark.parametrize("continuous", [True, False])
def test_engine_with_the_kernel_in_every_call_equals_hf_generate(model, monkeypatch, continuous):
    calls = []
    real = flash._kernel.attend
    monkeypatch.setattr(flash, "MIN_WORK", 0)
    monkeypatch.setattr(flash, "_kernel", type("K", (), {
        "attend": staticmethod(lambda *a: calls.append(a[5:11]) or real(*a))}))
    rng = random.Random(3)
    toks = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    system = toks(150)
    ps = [system + toks(rng.randrange(5, 60)) for _ in range(6)] + [toks(90), toks(200)]
    engine = TransformersEngine(model, eos_token_id=(), continuous=continuous)
    reqs = [BatchRequest(str(i), tuple(p), SamplingParams(max_tokens=6)) for i, p in enumerate(ps)]
    got = {}
    engine.run(reqs, on_done=lambda i, c: got.__setitem__(i, list(c.token_ids)))
    assert calls  # the shared prefix, the prompts' own causal parts
    for i, p in enumerate(ps):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got[i] == out[0, len(p):].tolist(), i


@needs_kernel
def test_engine_with_rows_and_kept_prefix_keys_equals_hf_generate(model, monkeypatch):
    """Every suffix part on ``attend_rows`` (decode steps, prefills, continuous batching's
    mixed forwards) and every prefix call on keys transposed once: HF ``generate``'s tokens."""
    calls = {"rows": 0, "kt": 0, "transposed": 0}
    real_rows, real_attend, real_t = flash.attend_rows, flash.attend, flash.transposed_keys

    def rows(*a, **kw):
        calls["rows"] += 1
        return real_rows(*a, **kw)

    def attend(*a, **kw):
        calls["kt"] += kw.get("kt") is not None
        return real_attend(*a, **kw)

    def transposed(k):
        calls["transposed"] += 1
        return real_t(k)

    monkeypatch.setattr(flash, "attend_rows", rows)
    monkeypatch.setattr(flash, "attend", attend)
    monkeypatch.setattr(flash, "transposed_keys", transposed)
    rng = random.Random(5)
    toks = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    system = toks(120)
    ps = [system + toks(rng.randrange(5, 50)) for _ in range(7)] + [toks(60)]
    engine = TransformersEngine(model, eos_token_id=(), continuous=True)
    reqs = [BatchRequest(str(i), tuple(p), SamplingParams(max_tokens=rng.randrange(2, 9)))
            for i, p in enumerate(ps)]
    got = {}
    engine.run(reqs, on_done=lambda i, c: got.__setitem__(i, list(c.token_ids)))
    layers = model.config.num_hidden_layers
    assert calls["rows"] and calls["kt"] > calls["transposed"] > 0
    assert calls["transposed"] % layers == 0  # once per prefix and layer, not per step
    for i, p in enumerate(ps):
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=reqs[i].params.max_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert got[i] == out[0, len(p):].tolist(), i
