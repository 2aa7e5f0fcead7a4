"""``kvstore demo``: a workload with shared prefixes run through an embedded store.

The engine is a real transformers decoder (Llama architecture, seeded random weights built
from a config: no downloads) driven through :mod:`kvstore.integrations.transformers` when
``transformers`` is importable, else a tiny decoder-only transformer written here in torch.
Each request looks up its longest cached prefix, loads those K/V blocks, computes only the
rest, generates a short greedy answer and puts the new full blocks. Every request is also run
without the cache, to check that logits and generated tokens are the same.

Workloads (token ids drawn from a seeded RNG):

- ``chat``: a shared system prompt, several conversations of several turns; each turn quotes
  the whole history, including the model's earlier answers.
- ``docqa``: documents, each asked several questions (system prompt + document + question).
- ``batch``: the docqa prompts arriving shuffled, planned with :mod:`kvstore.batch` (prefix
  tree, groups run together, shared prefixes pinned) and run by its ``BatchRunner``.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstore.keys import KeyChain
from kvstore.layout import KVLayout
from kvstore.store import Store, open_store

WORKLOADS = ("chat", "docqa", "batch")
MODEL_SIZES = ("tiny", "small")
VOCAB = 32000
BLOCK_TOKENS = 16


def default_store_path() -> Path:
    """``$XDG_CACHE_HOME/kvstore/demo`` (``~/.cache/kvstore/demo``); the admin commands name
    it when the default store is missing (``kvstore ls`` right after the demo)."""
    from kvstore.admin.common import demo_store_path

    return demo_store_path()


# -- workloads ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Sizes of a workload (tokens); ``answer`` is the greedy answer length per request."""

    system: int
    groups: int  # conversations or documents
    per_group: int  # turns or questions
    body: int  # document length (docqa/batch)
    user: tuple[int, int]  # user message / question length range
    answer: int


_SPECS = {
    "chat": WorkloadSpec(system=256, groups=4, per_group=4, body=0, user=(24, 72), answer=8),
    "docqa": WorkloadSpec(system=64, groups=3, per_group=5, body=640, user=(12, 40), answer=4),
    "batch": WorkloadSpec(system=64, groups=4, per_group=5, body=512, user=(12, 40), answer=4),
}
#: ``--quick``: the same shapes, smaller (smoke tests)
_QUICK_SPECS = {
    "chat": WorkloadSpec(system=96, groups=2, per_group=3, body=0, user=(12, 40), answer=4),
    "docqa": WorkloadSpec(system=32, groups=2, per_group=3, body=160, user=(8, 24), answer=3),
    "batch": WorkloadSpec(system=32, groups=3, per_group=3, body=160, user=(8, 24), answer=3),
}


def workload_size(kind: str, quick: bool = False) -> int:
    """Number of requests in ``kind``."""
    s = _spec(kind, quick)
    return s.groups * s.per_group


def _spec(kind: str, quick: bool = False) -> WorkloadSpec:
    try:
        return (_QUICK_SPECS if quick else _SPECS)[kind]
    except KeyError:
        raise ValueError(f"unknown workload {kind!r}; choose {', '.join(WORKLOADS)}") from None


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def qa_prompts(kind: str, seed: int, quick: bool = False) -> list[list[int]]:
    """The prompts of ``docqa`` (document-major) or ``batch`` (shuffled arrival order)."""
    s = _spec(kind, quick)
    rng = random.Random(seed)
    system = _toks(rng, s.system)
    docs = [_toks(rng, s.body) for _ in range(s.groups)]
    prompts = [system + d + _toks(rng, rng.randrange(*s.user)) for d in docs
               for _ in range(s.per_group)]
    if kind == "batch":
        rng.shuffle(prompts)
    return prompts


# -- engines -----------------------------------------------------------------------------------
class TinyTransformer:
    """A seeded random decoder-only transformer whose KV layout matches ``layout`` (fallback)."""

    def __init__(self, layout: KVLayout, vocab: int = VOCAB, hidden: int = 256, seed: int = 0):
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


def to_blocks(layout: KVLayout, kv_tokens: torch.Tensor) -> torch.Tensor:
    """``[n_blocks * T, L, P, H, D]`` -> ``[n_blocks, L, P, T, H, D]`` (full blocks only)."""
    T = layout.block_tokens
    n = kv_tokens.shape[0] // T
    return kv_tokens[: n * T].view(n, T, *kv_tokens.shape[1:]).permute(0, 2, 3, 1, 4, 5).contiguous()


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, L, P, T, H, D]`` -> ``[n * T, L, P, H, D]``."""
    n, L, P, T, H, D = blocks.shape
    return blocks.permute(0, 3, 1, 2, 4, 5).reshape(n * T, L, P, H, D)


@dataclass(frozen=True, eq=False)
class _ToyPrefill:
    logits: torch.Tensor
    kv: torch.Tensor  # [tokens, L, 2, H, D] of the whole prompt
    cached_tokens: int
    computed_tokens: int
    seconds: float
    put: Any = None

    @property
    def next_token(self) -> int:
        return int(self.logits.argmax())


@dataclass(frozen=True, eq=False)
class _ToyGeneration:
    tokens: tuple[int, ...]
    logits: torch.Tensor
    prefill: _ToyPrefill
    decode_seconds: float


class ToyEngine:
    """:class:`TinyTransformer` behind the same ``prefill``/``generate`` calls as the bridge."""

    name = "toy torch decoder"

    def __init__(self, store: Store, seed: int = 0) -> None:
        self.store = store
        self.layout = store.layout
        self.model = TinyTransformer(store.layout, seed=seed)

    def prefill(self, ids: Sequence[int], *, use_cache: bool = True) -> _ToyPrefill:
        store, T = self.store, self.layout.block_tokens
        ids = list(ids)
        t0 = time.perf_counter()
        n, keys, cached = 0, None, None
        if use_cache:
            keys = store.block_keys(ids)
            n = store.lookup(keys[: (len(ids) - 1) // T])
            if n:
                cached = from_blocks(store.fetch(keys[:n]).wait())
                n = cached.shape[0] // T
        start = n * T
        logits, kv_new = self.model.forward(ids[start:], cached)
        kv = kv_new if cached is None else torch.cat([cached, kv_new])
        put = None
        if keys is not None and len(keys) > n:
            put = store.put(keys[n:], to_blocks(self.layout, kv)[n: len(keys)])
        return _ToyPrefill(logits, kv, start, len(ids) - start, time.perf_counter() - t0, put)

    def generate(self, ids: Sequence[int], max_new_tokens: int, *,
                 use_cache: bool = True) -> _ToyGeneration:
        ids = list(ids)
        pre = self.prefill(ids, use_cache=use_cache)
        t0 = time.perf_counter()
        kv, logits, tokens = pre.kv, [pre.logits], [pre.next_token]
        while len(tokens) < max_new_tokens:
            lg, kv_new = self.model.forward(tokens[-1:], kv)
            kv = torch.cat([kv, kv_new])
            logits.append(lg)
            tokens.append(int(lg.argmax()))
        T = self.layout.block_tokens
        seq = ids + tokens[:-1]
        first, last = len(ids) // T, len(seq) // T
        if use_cache and last > first:
            keys: KeyChain = self.store.block_keys(seq)
            self.store.put(keys[first:last], to_blocks(self.layout, kv)[first:last])
        return _ToyGeneration(tuple(tokens), torch.stack(logits), pre, time.perf_counter() - t0)


def transformers_config(size: str, *, vocab: int = VOCAB) -> Any:
    """A Llama-architecture config (GQA 4:1, SwiGLU) scaled down to ``tiny`` or ``small``."""
    from transformers import LlamaConfig

    dims = {"tiny": (256, 4, 8, 2, 688), "small": (512, 8, 8, 2, 1376)}
    if size not in dims:
        raise ValueError(f"unknown model size {size!r}; choose {', '.join(MODEL_SIZES)}")
    hidden, layers, heads, kv_heads, ffn = dims[size]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=4096,
                       tie_word_embeddings=False)


def build_transformers_model(size: str, seed: int = 0) -> Any:
    """A seeded random-weight ``LlamaForCausalLM`` in float32, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(transformers_config(size)).float().eval()


def toy_layout(size: str) -> KVLayout:
    layers, heads = {"tiny": (4, 2), "small": (8, 2)}[size]
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=32, dtype=torch.float32,
                    block_tokens=BLOCK_TOKENS)


_STORE_ARGS = {"device": "cpu", "gpu_capacity": 0, "cpu_capacity": "256MiB",
               "disk_capacity": "2GiB"}


def open_engine(path: Path | None, *, engine: str = "auto", size: str = "tiny",
                seed: int = 0) -> tuple[Store, Any, str]:
    """Open the demo store and its engine: ``transformers`` (when importable) or ``toy``.

    Returns the store, the engine and a label naming the engine.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose {', '.join(MODEL_SIZES)}")
    why = ""
    if engine == "auto":
        try:
            import kvstore.integrations.transformers  # noqa: F401
        except ImportError:
            engine, why = "toy", ", transformers not installed"
        else:
            engine = "transformers"
    if engine == "transformers":
        from kvstore.integrations.transformers import PrefixCachedModel, open_store_for

        model = build_transformers_model(size, seed)
        store = open_store_for(model, path, block_tokens=BLOCK_TOKENS, **_STORE_ARGS)
        label = f"transformers {type(model).__name__} ({size}, random weights)"
        return store, PrefixCachedModel.from_model(model, store), label
    if engine != "toy":
        raise ValueError(f"unknown engine {engine!r}; choose auto, transformers or toy")
    store = open_store(path, layout=toy_layout(size), model_id=f"kvstore/toy-causal-{size}",
                       model_revision=f"seed-{seed}", **_STORE_ARGS)
    return store, ToyEngine(store, seed), f"{ToyEngine.name} ({size}{why})"


# -- running -----------------------------------------------------------------------------------
@dataclass
class PhaseResult:
    """One phase of the demo (one process): the workload run ``runs`` times.

    Token and block figures are those of the phase's first run (every run of a phase sees the
    same ones); times are medians over the runs, with each run's in ``*_runs``.
    """

    engine: str
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    hit_rate: float = 0.0
    cached_seconds: float = 0.0  # prefill with kvstore: lookup + load + compute + put
    uncached_seconds: float = 0.0  # the same prefills without the cache
    identical: bool = True  # same greedy tokens, logits within rtol = atol = 1e-4
    max_logit_diff: float = 0.0
    blocks_on_disk: int = 0
    disk_bytes: int = 0
    plan: dict[str, int] | None = field(default=None)
    runs: int = 1
    cached_runs: list[float] = field(default_factory=list)
    uncached_runs: list[float] = field(default_factory=list)
    kv_bytes_per_token: int = 0  # K/V bytes a cached token spares computing

    @property
    def speedups(self) -> list[float]:
        """``without / with`` of each run."""
        return [u / max(c, 1e-9) for c, u in zip(self.cached_runs, self.uncached_runs,
                                                strict=True)]

    @property
    def speedup(self) -> float:
        """The median of :attr:`speedups`."""
        return statistics.median(self.speedups) if self.speedups else 0.0

    def as_dict(self) -> dict[str, Any]:
        s = self.speedups
        return asdict(self) | {"speedups": s, "speedup": self.speedup,
                               "speedup_min": min(s, default=0.0),
                               "speedup_max": max(s, default=0.0)}


def _compare(res: PhaseResult, got: Any, ref: Any) -> None:
    diff = float((got.logits - ref.logits).abs().max())
    res.max_logit_diff = max(res.max_logit_diff, diff)
    same = got.tokens == ref.tokens and bool(
        torch.allclose(got.logits, ref.logits, rtol=1e-4, atol=1e-4))
    res.identical = res.identical and same


def _account(res: PhaseResult, prompt: Sequence[int], got: Any, ref: Any) -> None:
    pre = got.prefill
    if pre.put is not None:
        pre.put.wait()
    res.requests += 1
    res.prompt_tokens += len(prompt)
    res.reused_tokens += pre.cached_tokens
    res.computed_tokens += pre.computed_tokens
    res.generated_tokens += len(got.tokens)
    res.cached_seconds += pre.seconds
    res.uncached_seconds += ref.prefill.seconds
    _compare(res, got, ref)


def run_workload(store: Store, engine: Any, workload: str, seed: int = 0,
                 progress: Callable[[], object] | None = None, quick: bool = False) -> PhaseResult:
    """Run ``workload`` through ``engine`` (cached) and again uncached, and compare.

    Flushes the store at the end, so the disk figures count every block of the run.
    """
    spec = _spec(workload, quick)
    res = PhaseResult(engine=getattr(engine, "name", type(engine).__name__))
    tick = progress or (lambda: None)
    before = store.stats()
    # warm-up: the process's first forward passes pay one-time costs that would otherwise
    # land on whichever path ran first
    for n in (3 * BLOCK_TOKENS + 1, 2):
        engine.generate(_toks(random.Random(-1), n), 2, use_cache=False)
    if workload == "chat":
        rng = random.Random(seed)
        system = _toks(rng, spec.system)
        histories = [list(system) for _ in range(spec.groups)]
        for _turn in range(spec.per_group):  # conversations interleave, one turn each
            for h in histories:
                h += _toks(rng, rng.randrange(*spec.user))
                got = engine.generate(h, spec.answer)
                ref = engine.generate(h, spec.answer, use_cache=False)
                _account(res, h, got, ref)
                h += list(got.tokens)
                tick()
    elif workload == "docqa":
        for p in qa_prompts(workload, seed, quick):
            got = engine.generate(p, spec.answer)
            ref = engine.generate(p, spec.answer, use_cache=False)
            _account(res, p, got, ref)
            tick()
    elif workload == "batch":
        _run_batch(store, engine, spec, qa_prompts(workload, seed, quick), res, tick)
    else:
        raise ValueError(f"unknown workload {workload!r}; choose {', '.join(WORKLOADS)}")
    store.flush()
    st = store.stats()
    hits, misses = st.hits - before.hits, st.misses - before.misses  # this run's lookups
    res.hit_rate = hits / (hits + misses) if hits + misses else 0.0
    disk = st.tier("disk")
    if disk is not None:
        res.blocks_on_disk, res.disk_bytes = disk.blocks, disk.used_bytes
    res.cached_runs, res.uncached_runs = [res.cached_seconds], [res.uncached_seconds]
    lay = store.layout
    res.kv_bytes_per_token = lay.block_nbytes // lay.block_tokens
    return res


def _run_batch(store: Store, engine: Any, spec: WorkloadSpec, prompts: list[list[int]],
               res: PhaseResult, tick: Callable[[], object]) -> None:
    from kvstore.batch import BatchRunner, plan_batch

    T = store.layout.block_tokens
    # a memory budget of about two documents: arrival order thrashes it, the plan does not
    longest = max(-(-len(p) // T) for p in prompts)
    budget = 2 * longest
    plan = plan_batch(prompts, store=store, budget_blocks=budget)
    res.plan = {"naive_tokens": plan.naive_tokens, "arrival_tokens": plan.arrival_tokens,
                "planned_tokens": plan.planned_tokens, "budget_blocks": budget,
                "groups": len(plan.groups)}
    gots: Sequence[Any]
    if isinstance(engine, ToyEngine):  # the plan's order, without the runner's pins
        gots = [None] * len(prompts)
        for step in plan.steps:
            gots[step.prompt] = engine.generate(prompts[step.prompt], spec.answer)  # type: ignore[index]
            tick()
    else:  # the transformers bridge
        out = BatchRunner(engine).run(plan, prompts, max_new_tokens=spec.answer, progress=tick)
        gots = out.outputs
    for p, got in zip(prompts, gots, strict=True):
        ref = engine.generate(p, spec.answer, use_cache=False)
        _account(res, p, got, ref)


def _merge(first: PhaseResult, more: PhaseResult) -> None:
    """Fold a repetition into the phase's result: its times, and whether it matched."""
    first.cached_runs.append(more.cached_seconds)
    first.uncached_runs.append(more.uncached_seconds)
    first.identical = first.identical and more.identical
    first.max_logit_diff = max(first.max_logit_diff, more.max_logit_diff)


def run_phase(path: Path | None, workload: str, *, seed: int = 0, size: str = "tiny",
              engine: str = "auto", cold: bool = False, quick: bool = False, repeat: int = 1,
              progress: Callable[[], object] | None = None) -> PhaseResult:
    """Open the store, run ``workload`` ``repeat`` times, close the store (everything durable
    on disk). Each run starts from the state the phase is about: ``cold``, an empty cache
    (this demo's namespace only); else empty memory over the disk a previous process left,
    as a freshly started process has it."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    store, eng, label = open_engine(path, engine=engine, size=size, seed=seed)
    with store:
        res: PhaseResult | None = None
        for i in range(repeat):
            if cold:
                store.evict()  # every tier, disk included
            elif i:
                for tier in ("hot", "warm"):  # memory only: the disk keeps every block
                    store.evict(tier=tier)
            one = run_workload(store, eng, workload, seed=seed, progress=progress, quick=quick)
            if res is None:
                res = one
            else:
                _merge(res, one)
    assert res is not None
    res.runs = repeat
    res.cached_seconds = statistics.median(res.cached_runs)
    res.uncached_seconds = statistics.median(res.uncached_runs)
    res.engine = label
    return res
