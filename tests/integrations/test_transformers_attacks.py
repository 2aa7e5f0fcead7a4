"""Attack round 11 on the transformers bridge: what its own tests do not cover.

Tiny random models (2 layers, hidden 64), float32: the cached path must give the model's own
logits (within 1e-4) and HF ``generate``'s greedy tokens, or refuse clearly, or recompute.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore import open_store  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.integrations.transformers import (  # noqa: E402
    PrefixCachedModel,
    layout_for,
    open_store_for,
    rope_exact_tokens,
)

T = 8
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            initializer_range=0.1)


def build(cls=transformers.LlamaConfig, seed=0, **over):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cls(**(BASE | over))).eval()


def tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def store_for(model, path=None, **kw):
    kw = {"block_tokens": T, "device": "cpu", "gpu_capacity": 0, "cpu_capacity": "8MiB"} | kw
    return open_store_for(model, path, **kw)


def plain_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def exact(res, model, ids):
    ref = plain_logits(model, ids)
    torch.testing.assert_close(res.logits, ref, rtol=1e-4, atol=1e-4)
    assert res.next_token == int(ref.argmax())


def warm(pm, ids):
    res = pm.prefill(ids)
    if res.put is not None:
        res.put.wait()
    return res


# -- RoPE whose frequencies change with the forward's length ------------------------------------
def dynamic_llama():
    return build(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 2.0})


def longrope_phi3():
    return build(transformers.Phi3Config, max_position_embeddings=256,
                 original_max_position_embeddings=32, pad_token_id=0,
                 rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                               "long_factor": [3.0] * 8})


@pytest.mark.parametrize("make, limit", [(dynamic_llama, 31), (longrope_phi3, 32)])
def test_length_dependent_rope_is_exact(make, limit):
    """Regression: blocks stored by a short prompt (base frequencies) were served to a prompt
    past the original length, whose own forward uses grown (dynamic) or long (longrope)
    frequencies for every token: logits off by 0.4-0.7. Such prompts are now computed whole
    (neither read nor stored); shorter ones are still cached."""
    model = make()
    assert rope_exact_tokens(model) == limit
    assert rope_exact_tokens(build()) is None  # plain RoPE: no limit
    short, long_ = tokens(limit, seed=1), tokens(70, seed=1)
    with store_for(model) as store:
        pm = PrefixCachedModel(model, store)
        warm(pm, short[:20])
        res = pm.prefill(short)  # within the base frequencies: cached and exact
        assert res.cached_tokens == 16
        exact(res, model, short)
        res.put.wait()
        res = pm.prefill(long_)  # past them: computed whole, nothing stored
        assert res.cached_tokens == 0 and res.put is None
        exact(res, model, long_)
        exact(pm.prefill(short), model, short)  # a long forward left no state behind
        # a decode that runs past the limit stores only the blocks before it
        prompt = tokens(20, seed=2)
        gen = pm.generate(prompt, 20, eos_token_id=())
        assert list(gen.tokens) == hf_greedy(model, prompt, 20)
        seq = prompt + list(gen.tokens)
        assert store.lookup(store.block_keys(seq)) == limit // T


# -- models whose KV is not a function of the prefix's tokens ------------------------------------
def bart_config():
    return transformers.BartConfig(vocab_size=256, d_model=32, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                   encoder_ffn_dim=32, decoder_ffn_dim=32)


def bert_config(**kw):
    return transformers.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64, **kw)


def test_encoder_decoder_and_bidirectional_models_are_refused():
    """Regression: T5 failed inside the layout probe with transformers' "You must specify
    exactly one of input_ids or inputs_embeds"; BART was accepted and its first cached prefill
    raised PromptCache's "already holds positions" message (its decoder restarts at 0); BERT's
    masked LM (bidirectional) was accepted and served prefixes whose K/V depend on the tokens
    after them (logits off by 1.45). Each is now a ConfigError naming why."""
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=256, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16))
    bart = transformers.BartForConditionalGeneration(bart_config())
    for model in (t5, bart, t5.config, bart.config):
        with pytest.raises(ConfigError, match="encoder-decoder"):
            layout_for(model)
    with pytest.raises(ConfigError, match="encoder-decoder"):
        store_for(bart)
    bert = transformers.BertForMaskedLM(bert_config(initializer_range=0.5)).eval()
    with pytest.raises(ConfigError, match="not causal"):
        store_for(bert)
    # their causal decoders are fine, and exact
    for model in (transformers.BartForCausalLM(bart_config()),
                  transformers.BertLMHeadModel(bert_config(is_decoder=True, initializer_range=0.5))):
        model.eval()
        p = tokens(30, seed=3)
        with store_for(model) as store:
            pm = PrefixCachedModel(model, store)
            warm(pm, p[:17])
            res = pm.prefill(p)
            assert res.cached_tokens == 16
            exact(res, model, p)


# -- identity: what the namespace must tell apart --------------------------------------------
def hub_model(**over):
    """A model as from_pretrained("org/tiny", **over) names it: hub id and commit."""
    model = build(**over)
    model.config.name_or_path = "org/tiny"
    model.config._commit_hash = "c" * 40
    return model


def test_hub_model_loaded_with_other_config_gets_another_namespace(tmp_path):
    """Regression: a hub model's id is its name and its revision the commit, so the same
    checkpoint loaded with a config override that changes its K/V (rope_theta here) shared
    the namespace and was served the other load's blocks (logits off by 1.1). The config's
    digest now joins the namespace's extras when the id does not carry it."""
    a, b = hub_model(), hub_model(rope_theta=500.0)
    p = tokens(40, seed=4)
    kw = {"disk_capacity": "16MiB"}
    with store_for(a, tmp_path / "s", **kw) as store:
        warm(PrefixCachedModel(a, store), p)
        store.flush()
        same = store.namespace_id
    with store_for(hub_model(), tmp_path / "s", **kw) as store:  # the same load: shared
        assert store.namespace_id == same
    with store_for(b, tmp_path / "s", **kw) as store:
        assert store.namespace_id != same
        res = PrefixCachedModel(b, store).prefill(p)
        assert res.cached_tokens == 0
        exact(res, b, p)
    # extras the caller passes are kept beside it
    with store_for(a, namespace_extras={"lora": "x"}) as store:
        assert store.namespace_id != same


def test_weights_edited_in_place_are_refused_not_served_stale():
    """Regression: the namespace names the weights as they were when the store was opened;
    an in-place edit after (a merged LoRA, a training step, load_state_dict) had the store
    serve the old weights' K/V (logits off by 0.88). The wrapper now stamps the weights
    (objects, storage, version counters: nothing read) and refuses a changed model."""
    model = build()
    p = tokens(40, seed=5)
    attn = model.model.layers[0].self_attn
    with store_for(model) as store:
        pm = PrefixCachedModel(model, store)
        warm(pm, p)
        with torch.no_grad():  # an unchanged model, used elsewhere meanwhile: still served
            model(torch.tensor([p[:9]]))
        hf_greedy(model, p[:9], 2)
        exact(pm.prefill(p), model, p)
        edits = [
            lambda: attn.k_proj.weight.add_(0.05),  # LoRA merged in place
            lambda: model.load_state_dict(build(seed=1).state_dict()),
            lambda: setattr(attn.v_proj, "weight", torch.nn.Parameter(attn.v_proj.weight * 2)),
        ]
        opened = []
        for edit in edits:
            with torch.no_grad():
                edit()
            with pytest.raises(ConfigError, match="weights changed .* open_store_for"):
                pm.prefill(p)
            exact(pm.prefill(p, use_cache=False), model, p)  # the plain path still runs
            # edited between open_store_for and the wrapper: refused at once
            with pytest.raises(ConfigError, match="weights changed"):
                PrefixCachedModel(model, store)
            # the way out: a store opened for the weights as they are now
            store = store_for(model)
            opened.append(store)
            pm = PrefixCachedModel(model, store)
            warm(pm, p)
            res = pm.prefill(p)
            assert res.cached_tokens == 32
            exact(res, model, p)
    for s in opened:
        s.close()
    # a store opened without open_store_for knows no stamp: the wrapper takes it as it is
    with open_store(None, layout=store.layout, model_id="mine", device="cpu",
                    cpu_capacity="1MiB") as other:
        PrefixCachedModel(model, other)


def test_training_mode_with_dropout_is_refused():
    """Regression: from_config gives a model in training mode; GPT-2's dropout (0.1) made its
    K/V random, and the wrapper stored them and served them to the model in eval mode (and,
    with the causality probe, refused it as "not causal"). Now a ConfigError names
    model.eval(), at construction and at a cached prefill after model.train()."""
    torch.manual_seed(0)
    gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256))
    llama = build(attention_dropout=0.1)
    for model in (gpt2, llama):
        model.train()
        with pytest.raises(ConfigError, match=r"training mode .* model\.eval\(\)"):
            store_for(model)
        model.eval()
        p = tokens(30, seed=6)
        with store_for(model) as store:
            pm = PrefixCachedModel(model, store)
            warm(pm, p)
            model.train()
            with pytest.raises(ConfigError, match=r"model\.eval\(\)"):
                pm.prefill(p)
            model.eval()
            exact(pm.prefill(p), model, p)
    model = build().train()  # no dropout: training mode alone changes nothing, and is taken
    with store_for(model) as store:
        exact(PrefixCachedModel(model, store).prefill(tokens(9)), model, tokens(9))


# -- inputs -------------------------------------------------------------------------------------
def test_prompts_that_are_not_token_ids_are_refused():
    """Regression: float tokens were truncated (1.7 -> 1) and a bool tensor taken as 0/1,
    silently prefilling other ids; an id past the vocabulary raised torch's bare "index out
    of range in self" from the embedding. Each is now a TokenError saying what is wrong."""
    import numpy as np

    from kvstore.errors import TokenError

    model = build()
    p = tokens(30, seed=7)
    with store_for(model) as store:
        pm = PrefixCachedModel(model, store)
        warm(pm, p)
        for bad, what in ([1.7, 2.2, 3.9], "integers"), (torch.tensor([[1.5, 2.0]]), "float32"), \
                (torch.tensor([True, False]), "bool"), (p[:20] + [256], "vocabulary .*256 rows"), \
                (p[:20] + [-1], "outside"), (np.array([1.0, 2.0]), "integers"):
            with pytest.raises(TokenError, match=what):
                pm.prefill(bad)
            with pytest.raises(TokenError, match=what):
                pm.generate(bad, 2)
        assert store.stats().pinned_blocks == 0
        # integers of any kind are fine, and the same prompt
        for ok in (np.array(p), torch.tensor(p, dtype=torch.int32), [np.int64(t) for t in p]):
            res = pm.prefill(ok)
            assert res.cached_tokens == 24
            exact(res, model, p)
        with pytest.raises(ValueError, match="batch 1"):
            pm.prefill(torch.zeros(2, 5, dtype=torch.long))
        with pytest.raises(ValueError, match=">= 1"):
            pm.generate(p, 0)


# -- coverage: what held up -------------------------------------------------------------------
SWEEP = {
    "llama-untied": lambda: build(tie_word_embeddings=False),
    # windows shorter than a block: cached blocks lie wholly past the window
    "mistral-window-4": lambda: build(transformers.MistralConfig, sliding_window=4),
    "gemma2-window-4": lambda: build(transformers.Gemma2Config, head_dim=16, sliding_window=4),
    "qwen2-mixed-window": lambda: build(transformers.Qwen2Config, use_sliding_window=True,
                                        sliding_window=5, max_window_layers=1),
    "phi-partial-rotary": lambda: build(transformers.PhiConfig, partial_rotary_factor=0.5),
}


@pytest.mark.parametrize("family", sorted(SWEEP))
def test_block_boundaries_windows_and_turns_equal_hf(family):
    model = SWEEP[family]()
    with store_for(model) as store:
        pm = PrefixCachedModel(model, store)
        for n in (1, T - 1, T, T + 1, 2 * T + 1):
            p = tokens(n, seed=n)
            warm(pm, p)
            res = pm.prefill(p)
            assert res.cached_tokens == (n - 1) // T * T
            exact(res, model, p)
            want = hf_greedy(model, p, 10)
            gen = pm.generate(p, 10, eos_token_id=())
            assert list(gen.tokens) == want
            if gen.put is not None:
                gen.put.wait()
            turn = p + want + tokens(3, seed=50 + n)  # the answer's blocks come back
            res = pm.prefill(turn)
            assert res.cached_tokens == (n + 9) // T * T
            exact(res, model, turn)


def test_other_weights_saved_at_the_same_path_get_another_namespace(tmp_path):
    """A checkpoint directory rewritten with other weights (a new fine-tune saved over it):
    same name and config, so only the weights digest tells them apart."""
    kw = {"disk_capacity": "16MiB"}
    p = tokens(40, seed=8)
    spaces = []
    for seed in (0, 1, 0):
        build(seed=seed).save_pretrained(tmp_path / "ckpt")
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
        with store_for(model, tmp_path / "store", **kw) as store:
            spaces.append(store.namespace_id)
            pm = PrefixCachedModel(model, store)
            res = pm.prefill(p)
            assert res.cached_tokens == (32 if seed == 0 and len(spaces) == 3 else 0)
            exact(res, model, p)
            res.put.wait()
            store.flush()
    assert spaces[0] == spaces[2] != spaces[1]


def test_cache_for_generate_with_beams_and_several_sequences():
    """Regression: HF generate with num_beams > 1 (or num_return_sequences) expands its rows
    but not a batch-1 cache: cache_for_generate() there crashed with torch's "Sizes of tensors
    must match". Now PromptCache says to pass cache_for_generate(repeats=N), which equals a
    plain generate."""
    from kvstore.integrations.transformers import cache_kwarg

    model = build()
    p = tokens(37, seed=3)
    ids = torch.tensor([p])

    def gen(**kw):
        torch.manual_seed(1)
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                  pad_token_id=0, eos_token_id=None, **kw).tolist()

    with store_for(model) as store:
        pm = PrefixCachedModel(model, store)
        warm(pm, p)
        res = pm.prefill(p)
        assert res.cached_tokens == 32
        kw = cache_kwarg(model)
        for opts, n in ((dict(num_beams=3, do_sample=False), 3),
                        (dict(num_beams=2, num_return_sequences=2, do_sample=False), 2),
                        (dict(do_sample=True, top_k=5, num_return_sequences=2), 2)):
            with pytest.raises(ValueError, match=f"repeats=N.*{n}|{n} rows"):
                gen(**opts, **{kw: res.cache_for_generate()})
            assert gen(**opts, **{kw: res.cache_for_generate(repeats=n)}) == gen(**opts)
        assert gen(do_sample=False, **{kw: res.cache_for_generate()}) == gen(do_sample=False)
        # use_cache=False re-feeds everything on the cache: refused, saying so (before, the
        # message only named cache_for_generate, which was what the caller had passed)
        with pytest.raises(ValueError, match="leave use_cache on"):
            gen(do_sample=False, use_cache=False, **{kw: res.cache_for_generate()})


class _SlottedCache:
    """Another KVCache: no weak reference, no hash (what a client or a proxy may be)."""

    __slots__ = ("_s",)
    __hash__ = None

    def __init__(self, store):
        object.__setattr__(self, "_s", store)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_s"), name)


def test_a_kv_cache_without_weak_references_is_taken():
    """Regression (of this round's weights stamp): looking the store up among those
    open_store_for opened raised TypeError for a KVCache without weak references or hash."""
    model = build()
    p = tokens(30, seed=9)
    with store_for(model) as store:
        pm = PrefixCachedModel(model, _SlottedCache(store))
        warm(pm, p)
        res = pm.prefill(p)
        assert res.cached_tokens == 24
        exact(res, model, p)
