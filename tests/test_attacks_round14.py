"""Adversarial reliability pass, round 14: the native code and what calls it. Earlier rounds
attacked the store, the daemon, the CLI, files and upgrades; this one attacks the three C
extensions built from ext/ through their public wrappers: the chained SHA-256 block keys
(``kvstore._native`` behind ``kvstore.keys.block_keys``), the batched engine's RMSNorm
(``kvstore._rmsnorm`` behind ``engines/norm.FusedNorms``) and its float32 attention
(``kvstore._attention`` behind ``engines/flash.attend`` / ``attend_rows``).

The attacks: shapes at the kernels' block edges (1, 63, 64, 65, 255, 256, 257), head sizes
taken and declined, GQA ratios, strided, transposed and expanded (stride 0) inputs, empty
dimensions, causal attention with more queries than keys; NaN, infinities, huge values and
denormals; thread counts above the cores, torch's thread count changed between calls,
several Python threads at once, a forked child; a missing, corrupt, foreign or stale
extension on the import path; token containers, dtypes, out-of-range and hostile items
(an ``__index__`` that mutates the list being read) for the keys, and a model's weight
changed under the fused norm. The bugs were found by comparing with pure-Python / float64
references and by running the same checks on builds with ``-fsanitize=address``
(docs/native.md, "Checking the extensions").

The promise checked: never a wrong result (keys equal to the pure-Python chain byte for
byte; attention within float32 rounding of a float64 reference, or the wrapper declines and
torch runs; the fused norm equal to the module's own forward), never a crash or a hang, and
bad input a clear Python error.
"""

from __future__ import annotations

import array
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from kvstore import keys
from kvstore.errors import KeyFormatError, TokenError
from kvstore.integrations.batch.engines import flash, norm

NS = bytes(range(32))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_native = pytest.mark.skipif(keys._native is None, reason="kvstore._native not built")
needs_attention = pytest.mark.skipif(not flash.kernel_available(),
                                     reason="kvstore._attention not built")
needs_rmsnorm = pytest.mark.skipif(not norm.fused_norm_available(),
                                   reason="kvstore._rmsnorm not built")


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (this checkout first on the path)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


# -- keys ----------------------------------------------------------------------------------

def _outcome(tokens, bt, extras=None, native=True):
    saved = keys._native
    if not native:
        keys._native = None
    try:
        return "ok", list(keys.block_keys(NS, tokens, bt, extras=extras))
    except (TokenError, KeyFormatError) as e:
        return type(e).__name__, str(e)
    finally:
        keys._native = saved


class _Index:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


def _containers():
    rng = np.random.default_rng(14)
    toks = rng.integers(0, 2**32, 16 * 5 + 3, dtype=np.uint64)
    small = rng.integers(0, 2**15, 16 * 5 + 3, dtype=np.int64)
    yield "list", toks.tolist()
    yield "tuple", tuple(toks.tolist())
    yield "range", range(100)
    yield "generator", (i for i in range(100))
    yield "array I", array.array("I", toks.tolist())
    for dt in ("<u4", ">u4", "<i8", ">i8", "<u8", "<i2", ">u2"):
        a = (small if dt.endswith("2") else toks).astype(dt)
        yield f"numpy {dt}", a
        yield f"numpy {dt} strided", np.repeat(a, 3)[::3]
        yield f"numpy {dt} one row", a.reshape(1, -1)
    t = torch.from_numpy(small)
    for dt in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        yield f"torch {dt}", t.to(dt).clamp_min(0)
        yield f"torch {dt} strided", t.to(dt).clamp_min(0)[::2]
    for dt in (torch.uint16, torch.uint32, torch.uint64):  # torch's unsigned shell dtypes
        yield f"torch {dt}", t.clamp_min(0).to(dt)
    yield "torch uint64 past 2**32", torch.full((40,), 2**32 + 1, dtype=torch.uint64)
    yield "int subclass", [type("I", (int,), {})(7)] * 40
    yield "__index__ objects", [_Index(5)] * 40
    yield "numpy scalars in a list", [np.int64(3), np.uint32(4)] * 20
    # rejected ones: both paths must say the same
    yield "negative", [1, 2, -1] * 20
    yield "2**32", [2**32] * 20
    yield "2**64 __index__", [_Index(2**64)] * 20
    yield "bool item", [1, True] * 20
    yield "float item", [1, 2.0] * 20
    yield "numpy negative", np.full(40, -1)
    yield "numpy uint64 max", np.full(40, 2**64 - 1, dtype=np.uint64)
    yield "numpy bool", np.ones(40, dtype=bool)
    yield "numpy float", np.ones(40)
    yield "numpy two rows", np.ones((2, 40), dtype=np.int64)
    yield "numpy 0-d", np.array(5)
    yield "torch negative", torch.full((40,), -1)
    yield "torch float", torch.ones(40)
    yield "bytes", b"\0" * 64
    yield "str", "abcd"
    yield "None", None


@needs_native
@pytest.mark.parametrize("bt", [1, 3, 16, 17, 64])
def test_native_keys_equal_the_python_chain_on_every_container(bt):
    for name, tokens in _containers():
        if name == "generator":  # read once: one per path
            got, want = (_outcome((i for i in range(100)), bt, native=n) for n in (True, False))
        else:
            got, want = _outcome(tokens, bt), _outcome(tokens, bt, native=False)
        assert got == want, name


@needs_native
def test_native_keys_with_extras_and_bad_extras_equal_the_python_chain():
    toks = list(range(16 * 6 + 5))
    lens = [0, 1, 23, 24, 55, 56, 64, 119, 200]
    extras = [None if i % 3 == 0 else bytes([i]) * lens[i % len(lens)] for i in range(6)]
    for ex in (extras, [None if e is None else bytearray(e) for e in extras],
               [None if e is None else memoryview(e) for e in extras], extras + [b"partial"],
               [b"a"], [b"a", 5, None, None, None, None], ["a"] * 6, "abcdef"):
        for bt in (16, 17):
            n = len(toks) // bt
            e = ex if len(ex) != 6 or bt == 16 else list(ex)[:n]
            assert _outcome(toks, bt, e) == _outcome(toks, bt, e, native=False), (ex, bt)
    # bad tokens are reported before bad extras on both paths
    assert _outcome([-1] * 40, 16, [b"a", 5]) == _outcome([-1] * 40, 16, [b"a", 5], native=False)


@needs_native
def test_native_impls_and_hashlib_agree_on_odd_sizes():
    import hashlib

    n = keys._native
    impls = ["portable"] + (["sha-ni"] if n.cpu_has_sha_ni() else [])
    for length in [*range(0, 130), 1000, 65536, 65537]:
        d = bytes((i * 7) % 256 for i in range(length))
        for impl in impls:
            assert n.sha256(d, impl=impl) == hashlib.sha256(d).digest(), (length, impl)
    root = bytes(32)
    tb = np.random.default_rng(1).integers(0, 2**32, 1000, dtype=np.uint64).astype("<u4")
    for bt in (1, 3, 15, 16, 17, 100):
        ex = [None if i % 2 else bytes([i % 256]) * (i % 130) for i in range(1000 // bt)]
        want = keys.chain_python(root, tb.tobytes(), bt, ex)
        for impl in impls:
            assert n.chain_keys(root, tb.tobytes(), bt, ex, impl=impl) == want, (bt, impl)
            assert n.chain_keys(root, tb, bt, ex, impl=impl) == want, (bt, impl)


@needs_native
def test_native_keys_survive_hostile_items_and_sizes():
    n = keys._native
    tokens = list(range(40))

    class Mutates:  # its __index__ empties the list being read and refills it with others
        def __index__(self):
            tokens.clear()
            tokens.extend([_Index(1)] * 1000)
            return 7

    tokens[5] = Mutates()
    got = n.chain_keys(bytes(32), tokens, 16)  # the snapshot taken before any item ran
    assert got == keys.chain_python(bytes(32), array.array("I", [*range(5), 7, *range(6, 40)])
                                    .tobytes(), 16, None)

    class Raises:
        def __index__(self):
            raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError):
        n.chain_keys(bytes(32), [1, Raises()] * 20, 16)
    for bt in (2**63 - 1, 2**63, 2**200):  # more tokens per block than there are: no key
        assert n.chain_keys(bytes(32), bytes(64), bt) == []
    with pytest.raises(ValueError):
        n.chain_keys(bytes(32), bytes(64), -2**200)
    with pytest.raises(ValueError):
        n.chain_keys(bytes(32), np.arange(64).reshape(8, 8).T, 16)  # not C-contiguous
    for fmt in ("B", "b", "?", "c"):
        with pytest.raises(TypeError):
            n.chain_keys(bytes(32), memoryview(bytes(64)).cast(fmt), 16)


def test_a_lazily_negated_token_tensor_is_keyed_by_its_values():
    """torch's negative bit: the memory holds the negatives, numpy() refuses; the ids are
    the values (was a TokenError, "cannot be read", on both paths)."""
    t = torch._neg_view(torch.tensor([-5, -6] * 16))
    want = _outcome([5, 6] * 16, 16)
    assert want[0] == "ok"
    assert _outcome(t, 16) == want and _outcome(t, 16, native=False) == want


@needs_native
def test_native_keys_from_threads_at_once_equal_one_thread():
    toks = np.random.default_rng(0).integers(0, 2**32, 16 * 3000, dtype=np.uint32)
    want = keys.chain_python(keys.root_key(NS), toks.astype("<u4").tobytes(), 16, None)
    bad = []

    def work():
        for _ in range(5):
            if list(keys.block_keys(NS, toks, 16)) != want:  # GIL released while hashing
                bad.append(1)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


# -- attention -----------------------------------------------------------------------------

def _reference(q, k, v, scale, causal):
    """float64 softmax attention, causal bottom-right; a query that sees no key: 0, -inf."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    m, n = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.arange(n)[None] > torch.arange(m)[:, None] + (n - m), -torch.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


def _check(q, k, v, causal, threads=2, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    got = flash.attend(q, k, v, scale, causal, threads=threads)
    assert got is not None
    o, lse = got
    ro, rl = _reference(q, k, v, scale, causal)
    torch.testing.assert_close(o.double(), ro, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), rl, rtol=0, atol=2e-5)


@pytest.fixture
def every_size(monkeypatch):
    monkeypatch.setattr(flash, "MIN_WORK", 0)  # the kernel on small calls too


@needs_attention
@pytest.mark.parametrize("D", [64, 128, 192])
def test_attention_at_block_edges_equals_a_float64_reference(every_size, D):
    torch.manual_seed(D)
    cases = [(1, 1), (63, 257), (64, 256), (65, 255), (257, 65), (257, 1), (1, 257), (65, 64)]
    for i, (M, K) in enumerate(cases):
        G = (1, 2, 3, 7)[i % 4]
        Hkv = 1 if G == 7 else 2
        q = torch.randn(1, Hkv * G, M, D)
        k, v = torch.randn(1, Hkv, K, D), torch.randn(1, Hkv, K, D)
        for causal in (False, True):  # causal with M > K: the first queries see no key
            _check(q, k, v, causal)


@needs_attention
def test_attention_reads_strided_transposed_and_expanded_inputs(every_size):
    torch.manual_seed(0)
    B, H, M, K, D = 2, 4, 70, 300, 64
    # transformers' layout: [B, M, H, D] transposed
    _check(torch.randn(B, M, H, D).transpose(1, 2), torch.randn(B, K, 2, D).transpose(1, 2),
           torch.randn(B, K, 2, D).transpose(1, 2), True)
    # odd strides on every axis but the last, storage offsets
    q = torch.randn(B + 1, 2 * H + 1, 3 * M + 1, D + 64)[1:, 1::2, 1::3, 5:5 + D]
    kb = torch.randn(B, 5, 2 * K + 3, D + 3)
    _check(q, kb[:, 1:5:2, 3::2, 3:3 + D], kb[:, 0:4:2, 2:2 * K + 2:2, :D], True)
    # stride 0: one KV head for all, one query block for all heads, one key for all rows
    k1, v1 = torch.randn(1, 1, K, D), torch.randn(1, 1, K, D)
    _check(torch.randn(B, H, M, D), k1.expand(B, 2, K, D), v1.expand(B, 2, K, D), False)
    _check(torch.randn(1, 1, M, D).expand(B, H, M, D), torch.randn(B, 2, K, D),
           torch.randn(B, 2, K, D), True)
    _check(torch.randn(B, H, M, D), torch.randn(1, 2, 1, D).expand(B, 2, K, D),
           torch.randn(B, 2, K, D), False)


@needs_attention
def test_attention_declines_what_it_does_not_take(every_size):
    def attend(q, k, v=None):
        return flash.attend(q, k, k if v is None else v, 0.1, False)

    for d in (32, 80, 96, 65, 576):
        t = torch.randn(1, 2, 64, d)
        assert attend(t, t) is None, d
    k = torch.randn(1, 2, 64, 64)
    assert attend(torch.randn(1, 3, 64, 64), k) is None  # 3 query heads on 2
    assert attend(torch.randn(1, 1, 64, 64), k) is None  # fewer query heads than KV heads
    assert attend(torch.randn(2, 2, 64, 64), k) is None  # batch sizes differ
    assert attend(k, k, torch.randn(1, 2, 63, 64)) is None  # v not k's shape
    for shape in ((0, 2, 64, 64), (1, 2, 0, 64)):
        assert attend(torch.randn(*shape), k) is None
    assert attend(k, torch.randn(1, 2, 0, 64)) is None  # no keys
    assert attend(torch.randn(1, 2, 64, 128)[..., ::2], k) is None  # last axis strided


@needs_attention
def test_attention_on_any_thread_count_and_from_threads_at_once(every_size):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 130, 64), torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64)
    for threads in (1, 3, 8, 17, 0, -1):  # above the cores; 0 and below: one
        _check(q, k, v, True, threads=threads)
    before = torch.get_num_threads()
    try:
        for n in (1, 3, 2):  # torch's count changed between calls: the kernel follows it
            torch.set_num_threads(n)
            _check(q, k, v, True, threads=None)
    finally:
        torch.set_num_threads(before)
    bad = []

    def work(i):
        g = torch.Generator().manual_seed(i)
        for _ in range(3):
            qs = torch.randn(1, 4, 100, 64, generator=g)
            ks, vs = torch.randn(1, 2, 400, 64, generator=g), torch.randn(1, 2, 400, 64, generator=g)
            o, _ = flash.attend(qs, ks, vs, 0.125, bool(i % 2), threads=3)
            if (o.double() - _reference(qs, ks, vs, 0.125, bool(i % 2))[0]).abs().max() > 2e-5:
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


@needs_attention
def test_attention_on_extreme_finite_values_agrees_with_the_reference(every_size):
    """Peaked softmax (scores in the thousands, and near exp's -87 cut-off), denormals, values
    near float32's top: within float32 rounding of the float64 reference, whose size there is
    a few ulps of the largest score times the largest value (each score is rounded once)."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 70, 64), torch.randn(1, 1, 300, 64), torch.randn(1, 1, 300, 64)
    for qs, ks, vs in ((q * 1e3, k, v), (q * 30, k, v), (q * 1e-40, k * 1e-3, v * 1e-40),
                       (q, k, v * 1e30)):
        o, lse = flash.attend(qs, ks, vs, 0.125, False, threads=2)
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()
        ro, rl = _reference(qs, ks, vs, 0.125, False)
        top = float((qs.double() @ ks.double()[0, 0].T).abs().max()) * 0.125
        tol = 8 * 2.0**-24 * max(top, 1.0)
        torch.testing.assert_close(o.double(), ro, rtol=0,  # subnormals: ulps of 2**-149
                                   atol=tol * float(vs.abs().max()) + 8 * 2.0**-149)
        torch.testing.assert_close(lse.double(), rl, rtol=0, atol=tol * max(top, 1.0))


@needs_attention
def test_a_nan_key_a_query_cannot_see_does_not_reach_it(every_size):
    """Causal: a NaN or infinite key at the last position reaches the last query only.
    torch's SDPA with the same boolean mask makes every output NaN (it adds the mask to the
    scores: NaN + -inf); masked keys must not matter, as in the float64 reference."""
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 2, 70, 64), torch.randn(1, 1, 300, 64), torch.randn(1, 1, 300, 64)
    for bad in (float("nan"), float("inf"), float("-inf")):
        kb = k.clone()
        kb[0, 0, -1] = bad
        o, _ = flash.attend(q, kb, v, 0.125, True, threads=2)
        assert torch.isfinite(o[:, :, :-1]).all(), bad
        ro, _ = _reference(q[:, :, :-1], kb[:, :, :-1], v[:, :, :-1], 0.125, True)
        torch.testing.assert_close(o[:, :, :-1].double(), ro, rtol=0, atol=2e-5)


@needs_attention
def test_a_nan_query_gives_nan_not_zero(every_size):
    # was: the running max skipped NaN and a block of NaN scores was taken for one the row
    # does not see (o = 0, lse = -inf: a plausible empty row instead of torch's NaN)
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 2, 70, 64), torch.randn(1, 1, 300, 64), torch.randn(1, 1, 300, 64)
    qn = q.clone()
    qn[0, 0, 5] = float("nan")
    o, lse = flash.attend(qn, k, v, 0.125, False, threads=2)
    assert torch.isnan(o[0, 0, 5]).all() and torch.isnan(lse[0, 0, 5])
    kn = k.clone()
    kn[0, 0, :256] = float("nan")  # the first key block: every score NaN
    o, lse = flash.attend(q, kn, v, 0.125, False, threads=2)
    assert torch.isnan(o).all() and torch.isnan(lse).all()


@needs_attention
def test_a_lazily_negated_input_is_read_as_its_values(every_size):
    # was: a tensor with torch's negative bit was taken, and the kernel read its memory (the
    # negatives)
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 2, 64, 64), torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
    got = flash.attend(q, torch._neg_view(k), v, 0.125, False, threads=2)
    assert got is None or torch.allclose(got[0].double(), _reference(q, -k, v, 0.125, False)[0],
                                         atol=2e-5)


@needs_attention
def test_attend_rows_equals_the_reference_per_sequence():
    if getattr(flash, "attend_rows", None) is None or not hasattr(flash._kernel, "attend_rows"):
        pytest.skip("no attend_rows in this build")
    import random

    rng = random.Random(3)
    torch.manual_seed(3)
    idx = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    for _ in range(12):
        D, Hkv, G = rng.choice([64, 128]), rng.choice([1, 2]), rng.choice([1, 3, 7])
        rows, C, S = rng.randint(1, 3), rng.choice([1, 63, 65, 300]), rng.randint(1, 3)
        mlen = [rng.choice([1, 5, 64, 65, 130]) for _ in range(S)]
        klen = [rng.randint(1, C) for _ in range(S)]
        krow = [rng.randrange(rows) for _ in range(S)]
        qstart, pos = [], rng.randint(0, 3)
        for m in mlen:
            qstart.append(pos)
            pos += m + rng.randint(0, 2)
        q = torch.randn(Hkv * G, pos, D)
        k = torch.randn(rows, C, Hkv, D).transpose(1, 2)
        v = torch.randn(rows, Hkv, C, D)
        causal = rng.random() < 0.7
        got = flash.attend_rows(q, k, v, idx(qstart), idx(mlen), idx(krow), idx(klen),
                                D ** -0.5, causal, threads=rng.choice([1, 2, 3]))
        assert got is not None
        for b in range(S):
            rows_b = slice(qstart[b], qstart[b] + mlen[b])
            ro, rl = _reference(q[:, rows_b][None], k[krow[b]:krow[b] + 1, :, :klen[b]],
                                v[krow[b]:krow[b] + 1, :, :klen[b]], D ** -0.5, causal)
            torch.testing.assert_close(got[0][:, rows_b][None].double(), ro, rtol=0, atol=2e-5)
            torch.testing.assert_close(got[1][:, rows_b][None].double(), rl, rtol=0, atol=2e-5)
    q, k = torch.randn(2, 10, 64), torch.randn(2, 1, 50, 64)
    for bad in (([0], [5], [2], [10]), ([0], [5], [-1], [10]), ([0], [5], [0], [51]),
                ([0], [0], [0], [10]), ([8], [5], [0], [10]), ([-1], [5], [0], [10])):
        with pytest.raises(ValueError):  # an index outside the tensors: never read
            flash.attend_rows(q, k, k, *map(idx, bad), 0.125, True)


# -- fork ----------------------------------------------------------------------------------

@needs_attention
def test_a_forked_child_with_one_torch_thread_runs_the_kernels():
    """GNU libgomp does not survive fork: once a process ran a parallel region, any parallel
    region in a forked child waits for threads that do not exist there, torch's own as much
    as the kernel's (hence torch.set_num_threads(1) in forked workers). With torch on one
    thread the kernel runs on one too, and the keys and the norm need no threads."""
    r = _run("""
        import os, sys, time, torch
        from kvstore import keys
        from kvstore.integrations.batch.engines import flash, norm
        flash.MIN_WORK = 0
        q, k = torch.randn(1, 4, 256, 64), torch.randn(1, 4, 2048, 64)
        want = flash.attend(q, k, k, 0.125, True, threads=2)[0]
        torch.randn(1 << 20).add_(1)  # torch's parallel team is up
        kw = keys.block_keys(bytes(32), list(range(4096)), 16)
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            got = flash.attend(q, k, k, 0.125, True)[0]
            ok = torch.equal(got, want) or torch.allclose(got, want, atol=1e-6)
            ok = ok and keys.block_keys(bytes(32), list(range(4096)), 16) == kw
            if norm._kernel is not None:
                x, w, out = torch.randn(3, 64), torch.ones(64), torch.empty(3, 64)
                norm._kernel.rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), 3, 64, 1e-6)
                ok = ok and torch.allclose(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                               + 1e-6), atol=1e-5)
            os._exit(0 if ok else 3)
        t0 = time.time()
        while time.time() - t0 < 30:
            p, st = os.waitpid(pid, os.WNOHANG)
            if p:
                print("exit", os.waitstatus_to_exitcode(st)); break
            time.sleep(0.05)
        else:
            os.kill(pid, 9); print("hung")
    """)
    assert r.stdout.strip() == "exit 0", (r.stdout, r.stderr[-2000:])


# -- import robustness ---------------------------------------------------------------------

#: every extension module, the attention kernel's builds per instruction set included
BROKEN = ("_native", "_rmsnorm", "_rope", "_attention", "_attention_avx2", "_attention_avx512")


@pytest.mark.parametrize("how", ["missing", "corrupt", "foreign", "stale"])
def test_a_broken_extension_on_the_path_means_the_fallback(tmp_path, how):
    """Each extension missing, a corrupt file, another module's build under its name, or a
    stale build without its function: the wrappers fall back (torch's attention, the
    module's own norm, the Python key chain) with the same results and no error."""
    import sysconfig

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for name in BROKEN:
        if how == "corrupt":
            (tmp_path / f"{name}{suffix}").write_bytes(b"\x7fELF not really" + bytes(64))
        elif how == "foreign":  # a real extension module, built for another name
            other = os.path.join(ROOT, "kvstore", ("_rmsnorm" if name != "_rmsnorm"
                                                   else "_native") + suffix)
            if not os.path.exists(other):
                pytest.skip("needs the built extensions")
            shutil.copyfile(other, tmp_path / f"{name}{suffix}")
        elif how == "stale":
            (tmp_path / f"{name}.py").write_text("VERSION = 0\n")
    r = _run(f"""
        import sys, torch
        import kvstore
        how = {how!r}
        if how == "missing":
            for name in {BROKEN!r}:
                sys.modules["kvstore." + name] = None
        else:
            kvstore.__path__.insert(0, {str(tmp_path)!r})
        from kvstore import keys
        from kvstore.integrations.batch.engines import flash, norm, qkv
        assert keys.backend == "python", keys.backend
        assert qkv._kernel is None, qkv._kernel
        assert not flash.kernel_available() or how == "stale", flash._kernel
        assert not norm.fused_norm_available(), norm._kernel
        ks = keys.block_keys(bytes(32), list(range(64)), 16)
        assert len(ks) == 4
        q = torch.randn(1, 2, 64, 64)
        if flash.kernel_available():  # a stale build: the function it lacks declines
            assert getattr(flash, "attend_rows", None) is None or flash.attend_rows(
                q[0], q, q, *(torch.zeros(1, dtype=torch.int64) + x for x in (0, 1, 0, 1)),
                0.1) is None
        else:
            assert flash.attend(q, q, q, 0.1, False) is None
        print("fine")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "fine", r.stderr[-3000:]


# -- the fused norm ------------------------------------------------------------------------

def _llama_norms():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model, norm.FusedNorms(model)


@needs_rmsnorm
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_the_fused_norm_follows_a_weight_cast_after_the_check(dtype):
    """model.half() / .to(dtype) / weight.data = ... change the weight in place after
    FusedNorms checked it; the kernel read ``dim`` float32 from the now 2-byte weight
    (AddressSanitizer: heap-buffer-overflow in rms_rows) and gave values near 1e35."""
    model, fused = _llama_norms()
    m = model.model.norm
    m.weight.data = m.weight.data.to(dtype)
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = m(x)
        with fused.active():
            got = m(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)


@needs_rmsnorm
def test_the_fused_norm_takes_any_input_the_module_takes():
    model, fused = _llama_norms()
    m = model.model.norm
    inputs = [torch.tensor(3.0), torch.randn(1), torch.randn(0, 64), torch.randn(2, 0, 64),
              torch.full((2, 64), float("nan")), torch.full((2, 64), float("inf")),
              torch.randn(2, 64) * 3e19, torch.full((2, 64), 1e-40), torch.zeros(2, 64),
              torch.randn(1, 64).expand(5, 64), torch.randn(10, 64)[3:],
              torch.randn(2, 3, 4, 64), torch._neg_view(torch.randn(3, 64))]
    with torch.no_grad():
        for x in inputs:
            want = m(x)
            with fused.active():
                got = m(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
        with pytest.raises(RuntimeError), fused.active():
            m(torch.randn(3, 32))  # the module's own error, not a read past the row


@needs_rmsnorm
def test_a_kernel_of_another_signature_leaves_the_norms_alone(monkeypatch):
    def old_build(*args):  # a stale build whose rms_norm takes other arguments
        raise TypeError(f"rms_norm() takes 5 arguments ({len(args)} given)")

    monkeypatch.setattr(norm, "_kernel", type("Old", (), {"rms_norm": staticmethod(old_build)}))
    model, fused = _llama_norms()
    assert len(fused) == 0  # was: the TypeError out of FusedNorms(model), the engine's build
