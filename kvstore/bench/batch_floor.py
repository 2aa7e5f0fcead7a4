"""The compute floor of a batch job: the fewest floating-point operations any exact execution
of it needs, at the best GEMM rate the machine gives in the same run.

Exact means what the engines compared here do: every token of the batch's token-level prefix
tree runs once through every layer (a token that several prompts share, once), every decode
step feeds one token per distinct prompt, every such token attends over every key before it
(scores and the weighted sum, ``4 x heads x head_dim`` per key and layer; softmax, norms and
the like are left out), and the LM head runs only where a token is sampled. No engine computes
less without changing the numbers (a lower precision, a pruned attention).

The rate is oneDNN's prepacked float32 GEMM (what the transformers engine and vLLM's CPU
backend both run) on the model's own projection shapes over 2,048 rows, the best of several
calls, and the best over the run: the floor is then a lower bound of the wall time even where
the machine was busy while the rate was measured. ``vLLM's time / floor`` bounds the speedup
over vLLM that any exact engine could show in that run.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["JobFlops", "ModelShape", "gemm_rate", "job_flops"]

#: rows of the calibration GEMMs (a prefill chunk's worth)
ROWS = 2048


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the operation count needs of a Llama-style decoder."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a ``LlamaConfig``-style mapping (``head_dim`` defaults to hidden / heads)."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(hidden, int(config["num_hidden_layers"]), heads,
                   int(config.get("num_key_value_heads", heads)),
                   int(config.get("head_dim") or hidden // heads),
                   int(config["intermediate_size"]), int(config["vocab_size"]))

    @property
    def linear_flops_per_token(self) -> int:
        """Q, K, V, O and the gated MLP's three projections, every layer."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.layers * (h * q + 2 * h * kv + q * h + 3 * h * self.ffn)

    @property
    def attention_flops_per_key(self) -> int:
        """One query token against one key, every layer: ``q.k`` and ``p * v``."""
        return 4 * self.layers * self.heads * self.head_dim


@dataclass(frozen=True, slots=True)
class JobFlops:
    """The operations an exact execution of a job needs (see the module's docstring)."""

    tokens: int  # token positions through the layers: the prefix tree's, then decode inputs
    linear: float
    attention: float
    head: float

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.head


def job_flops(prompts: Sequence[Sequence[int]], new_tokens: int | Sequence[int],
              shape: ModelShape) -> JobFlops:
    """The operations of generating ``new_tokens`` (one for all, or one per prompt) after
    each of ``prompts`` with a model of ``shape``, each shared token computed once."""
    each = ([int(new_tokens)] * len(prompts) if isinstance(new_tokens, int)
            else [int(n) for n in new_tokens])
    if len(each) != len(prompts) or any(n < 1 for n in each):
        raise ValueError("new_tokens: one count >= 1 for all prompts, or one per prompt")
    longest: dict[tuple[int, ...], int] = {}  # a prompt asked twice decodes once (greedy)
    for p, n in zip(prompts, each, strict=True):
        t = tuple(p)
        longest[t] = max(n, longest.get(t, 0))
    tokens = keys = sampled = 0
    prev: tuple[int, ...] = ()
    for p in sorted(longest):
        shared = _common(prev, p)
        prev = p
        n, length = longest[p], len(p)
        # the prompt's own tokens past what an earlier prompt computed, at positions
        # shared+1..length, each over that many keys; then n - 1 fed-back tokens (the last
        # sampled token is never fed)
        tokens += length - shared + n - 1
        keys += _span_sum(shared + 1, length + n - 1)
        sampled += n
    return JobFlops(tokens, float(tokens * shape.linear_flops_per_token),
                    float(keys * shape.attention_flops_per_key),
                    float(2 * shape.hidden * shape.vocab * sampled))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _span_sum(lo: int, hi: int) -> int:
    """``lo + (lo + 1) + ... + hi`` (0 when ``hi < lo``)."""
    return 0 if hi < lo else (lo + hi) * (hi - lo + 1) // 2


def gemm_rate(shape: ModelShape, threads: int, *, calls: int = 4) -> float:
    """The best float32 GEMM rate (FLOP/s) of ``calls`` calls on each of the model's MLP
    projection shapes over :data:`ROWS` rows, on ``threads`` threads: oneDNN's prepacked
    linear where this torch has it, else ``F.linear``."""
    import torch

    from kvstore.integrations.batch.engines.linear import packing_available

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        gen = torch.Generator().manual_seed(0)
        best = 0.0
        for k, n in ((shape.hidden, shape.ffn), (shape.ffn, shape.hidden)):
            x = torch.randn(ROWS, k, generator=gen)
            w = torch.randn(n, k, generator=gen)
            run = _packed(w) if packing_available() else (lambda a, w=w: torch.nn.functional.linear(a, w))
            run(x)  # warm: oneDNN builds its primitive on the first call
            for _ in range(calls):
                t0 = time.perf_counter()
                run(x)
                best = max(best, 2.0 * ROWS * k * n / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(before)


def _packed(w: Any) -> Any:
    import torch

    packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=ROWS)
    op = torch.ops.mkldnn._linear_pointwise
    return lambda x: op(x, packed, None, "none", [], "")
