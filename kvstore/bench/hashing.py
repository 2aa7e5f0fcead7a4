"""Block-key hashing: the native chain and the pure-Python chain against a vLLM-style scheme.

Workload: one 131,072-token prompt (a Python list of random ids < 128,000) cut into 16-token
blocks. The peer is the scheme vLLM's prefix cache uses with its sha256 hash: per block,
``sha256(pickle.dumps((parent, tuple(tokens16), None)))`` in a Python loop. Every figure is the
best of several runs and covers the whole public call, from the Python list to the list of
32-byte keys.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from collections.abc import Callable

from kvstore import keys
from kvstore.bench import BenchOptions, BenchRow, best_time, time_row

SECTION = "hashing"
BLOCK_TOKENS = 16
VOCAB = 128_000


def vllm_style_keys(tokens: list[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """vLLM-style chained block hashes: sha256 over a pickled (parent, tokens, extras) tuple."""
    sha256, dumps, proto = hashlib.sha256, pickle.dumps, pickle.HIGHEST_PROTOCOL
    parent = sha256(b"").digest()  # stands in for vLLM's NONE_HASH seed
    out: list[bytes] = []
    for i in range(0, len(tokens) // block_tokens * block_tokens, block_tokens):
        parent = sha256(dumps((parent, tuple(tokens[i : i + block_tokens]), None), proto)).digest()
        out.append(parent)
    return out


def python_keys(namespace_id: bytes, tokens: list[int]) -> keys.KeyChain:
    """What ``block_keys`` computes on the pure-Python backend (``KVSTORE_PURE_PYTHON=1``)."""
    root = keys.root_key(namespace_id)
    chain = keys.chain_python(root, keys.tokens_to_u32le(tokens), BLOCK_TOKENS, None)
    return keys.KeyChain(chain, namespace_id, None)


def _note(n_tokens: int, seconds: float, extra: str = "") -> str:
    n_blocks = n_tokens // BLOCK_TOKENS
    s = f"{n_tokens / seconds / 1e6:.1f} M tokens/s, {seconds / n_blocks * 1e9:.0f} ns/block"
    return f"{s}; {extra}" if extra else s


def run(opts: BenchOptions) -> list[BenchRow]:
    n_tokens = 16_384 if opts.quick else 131_072
    repeat = 3 if opts.quick else 15
    min_time = 0.0 if opts.quick else 0.3
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB) for _ in range(n_tokens)]
    namespace_id = hashlib.sha256(b"kvstore-bench/hashing").digest()

    def timed(fn: Callable[[], object]) -> float:
        return best_time(fn, repeat=repeat, min_time=min_time)

    t_vllm = timed(lambda: vllm_style_keys(tokens))
    t_py = timed(lambda: python_keys(namespace_id, tokens))
    ref = python_keys(namespace_id, tokens)

    what = f"{n_tokens} tokens, {BLOCK_TOKENS}-token blocks"
    vllm_name = "vLLM-style sha256(pickle) loop"
    rows = [
        time_row(SECTION, f"pure-Python block keys ({what})", t_py, vllm_name, t_vllm, goal=2.0,
                 note=_note(n_tokens, t_py, f"vLLM-style: {_note(n_tokens, t_vllm)}")),
    ]

    native = keys._native if keys.backend == "native" else None
    if native is None:
        return rows

    impl = native.active_impl()
    got = keys.block_keys(namespace_id, tokens, BLOCK_TOKENS)
    if list(got) != list(ref):  # pragma: no cover - the tests pin this
        raise AssertionError("native and pure-Python block keys differ")
    t_nat = timed(lambda: keys.block_keys(namespace_id, tokens, BLOCK_TOKENS))
    name = f"native block keys, {impl} ({what})"
    note = _note(n_tokens, t_nat)
    rows.append(time_row(SECTION, name, t_nat, vllm_name, t_vllm, goal=20.0, note=note))
    rows.append(time_row(SECTION, name, t_nat, "pure-Python block keys", t_py, goal=5.0,
                         note=note))
    # The physical limit: a chain is serial (each key hashes its parent), so it cannot beat
    # the latency of the SHA-256 compressions it needs, measured here as this implementation's
    # speed over one long buffer (where consecutive compressions are just as dependent).
    n_blocks = n_tokens // BLOCK_TOKENS
    per_block = -(-(32 + 4 * BLOCK_TOKENS + 9) // 64)  # parent + tokens + padding, in 64 B
    buf = bytes(64 << 20 if not opts.quick else 8 << 20)
    t_buf = best_time(lambda: native.sha256(buf, impl=impl), repeat=3)
    t_floor = t_buf / (len(buf) // 64) * per_block * n_blocks
    rows.append(time_row(
        SECTION, name, t_nat, f"{per_block} serial SHA-256 compressions per block", t_floor,
        note=f"{t_buf / (len(buf) // 64) * 1e9:.1f} ns per compression ({impl}); at this floor "
             f"the vLLM-style ratio would be {t_vllm / t_floor:.1f}x"))

    if impl != "portable":
        # the portable C path, for machines without SHA extensions (no goal: informational)
        root = keys.root_key(namespace_id)

        def portable() -> list[bytes]:
            return native.chain_keys(root, tokens, BLOCK_TOKENS, None, impl="portable")

        if portable() != list(ref):  # pragma: no cover
            raise AssertionError("portable native and pure-Python block keys differ")
        t_port = timed(portable)
        rows.append(time_row(SECTION, f"native block keys, portable C ({what})", t_port,
                             "pure-Python block keys", t_py, note=_note(n_tokens, t_port)))
    return rows
