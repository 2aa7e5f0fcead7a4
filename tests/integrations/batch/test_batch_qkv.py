"""The batched engine's fused attention projections and one-pass rotary embedding
(``engines/qkv.py``, ``kvstore._rope``)."""

from __future__ import annotations

import inspect
import sys
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.integrations.batch.engines import qkv  # noqa: E402
from kvstore.integrations.batch.engines.linear import packing_available  # noqa: E402
from kvstore.integrations.batch.engines.qkv import FusedQKV, forward_digest  # noqa: E402

needs_packing = pytest.mark.skipif(not packing_available(), reason="no oneDNN packed linear")
needs_rope = pytest.mark.skipif(qkv._kernel is None, reason="kvstore._rope not built")


def _llama(layers=2, hidden=64, heads=4, kv_heads=2, bias=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, attention_bias=bias)
    return LlamaForCausalLM(cfg).eval()


def _hf_rope(x, cos, sin):
    from transformers.models.llama.modeling_llama import rotate_half

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * c) + (rotate_half(x) * s)


@needs_rope
@pytest.mark.parametrize("n,heads,dim", [(0, 2, 64), (1, 1, 2), (7, 3, 64), (130, 4, 128),
                                         (33, 2, 6)])
def test_rope_is_hf_bit_for_bit(n, heads, dim):
    g = torch.Generator().manual_seed(n + dim)
    # the projection's output: this head group is a column slice of wider rows
    wide = torch.randn((1, n, heads * dim + 40), generator=g) * 4
    x = wide[..., 8: 8 + heads * dim]
    cos, sin = torch.randn((1, n, dim), generator=g), torch.randn((1, n, dim), generator=g)
    got = qkv._rotated(x, heads, dim, cos, sin)
    want = _hf_rope(x.reshape(1, n, heads, dim).transpose(1, 2), cos, sin).transpose(1, 2)
    assert got.shape == (1, n, heads, dim) and got.is_contiguous()
    assert torch.equal(got, want)  # the same products and sum, each rounded: not "close"


@needs_rope
def test_rope_rejects_bad_arguments():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="even dim"):
        qkv._kernel.rope(x.data_ptr(), 8, x.data_ptr(), x.data_ptr(), 8, x.data_ptr(), 4, 1, 7)
    with pytest.raises(ValueError, match="xrow"):
        qkv._kernel.rope(x.data_ptr(), 4, x.data_ptr(), x.data_ptr(), 8, x.data_ptr(), 4, 1, 8)
    with pytest.raises(ValueError, match="non-null"):
        qkv._kernel.rope(0, 8, x.data_ptr(), x.data_ptr(), 8, x.data_ptr(), 4, 1, 8)


def test_the_installed_llama_forward_is_known():
    # a transformers upgrade that changes LlamaAttention.forward fuses nothing (safe) but
    # loses the gain: this says so, and the fused forward needs checking against the new code
    from transformers.models.llama.modeling_llama import LlamaAttention

    assert forward_digest(LlamaAttention.forward) in qkv.KNOWN_FORWARDS


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_fused_forward_equals_the_module(bias):
    model = _llama(bias=bias)
    fused = FusedQKV(model)
    assert len(fused) == 2
    a = model.model.layers[1].self_attn
    x = torch.randn(1, 9, 64)
    pos = torch.arange(3, 12)[None]
    cos, sin = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        want = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        with fused.active() as n:
            assert n == 2 and "forward" in a.__dict__
            got = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
    assert "forward" not in a.__dict__  # restored
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_changed_weight_is_repacked():
    model = _llama()
    fused = FusedQKV(model)
    a = model.model.layers[0].self_attn
    x = torch.randn(1, 5, 64)
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None])
    with torch.no_grad():
        with fused.active():
            before = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        a.k_proj.weight.mul_(2)  # in place: the version moves
        a.v_proj.weight = torch.nn.Parameter(a.v_proj.weight * -1)  # replaced
        want = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        with fused.active():
            got = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
    assert not torch.allclose(before, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_packing
def test_a_module_cast_after_the_build_runs_its_own_forward():
    model = _llama()
    fused = FusedQKV(model)
    model.double()
    a = model.model.layers[0].self_attn
    x = torch.randn(1, 5, 64, dtype=torch.float64)
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None])
    with torch.no_grad():
        want = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        with fused.active():
            got = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want)


@needs_packing
def test_without_the_rope_build_hf_rotary_runs(monkeypatch):
    model = _llama()
    fused = FusedQKV(model)
    monkeypatch.setattr(qkv, "_kernel", None)
    a = model.model.layers[0].self_attn
    x = torch.randn(1, 6, 64)
    cos, sin = model.model.rotary_emb(x, torch.arange(6)[None])
    with torch.no_grad():
        want = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
        with fused.active():
            got = a(x, position_embeddings=(cos, sin), attention_mask=None)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_packing
def test_another_rotary_under_the_same_forward_is_not_fused(monkeypatch):
    """A model module whose attention forward is Llama's code (so the digest matches) but
    whose ``apply_rotary_pos_emb`` rotates interleaved pairs: the build's check catches it."""
    from transformers.models.llama import modeling_llama

    home = types.ModuleType("kvstore_test_interleaved_rope")
    home.__dict__.update(vars(modeling_llama))

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        def rot(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * c + rot(q) * s, k * c + rot(k) * s

    home.apply_rotary_pos_emb = apply_rotary_pos_emb
    fwd = inspect.unwrap(modeling_llama.LlamaAttention.forward)
    other = types.FunctionType(fwd.__code__, home.__dict__, fwd.__name__, fwd.__defaults__,
                               fwd.__closure__)
    cls = type("InterleavedAttention", (modeling_llama.LlamaAttention,),
               {"forward": other, "__module__": home.__name__})
    monkeypatch.setitem(sys.modules, home.__name__, home)
    model = _llama()
    for layer in model.model.layers:
        layer.self_attn.__class__ = cls
    assert forward_digest(cls.forward) in qkv.KNOWN_FORWARDS
    assert len(FusedQKV(model)) == 0


@needs_packing
def test_engine_outputs_with_and_without_fusing_are_equal():
    from kvstore.integrations.batch.engines.transformers import TransformersEngine
    from kvstore.integrations.batch.requests import BatchRequest, SamplingParams

    model = _llama(layers=2, hidden=128, heads=4, kv_heads=2)
    engine = TransformersEngine(model, eos_token_id=())
    assert engine._qkv is not None and len(engine._qkv) == 2
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 128, (40,), generator=g).tolist()
    reqs = [BatchRequest(str(i), tuple(shared + torch.randint(0, 128, (5 + i,), generator=g)
                                       .tolist()), SamplingParams(max_tokens=6, ignore_eos=True))
            for i in range(5)]

    def run():
        out = [None] * len(reqs)
        engine.run(reqs, on_done=lambda i, c: out.__setitem__(i, list(c.token_ids)))
        return out

    on = run()
    engine._qkv = None
    assert run() == on
