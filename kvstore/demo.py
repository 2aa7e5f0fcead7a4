"""``kvstore demo``: a workload with shared prefixes run through an embedded store.

The "engine" is a tiny decoder-only transformer written in torch (seeded random weights, no
downloads): causal multi-head attention over a per-layer K/V cache plus an MLP. Each request
looks up its longest cached prefix, loads those K/V blocks, computes only the suffix, and puts
the new full blocks. Every request is also prefilled from scratch, to check that the cached
path gives the same next-token logits and greedy token.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.layout import KVLayout
from kvstore.store import Store, open_store


def default_store_path() -> Path:
    """``$XDG_CACHE_HOME/kvstore/demo`` (``~/.cache/kvstore/demo``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstore" / "demo"


class TinyTransformer:
    """A seeded random decoder-only transformer whose KV layout matches ``layout``."""

    def __init__(self, layout: KVLayout, vocab: int = 32000, hidden: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.layout = layout
        H, D = layout.num_kv_heads, layout.head_dim

        def w(i: int, o: int) -> torch.Tensor:
            return torch.randn(i, o, generator=g) / i**0.5

        self.embed = torch.randn(vocab, hidden, generator=g)
        self.layers = [
            (w(hidden, H * D), w(hidden, H * D), w(hidden, H * D), w(H * D, hidden),
             w(hidden, 4 * hidden), w(4 * hidden, hidden))
            for _ in range(layout.num_layers)
        ]
        self.unembed = w(hidden, vocab)

    def forward(self, tokens: list[int], past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of the last token and the KV ``[n_tokens, L, 2, H, D]`` of the new tokens.

        ``past``: KV of the cached prefix ``[p, L, 2, H, D]`` (``tokens`` are the suffix).
        """
        lay = self.layout
        H, D = lay.num_kv_heads, lay.head_dim
        p = 0 if past is None else past.shape[0]
        x = self.embed[torch.tensor(tokens, dtype=torch.long)]
        n = x.shape[0]
        new_kv = torch.empty(n, lay.num_layers, 2, H, D)
        mask = torch.ones(n, p + n, dtype=torch.bool).tril(diagonal=p)
        for i, (wq, wk, wv, wo, w1, w2) in enumerate(self.layers):
            h = torch.nn.functional.layer_norm(x, x.shape[-1:])
            q = (h @ wq).view(n, H, D).transpose(0, 1)
            k_new, v_new = (h @ wk).view(n, H, D), (h @ wv).view(n, H, D)
            new_kv[:, i, 0], new_kv[:, i, 1] = k_new, v_new
            k_all, v_all = k_new, v_new
            if past is not None:
                k_all = torch.cat([past[:, i, 0].float(), k_new])
                v_all = torch.cat([past[:, i, 1].float(), v_new])
            att = torch.nn.functional.scaled_dot_product_attention(
                q, k_all.transpose(0, 1), v_all.transpose(0, 1), attn_mask=mask)
            x = x + att.transpose(0, 1).reshape(n, H * D) @ wo
            x = x + torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, x.shape[-1:]) @ w1) @ w2
        return x[-1] @ self.unembed, new_kv.to(lay.dtype)


@dataclass(frozen=True, slots=True)
class DemoResult:
    requests: int
    prompt_tokens: int
    reused_tokens: int
    hit_rate: float
    cached_seconds: float
    uncached_seconds: float
    identical: bool


def _workload(kind: str, rng: random.Random) -> list[list[int]]:
    def toks(n: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(n)]

    if kind == "chat":
        system = toks(512)
        out = []
        for _ in range(6):
            history = list(system)
            for _turn in range(4):
                history += toks(rng.randrange(40, 120))
                out.append(list(history))
        return out
    if kind == "docqa":
        out = []
        for _ in range(4):
            doc = toks(1024)
            out += [doc + toks(rng.randrange(20, 60)) for _ in range(6)]
        return out
    raise ValueError(f"unknown workload {kind!r}; choose chat or docqa")


def to_blocks(layout: KVLayout, kv_tokens: torch.Tensor) -> torch.Tensor:
    """``[n_blocks * T, L, P, H, D]`` -> ``[n_blocks, L, P, T, H, D]`` (full blocks only)."""
    T = layout.block_tokens
    n = kv_tokens.shape[0] // T
    return kv_tokens[: n * T].view(n, T, *kv_tokens.shape[1:]).permute(0, 2, 3, 1, 4, 5).contiguous()


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, L, P, T, H, D]`` -> ``[n * T, L, P, H, D]``."""
    n, L, P, T, H, D = blocks.shape
    return blocks.permute(0, 3, 1, 2, 4, 5).reshape(n * T, L, P, H, D)


def run_demo(store: Store, model: TinyTransformer, workload: str, seed: int = 0,
             progress=None) -> DemoResult:
    """Run ``workload`` through ``store`` and ``model``; compare with uncached prefills."""
    lay = store.layout
    rng = random.Random(seed)
    prompts = _workload(workload, rng)
    reused = total = 0
    t_cached = t_fresh = 0.0
    identical = True
    for prompt in prompts:
        t0 = time.perf_counter()
        keys = store.block_keys(prompt)
        # keep the last token out of the cached part: its logits must be computed
        n = store.lookup(keys[: (len(prompt) - 1) // lay.block_tokens])
        cached = store.fetch(keys[:n]).wait()
        n = cached.shape[0]  # a damaged block shortens the run: recompute from there
        start = n * lay.block_tokens
        logits, kv_new = model.forward(prompt[start:], from_blocks(cached) if n else None)
        store.put(keys[n:], to_blocks(lay, kv_new)[: len(keys) - n]).wait()
        t_cached += time.perf_counter() - t0

        t0 = time.perf_counter()
        ref_logits, _ = model.forward(prompt, None)
        t_fresh += time.perf_counter() - t0
        identical &= bool(torch.allclose(logits, ref_logits, rtol=1e-4, atol=1e-4)) and int(
            logits.argmax()) == int(ref_logits.argmax())
        reused += start
        total += len(prompt)
        if progress is not None:
            progress()
    st = store.stats()
    return DemoResult(len(prompts), total, reused, st.hit_rate, t_cached, t_fresh, identical)


def demo_layout() -> KVLayout:
    return KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_tokens=16)


def open_demo_store(path: Path | None) -> Store:
    return open_store(path, layout=demo_layout(), model_id="kvstore/toy-causal", device="cpu",
                      gpu_capacity=0, cpu_capacity="256MiB", disk_capacity="1GiB")
