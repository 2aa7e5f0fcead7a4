"""The batched engine on Phi-3 with ``longrope`` RoPE: outputs equal per-prompt ``generate``.

transformers' longrope takes short or long factors for a whole forward from its largest
position; a packed forward mixing rows must still give each row the factors ``generate``
gives that prompt alone (short under ``original_max_position_embeddings``, long past it, and
the recompute of the whole sequence when a decode crosses it).
"""

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.integrations.batch import BatchRequest, SamplingParams  # noqa: E402
from kvstore.integrations.batch.engines.transformers import TransformersEngine  # noqa: E402

VOCAB, ORIGINAL = 512, 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from support.batch_jobs import spread_saved

    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        original_max_position_embeddings=ORIGINAL, pad_token_id=0,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    return spread_saved(cfg, tmp_path_factory.mktemp("phi3-longrope"))


def hf_generate(model, prompt, max_new):
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def prompts(seed=0):
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    system = toks(20)
    short = [system + toks(rng.randrange(2, 30)) for _ in range(6)]
    # one at the original length, one just past it, two long ones sharing the system prompt
    return short + [system + toks(ORIGINAL - 20), system + toks(ORIGINAL - 19),
                    system + toks(80), toks(100)]


def check(model, ps, max_new, **kw):
    engine = TransformersEngine(model, eos_token_id=(), **kw)
    reqs = [BatchRequest(str(i), tuple(p), SamplingParams(max_tokens=max_new))
            for i, p in enumerate(ps)]
    got = {}
    engine.run(reqs, on_done=lambda i, c: got.__setitem__(i, c))
    for i, p in enumerate(ps):
        assert list(got[i].token_ids) == hf_generate(model, p, max_new), (i, len(p))


@pytest.mark.parametrize("continuous", [True, False])
def test_longrope_short_prompts_packed_with_long_ones(model, continuous):
    """Regression: a prompt past the original length in the same packed forward switched every
    row to the long factors: short prompts' very first tokens differed from generate."""
    check(model, prompts(), 4, continuous=continuous)


@pytest.mark.parametrize("continuous", [True, False])
def test_longrope_decodes_crossing_the_original_length(model, continuous):
    """Rows whose answers cross the original length: generate recomputes the sequence with the
    long factors there, and so does the engine."""
    check(model, prompts(1), 50, continuous=continuous)


def test_longrope_rows_in_small_forwards(model):
    """Rows joining and leaving (one-row budgets) while others cross the length."""
    check(model, prompts(2)[::2], 45, max_batch_tokens=40, max_batch_rows=3)
