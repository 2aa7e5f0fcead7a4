"""Shared-prefix attention against plain softmax attention over each sequence's whole K/V."""

import math
import types

import pytest
import torch

pytest.importorskip("transformers")

from kvstore.integrations.batch.engines import attention as A

L, HKV, G, D = 1, 2, 2, 8


def reference(q, keys, values, qpos, kpos, scale, window=None, softcap=None):
    """One sequence: q [Hq, S, D] at positions qpos against keys [Hkv, K, D] at kpos."""
    k = keys.repeat_interleave(G, 0)
    v = values.repeat_interleave(G, 0)
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    ok = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
    if window is not None:
        ok &= kpos.unsqueeze(0) > qpos.unsqueeze(1) - window
    s = s.masked_fill(~ok, float("-inf"))
    return torch.softmax(s, -1) @ v  # [Hq, S, D]


def scenario(seed, steps_done=0):
    """Three sequences: two share a prefix of 20, one has none; each adds tokens."""
    g = torch.Generator().manual_seed(seed)
    P = 20
    prefix = (torch.randn(HKV, P, D, generator=g), torch.randn(HKV, P, D, generator=g))
    counts = [5, 3, 4] if not steps_done else [1, 1, 1]
    starts = [0, 0, 0] if not steps_done else [5, 3, 4]
    prefix_lens = [P, P, 0]
    kv = A.SuffixKV(L, 3, HKV, 8, D, dtype=torch.float32, device=torch.device("cpu"))
    # earlier tokens of each row (for the decode step) and this forward's new K/V
    hist = [(torch.randn(HKV, s, D, generator=g), torch.randn(HKV, s, D, generator=g)) for s in starts]
    for r, (hk, hv) in enumerate(hist):
        kv.k[0][r, :, : starts[r]] = hk
        kv.v[0][r, :, : starts[r]] = hv
    N = sum(counts)
    groups = [A.GroupSlice(0, counts[0] + counts[1], (prefix,), P),
              A.GroupSlice(counts[0] + counts[1], N, (), 0)]
    plan = A.make_plan(kv, groups, [0, 1, 2], starts, counts, prefix_lens, device=torch.device("cpu"))
    q = torch.randn(1, HKV * G, N, D, generator=g)
    k_new = torch.randn(1, HKV, N, D, generator=g)
    v_new = torch.randn(1, HKV, N, D, generator=g)
    return plan, prefix, hist, counts, starts, prefix_lens, q, k_new, v_new


def expected(plan, prefix, hist, counts, starts, prefix_lens, q, k_new, v_new, scale, **kw):
    outs, t = [], 0
    for r in range(3):
        n = counts[r]
        ks, vs = [], []
        if prefix_lens[r]:
            ks.append(prefix[0])
            vs.append(prefix[1])
        ks += [hist[r][0], k_new[0, :, t:t + n]]
        vs += [hist[r][1], v_new[0, :, t:t + n]]
        k, v = torch.cat(ks, 1), torch.cat(vs, 1)
        kpos = torch.arange(k.shape[1])
        qpos = torch.arange(prefix_lens[r] + starts[r], prefix_lens[r] + starts[r] + n)
        outs.append(reference(q[0, :, t:t + n], k, v, qpos, kpos, scale, **kw))
        t += n
    return torch.cat(outs, 1).transpose(0, 1).unsqueeze(0)  # [1, N, Hq, D]


@pytest.mark.parametrize("steps_done", [0, 1])
@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("extra", [{}, {"sliding_window": 6}, {"softcap": 3.0}])
def test_matches_plain_attention(monkeypatch, steps_done, flash, extra):
    if not flash:
        monkeypatch.setattr(A, "_FLASH_CPU", None)
    plan, prefix, hist, counts, starts, plens, q, k_new, v_new = scenario(7, steps_done)
    module = types.SimpleNamespace(layer_idx=0)
    scale = 1 / math.sqrt(D)
    with A.running(types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="sdpa")),
                   plan) as cache:
        cache.update(k_new, v_new, 0)
        got, _ = A.shared_prefix_attention(module, q, k_new, v_new, None, scaling=scale, **extra)
    want = expected(plan, prefix, hist, counts, starts, plens, q, k_new, v_new, scale,
                    window=extra.get("sliding_window"), softcap=extra.get("softcap"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chunked_products_match(monkeypatch):
    monkeypatch.setattr(A, "_CHUNK_ELEMENTS", 7)  # every product cut into many pieces
    monkeypatch.setattr(A, "_FLASH_CPU", None)
    plan, prefix, hist, counts, starts, plens, q, k_new, v_new = scenario(3)
    module = types.SimpleNamespace(layer_idx=0)
    with A.running(types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="x")),
                   plan) as cache:
        cache.update(k_new, v_new, 0)
        got, _ = A.shared_prefix_attention(module, q, k_new, v_new, None, scaling=0.3,
                                           sliding_window=9)
    want = expected(plan, prefix, hist, counts, starts, plens, q, k_new, v_new, 0.3, window=9)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_running_restores_the_attention_and_refuses_outside():
    cfg = types.SimpleNamespace(_attn_implementation="sdpa")
    plan = scenario(1)[0]
    with A.running(types.SimpleNamespace(config=cfg), plan):
        assert cfg._attn_implementation == A.ATTENTION_NAME
    assert cfg._attn_implementation == "sdpa"
    q = torch.zeros(1, 4, 1, D)
    with pytest.raises(RuntimeError, match="batched-engine"):
        A.shared_prefix_attention(types.SimpleNamespace(layer_idx=0), q, q, q, None)


def test_suffix_buffers_start_zeroed():
    """A masked-out column still enters the products: it must hold no NaN (regression: rows
    of a batch came out all token 0 when the buffers were torch.empty)."""
    kv = A.SuffixKV(2, 3, 2, 5, 4, dtype=torch.float32, device=torch.device("cpu"))
    assert all(bool((t == 0).all()) for t in kv.k + kv.v)


def test_decode_reads_each_groups_prefix_once(monkeypatch):
    """Cascade decode: one product per group and layer, every row's queries stacked against
    the group's one prefix K/V (the tensor itself: never copied or gathered per row)."""
    g = torch.Generator().manual_seed(5)
    P, rows = 24, 6
    prefix = (torch.randn(HKV, P, D, generator=g), torch.randn(HKV, P, D, generator=g))
    kv = A.SuffixKV(L, rows, HKV, 8, D, dtype=torch.float32, device=torch.device("cpu"))
    for r in range(rows):
        kv.k[0][r, :, :3] = torch.randn(HKV, 3, D, generator=g)
        kv.v[0][r, :, :3] = torch.randn(HKV, 3, D, generator=g)
    plan = A.make_plan(kv, [A.GroupSlice(0, rows, (prefix,), P)], list(range(rows)), [3] * rows,
                       [1] * rows, [P] * rows, device=torch.device("cpu"))
    calls = []
    attend = A._attend

    def spy(q, k, v, *a, **kw):
        calls.append((tuple(q.shape), k.untyped_storage().data_ptr(), tuple(k.shape)))
        return attend(q, k, v, *a, **kw)

    monkeypatch.setattr(A, "_attend", spy)
    q = torch.randn(1, HKV * G, rows, D, generator=g)
    k_new, v_new = torch.randn(1, HKV, rows, D, generator=g), torch.randn(1, HKV, rows, D, generator=g)
    with A.running(types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="x")),
                   plan) as cache:
        cache.update(k_new, v_new, 0)
        A.shared_prefix_attention(types.SimpleNamespace(layer_idx=0), q, k_new, v_new, None)
    on_prefix = [c for c in calls if c[1] == prefix[0].untyped_storage().data_ptr()]
    assert len(on_prefix) == 1  # once for all rows, not once per row
    assert on_prefix[0][0] == (1, HKV, G * rows, D) and on_prefix[0][2] == (1, HKV, P, D)


def test_prefill_attends_each_row_unpadded(monkeypatch):
    """A forward of rows' first tokens runs each row's causal attention on its own tokens,
    not padded to the longest row (the old path computed R x S x S scores)."""
    plan, prefix, hist, counts, starts, plens, q, k_new, v_new = scenario(11)
    shapes = []
    attend = A._attend

    def spy(q, k, v, *a, **kw):
        shapes.append((tuple(q.shape), tuple(k.shape), kw.get("causal", False)))
        return attend(q, k, v, *a, **kw)

    monkeypatch.setattr(A, "_attend", spy)
    with A.running(types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="x")),
                   plan) as cache:
        cache.update(k_new, v_new, 0)
        A.shared_prefix_attention(types.SimpleNamespace(layer_idx=0), q, k_new, v_new, None)
    causal = [s for s in shapes if s[2]]
    assert [s[0] for s in causal] == [(1, HKV * G, n, D) for n in counts]
    assert [s[1][2] for s in causal] == counts
