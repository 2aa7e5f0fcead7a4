"""The batched engine's one-pass RMSNorm (``engines/norm.py``, ``kvstore._rmsnorm``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.integrations.batch.engines import norm  # noqa: E402
from kvstore.integrations.batch.engines.norm import FusedNorms, fused_norm_available  # noqa: E402

needs_kernel = pytest.mark.skipif(not fused_norm_available(), reason="kvstore._rmsnorm not built")


def _llama(layers=2, hidden=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for mod in m.modules():
            if type(mod).__name__ == "LlamaRMSNorm":
                mod.weight.normal_()
    return m


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 7, 48, 513])
def test_fused_equals_the_module_to_rounding(rows):
    model = _llama()
    fused = FusedNorms(model)
    assert len(fused) == 2 * 2 + 1  # two per layer and the final one
    m = model.model.layers[0].input_layernorm
    x = torch.randn(1, rows, 64) * 5
    with torch.no_grad():
        want = m(x)
        with fused.active() as n:
            assert n == 5 and "forward" in m.__dict__
            got = m(x)
    assert "forward" not in m.__dict__  # restored
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_kernel
def test_inputs_the_kernel_does_not_take_run_the_module(monkeypatch):
    calls = []
    real = norm._kernel.rms_norm

    class Spy:
        @staticmethod
        def rms_norm(*a):
            calls.append(a)
            return real(*a)

    monkeypatch.setattr(norm, "_kernel", Spy)
    model = _llama()
    fused = FusedNorms(model)  # its check runs the kernel once a module
    m = model.model.norm
    calls.clear()
    x = torch.randn(3, 64)
    with torch.no_grad(), fused.active():
        m(x.to(torch.bfloat16))  # another dtype
        m(torch.randn(64, 3).t())  # not contiguous
        assert not calls
        m(x)
        assert len(calls) == 1
    xg = x.clone().requires_grad_()
    with torch.enable_grad(), fused.active():
        y = m(xg)  # autograd on: the module's own forward, so it has a grad_fn
    assert y.grad_fn is not None and len(calls) == 1


@needs_kernel
def test_a_norm_whose_math_differs_is_left_alone():
    model = _llama()
    m = model.model.layers[1].post_attention_layernorm

    def gemma_like(x):  # (1 + weight), as Gemma's RMSNorm: not the kernel's formula
        v = x.pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(v + m.variance_epsilon)) * (1.0 + m.weight)

    m.forward = gemma_like  # an instance forward: the check compares against it
    fused = FusedNorms(model)
    assert m not in fused.modules and len(fused) == 4


def test_without_the_kernel_nothing_is_fused_and_the_engine_runs(monkeypatch):
    from kvstore.integrations.batch import BatchRequest, SamplingParams
    from kvstore.integrations.batch.engines.transformers import TransformersEngine

    monkeypatch.setattr(norm, "_kernel", None)
    model = _llama()
    assert len(FusedNorms(model)) == 0
    eng = TransformersEngine(model, eos_token_id=())
    rep = eng.run([BatchRequest("a", tuple(range(1, 40)), SamplingParams(max_tokens=3))])
    assert rep.generated_tokens == 3


@needs_kernel
def test_the_kernel_refuses_bad_arguments():
    with pytest.raises(ValueError, match="dim > 0"):
        norm._kernel.rms_norm(1, 1, 1, 4, 0, 1e-6)
    with pytest.raises(ValueError, match="non-null"):
        norm._kernel.rms_norm(0, 1, 1, 4, 8, 1e-6)
    with pytest.raises(TypeError):
        norm._kernel.rms_norm("x", 1, 1, 4, 8, 1e-6)
