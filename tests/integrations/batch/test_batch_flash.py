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
