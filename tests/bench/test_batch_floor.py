"""The compute floor of a batch job (``kvstore.bench.batch_floor``): operation counts checked
against hand counts, and the GEMM rate it divides by."""

import pytest

from kvstore.bench.batch_floor import ModelShape, gemm_rate, job_flops

# 1 layer, 2 heads of 4, 1 KV head, hidden 8, FFN 16, vocab 10
SHAPE = ModelShape(hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10)


def test_per_token_counts_by_hand():
    # q 8x8, k and v 8x4 each, o 8x8, gate/up/down 8x16 each: 64 + 64 + 64 + 384 = 576 MACs
    assert SHAPE.linear_flops_per_token == 2 * 576
    assert SHAPE.attention_flops_per_key == 4 * 2 * 4


def test_one_prompt_counts_every_position_and_its_keys():
    f = job_flops([[1, 2, 3]], 2, SHAPE)
    # positions 1, 2, 3 of the prompt, then one fed-back token at position 4
    assert f.tokens == 4
    assert f.linear == 4 * SHAPE.linear_flops_per_token
    assert f.attention == (1 + 2 + 3 + 4) * SHAPE.attention_flops_per_key
    assert f.head == 2 * 8 * 10 * 2  # two sampled tokens
    assert f.total == f.linear + f.attention + f.head


def test_a_shared_prefix_is_counted_once():
    shared = job_flops([[1, 2, 3, 4], [1, 2, 3, 5]], 1, SHAPE)
    # 1, 2, 3 once, then the two last tokens at position 4
    assert shared.tokens == 5
    assert shared.attention == (1 + 2 + 3 + 4 + 4) * SHAPE.attention_flops_per_key
    apart = job_flops([[1, 2, 3, 4], [9, 2, 3, 5]], 1, SHAPE)
    assert apart.tokens == 8 and apart.total > shared.total


def test_a_prompt_inside_another_costs_only_its_decode():
    f = job_flops([[1, 2, 3, 4], [1, 2]], [1, 3], SHAPE)
    # the long prompt's 4 positions; the short one's 2 fed-back tokens at positions 3 and 4
    assert f.tokens == 4 + 2
    assert f.attention == (1 + 2 + 3 + 4 + 3 + 4) * SHAPE.attention_flops_per_key
    assert f.head == 2 * 8 * 10 * (1 + 3)


def test_a_prompt_asked_twice_decodes_once_for_its_longest_answer():
    twice = job_flops([[1, 2], [1, 2]], [2, 5], SHAPE)
    once = job_flops([[1, 2]], 5, SHAPE)
    assert twice == once


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="new_tokens"):
        job_flops([[1], [2]], [1], SHAPE)
    with pytest.raises(ValueError, match="new_tokens"):
        job_flops([[1]], 0, SHAPE)


def test_shape_from_a_llama_config():
    cfg = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
               num_key_value_heads=4, intermediate_size=2048, vocab_size=8192)
    s = ModelShape.of(cfg)
    assert (s.head_dim, s.kv_heads) == (64, 4)
    # 110M Llama: 12 x (768x768 x 2 + 768x256 x 2 + 768x2048 x 3) = 75.5M weights in the layers
    assert s.linear_flops_per_token == 2 * 12 * (2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 2048)


def test_gemm_rate_is_a_rate_and_restores_the_threads():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    r = gemm_rate(ModelShape(hidden=64, layers=1, heads=1, kv_heads=1, head_dim=64, ffn=128,
                             vocab=10), threads=1, calls=2)
    assert 1e6 < r < 1e14  # FLOP/s: between a very slow machine and far past any CPU
    assert torch.get_num_threads() == before
