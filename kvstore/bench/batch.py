"""Batched prefix sharing against vLLM's prefix caching (and, on the toy, HF padded batching),
same prompts, same run, interleaved.

Models (seeded random weights, float32, :data:`MODELS`): by default a 110M Llama (hidden 768,
12 layers, 12 query / 4 KV heads of 64, FFN 2048, vocab 8192; ``KVSTORE_BENCH_BATCH_MODEL=0.5b``:
hidden 896, 24 layers, 14 / 2 heads, FFN 4864, vocab 32k); under ``--quick`` a toy (hidden
128, 2 layers) and a quarter of the sizes. Greedy, EOS ignored. Workloads (issue 28):

- ``doc``: one 2,000-token document + 32 questions (16-47 tokens), 8 new tokens;
- ``docs``: 4 documents of 1,500 tokens x 8 questions, shuffled, 8 new;
- ``chat``: a 400-token system prompt + 48 turns of 60-200 tokens, 8 new (little to share);
- ``long``: one 3,800-token document x 64 questions x 64 new tokens (decode-heavy).
- ``many``: 192 requests on 6 system prompts of 400 tokens, turns of 60-200 tokens,
  shuffled, 4-48 new tokens each (a job of many batches whose rows finish at different steps:
  what continuous batching is for).

``$KVSTORE_BENCH_BATCH_WORKLOADS=doc,many`` runs only those.

Methods, each in its own worker process: the kvstore transformers engine
(``python -m kvstore.bench.batch MODEL_DIR``, started as ``kvstore batch run`` starts it) and
vLLM APC (every prompt in one ``generate``, arrival order; with ``--quick`` also the kvstore
vLLM engine: prefixes primed first, plan order, kvstore connector) in a vLLM environment
(``$KVSTORE_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` of the checkout; without one their
rows are skipped), each on as many threads as the cores this process may use. Each repeat
gives vLLM a fresh ``cache_salt`` (cold caches). Times are medians over the repeats
(``$KVSTORE_BENCH_BATCH_REPEATS``, default 3; 1 with ``--quick``), every time in the note;
greedy tokens are compared between the methods. Before anything is timed every method runs
the first workload once (a process's first run pays one-time costs: vLLM's first ``generate``
took 1.4x its second on ``doc``).

Each workload's engine time is also set against its compute floor (:mod:`kvstore.bench.
batch_floor`: the fewest FLOPs an exact execution needs, at the run's best float32 GEMM rate,
measured between the workloads), and the floor against vLLM APC: the largest speedup over vLLM
any exact engine could show in that run.

``$KVSTORE_BENCH_BATCH_BASELINE=DIR`` (a checkout, or ``git archive REV kvstore | tar -x -C
DIR``) adds that tree's transformers engine as one more worker, interleaved with the rest:
before/after figures of an engine change from one run, on the same load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.bench import BenchOptions, BenchRow, time_row
from kvstore.bench.batch_floor import ModelShape, gemm_rate, job_flops

SECTION = "batch"
MARK = "KVSTORE-BATCH "  # the workers' answer lines
NEW_TOKENS = 8
VOCAB = 2048  # prompts draw token ids below this, valid in every model below
_LLAMA = dict(max_position_embeddings=8192, tie_word_embeddings=False, head_dim=64)
#: model shapes (seeded random weights, float32): ``toy`` under ``--quick``, else
#: ``$KVSTORE_BENCH_BATCH_MODEL`` (default ``110m``)
MODELS: dict[str, dict[str, Any]] = {
    "toy": dict(_LLAMA, vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "110m": dict(_LLAMA, vocab_size=8192, hidden_size=768, intermediate_size=2048,
                 num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
    "0.5b": dict(_LLAMA, vocab_size=32000, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
}
MODEL = MODELS["toy"]
#: goals of the transformers engine's wall time against vLLM APC (issue 28's)
GOALS = {"doc": 1.5, "docs": 1.5, "chat": 1.0, "long": 2.0, "many": 1.0}
VLLM_ENGINE_GOAL = 1.3
BASELINE = "baseline transformers engine"  # $KVSTORE_BENCH_BATCH_BASELINE's
TOKEN_GOAL = 1 / 1.05  # computed tokens within 1.05x of the lower bound


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    title: str
    prompts: tuple[tuple[int, ...], ...]
    new_tokens: int | tuple[int, ...] = NEW_TOKENS  # one for all, or one per prompt


def workloads(quick: bool = False, seed: int = 0) -> list[Workload]:
    """The four workloads of issue 28 and ``many`` (a quarter of the sizes with ``quick``)."""
    rng = random.Random(seed)
    s = 4 if quick else 1

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    def q() -> list[int]:
        return toks(rng.randrange(16, 48))

    doc = toks(2000 // s)
    w1 = [doc + q() for _ in range(32 // s)]
    docs = [toks(1500 // s) for _ in range(4)]
    w2 = [d + q() for d in docs for _ in range(8 // s)]
    rng.shuffle(w2)
    system = toks(400 // s)
    w3 = [system + toks(rng.randrange(60, 201) // s) for _ in range(48 // s)]
    long = toks(3800 // s)
    w4 = [long + q() for _ in range(64 // s)]
    systems = [toks(400 // s) for _ in range(6)]
    w5 = [sp + toks(rng.randrange(60, 201) // s) for sp in systems for _ in range(32 // s)]
    rng.shuffle(w5)
    many_new = tuple(rng.randrange(4, 49) // s or 1 for _ in w5)
    return [
        Workload("doc", f"one {len(doc):,}-token document + {len(w1)} questions, "
                        f"{NEW_TOKENS} new", _t(w1)),
        Workload("docs", f"4 documents of {len(docs[0]):,} tokens x {len(w2) // 4} questions, "
                         f"shuffled, {NEW_TOKENS} new", _t(w2)),
        Workload("chat", f"{len(system)}-token system prompt + {len(w3)} turns of "
                         f"{60 // s}-{200 // s} tokens, {NEW_TOKENS} new", _t(w3)),
        Workload("long", f"one {len(long):,}-token document x {len(w4)} questions x "
                         f"{64 // s} new", _t(w4), new_tokens=64 // s),
        Workload("many", f"{len(w5)} requests on 6 system prompts of {len(systems[0])} tokens, "
                         f"turns of {60 // s}-{200 // s} tokens, shuffled, "
                         f"{min(many_new)}-{max(many_new)} new each", _t(w5), new_tokens=many_new),
    ]


def _t(ps: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in ps)


def build_model(path: str | None = None, seed: int = 0, shape: str = "toy") -> Any:
    """The benchmark's model of ``shape`` (:data:`MODELS`; seeded random weights, spread so
    greedy choices are clear)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**MODELS[shape])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    if path is not None:
        model.save_pretrained(path)
    return model


class VLLMWorker:
    """A ``kvstore.bench.batch_vllm`` process: send a workload, get its timing back."""

    def __init__(self, python: str, model_dir: str, mode: str, store: str | None = None, *,
                 threads: int = 1) -> None:
        cores = "0" if threads <= 1 else f"0-{threads - 1}"  # the threads the engines in here use
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2",
                   VLLM_CPU_OMP_THREADS_BIND=cores,
                   VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        args = [python, "-m", "kvstore.bench.batch_vllm", model_dir, mode, *([store] if store else [])]
        self._start(args, env)

    def _start(self, args: list[str], env: dict[str, str], cwd: str | None = None) -> None:
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, cwd=cwd)
        self._read()  # ready

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"the vLLM worker exited ({self.proc.wait()})")

    def run(self, prompts: Any, salt: str,
            max_tokens: int | tuple[int, ...] = NEW_TOKENS) -> dict[str, Any]:
        assert self.proc.stdin is not None
        n = list(max_tokens) if isinstance(max_tokens, tuple) else max_tokens
        job = {"prompts": [list(p) for p in prompts], "max_tokens": n, "salt": salt}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class EngineWorker(VLLMWorker):
    """The transformers engine in its own process (``python -m kvstore.bench.batch MODEL_DIR``),
    started as ``kvstore batch run`` starts it: OpenMP's own waits, on as many threads as the
    cores other processes leave it, chosen as it runs
    (:class:`kvstore.integrations.batch.engines.threads.CoreShare`)."""

    def __init__(self, model_dir: str, *, threads: int | None = None,
                 tree: str | None = None) -> None:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        # tree: run that checkout's engine (``-m`` imports from the working directory first)
        self._start([sys.executable, "-m", "kvstore.bench.batch", model_dir], env, cwd=tree)


def _engine_main(model_dir: str) -> int:
    """The engine worker: one job per stdin line, one answer per stdout line (as
    :mod:`kvstore.bench.batch_vllm`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvstore.bench.batch_vllm import max_tokens
    from kvstore.integrations.batch.engines.transformers import TransformersEngine
    from kvstore.integrations.batch.requests import BatchRequest, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = TransformersEngine(model, eos_token_id=())
    print(MARK + json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        reqs = [BatchRequest(str(i), tuple(p), SamplingParams(max_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(job["prompts"], max_tokens(job), strict=True))]
        out: list[list[int]] = [[] for _ in reqs]
        rep = engine.run(reqs, on_done=lambda i, c, out=out: out.__setitem__(i, list(c.token_ids)))
        print(MARK + json.dumps({"seconds": rep.seconds, "computed": rep.computed_tokens,
                                 "stored": 0, "tokens": out}), flush=True)
    return 0


def vllm_python() -> str | None:
    """The python of a vLLM environment, if there is one."""
    env = os.environ.get("KVSTORE_VLLM_PYTHON")
    cand = Path(env) if env else Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return str(cand) if cand.exists() else None


def _hf_padded(model: Any, prompts: Any, new_tokens: int | tuple[int, ...]) -> list[list[int]]:
    import torch

    each = list(new_tokens) if isinstance(new_tokens, tuple) else [new_tokens] * len(prompts)
    new_tokens = max(each)  # greedy: a shorter answer is the longer one's start

    n = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), n), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return [row[:k] for row, k in zip(out[:, n:].tolist(), each, strict=True)]


Runner = Callable[[Workload, str], tuple[float, int | None, list[list[int]]]]


@dataclass
class _Method:
    label: str
    run: Runner
    times: list[float]
    tokens: int | None = None
    outputs: list[list[int]] | None = None


def _methods(model: Any, workers: dict[str, VLLMWorker]) -> list[_Method]:
    def worker(mode: str) -> Runner:
        def go(w: Workload, salt: str) -> tuple[float, int | None, list[list[int]]]:
            r = workers[mode].run(w.prompts, salt, w.new_tokens)
            return r["seconds"], int(r["computed"]), r["tokens"]
        return go

    def hf(w: Workload, salt: str) -> tuple[float, int | None, list[list[int]]]:
        t = time.perf_counter()
        out = _hf_padded(model, w.prompts, w.new_tokens)
        return time.perf_counter() - t, sum(len(p) for p in w.prompts), out

    ms = [_Method("kvstore transformers engine", worker("engine"), [])]
    if "baseline" in workers:
        ms.append(_Method(BASELINE, worker("baseline"), []))
    if model is not None:
        ms.append(_Method("HF padded batch", hf, []))
    if "apc" in workers:
        ms.append(_Method("vLLM APC", worker("apc"), []))
    if "plan" in workers:
        ms.append(_Method("kvstore vLLM engine", worker("plan"), []))
    return ms


def _warm(w: Workload, methods: list[_Method]) -> None:
    """Every method runs ``w`` once, untimed, before anything is measured: a first run pays
    one-time costs (vLLM's first ``generate`` of a process took 1.4x its second on ``doc``,
    the engine's 1.09x), which the first workload's repeats would otherwise carry alone."""
    for m in methods:
        m.run(w, f"bench-warm-{w.name}-{time.time_ns()}")


def _measure(w: Workload, methods: list[_Method], repeats: int) -> None:
    for rep in range(repeats):  # interleaved: every method once per round
        for m in methods:
            dt, tokens, out = m.run(w, f"bench-{w.name}-{rep}-{time.time_ns()}")
            m.times.append(dt)
            m.tokens = tokens
            m.outputs = out


def _rows(w: Workload, methods: list[_Method], shape: str = "toy",
          rate: float = 0.0) -> list[BenchRow]:
    from kvstore.integrations.batch.tree import unique_tokens

    by = {m.label: m for m in methods}
    med = {m.label: statistics.median(m.times) for m in methods}
    tf = by["kvstore transformers engine"]
    bound = unique_tokens(w.prompts)
    naive = sum(len(p) for p in w.prompts)
    agree = ", ".join(
        f"{m.label} {sum(a == b for a, b in zip(m.outputs or [], tf.outputs or [], strict=False))}/{len(w.prompts)}"
        for m in methods if m is not tf)
    m = MODELS[shape]
    note = (f"{shape} Llama (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
            f"{m['num_attention_heads']}/{m['num_key_value_heads']} heads, FFN "
            f"{m['intermediate_size']}, vocab {m['vocab_size']}, float32); {w.title}; "
            "times: " + ", ".join(f"{x.label} " + "/".join(f"{t:.2f}" for t in x.times)
                                  for x in methods) + " s; tokens computed: " + ", ".join(f"{m.label} {m.tokens:,}" for m in methods)
            + f"; lower bound {bound:,}, naive {naive:,}; greedy outputs equal to the "
            f"transformers engine's: {agree}")
    rows = [BenchRow(SECTION, f"{w.name}: prefill tokens, transformers engine", float(tf.tokens or 0),
                     "tokens", "lower bound (unique tokens)", float(bound),
                     bound / max(1, tf.tokens or 1), TOKEN_GOAL, note)]
    for ref in ("vLLM APC", "HF padded batch", BASELINE):
        if ref in med:
            rows.append(time_row(SECTION, f"{w.name}: wall, transformers engine", med[tf.label],
                                 ref, med[ref], unit="s",
                                 goal=GOALS.get(w.name) if ref == "vLLM APC" else None))
    if BASELINE in med and "vLLM APC" in med:
        rows.append(time_row(SECTION, f"{w.name}: wall, {BASELINE}", med[BASELINE],
                             "vLLM APC", med["vLLM APC"], unit="s"))
    if "kvstore vLLM engine" in med and "vLLM APC" in med:
        rows.append(time_row(SECTION, f"{w.name}: wall, kvstore vLLM engine",
                             med["kvstore vLLM engine"], "vLLM APC", med["vLLM APC"], unit="s",
                             goal=VLLM_ENGINE_GOAL))
    if rate > 0:
        rows.extend(_floor_rows(w, med, tf.label, shape, rate))
    return rows


def _floor_rows(w: Workload, med: dict[str, float], engine: str, shape: str,
                rate: float) -> list[BenchRow]:
    """The engine's wall time against the job's compute floor, and the floor against vLLM:
    the largest speedup over vLLM any exact engine could show in this run."""
    f = job_flops(w.prompts, w.new_tokens, ModelShape.of(MODELS[shape]))
    floor = f.total / rate
    what = (f"compute floor: {f.total / 1e12:.2f} TFLOP (linear {f.linear / 1e12:.2f}, "
            f"attention {f.attention / 1e12:.2f}, LM head {f.head / 1e12:.3f}) over "
            f"{f.tokens:,} token positions at the run's best float32 GEMM rate, "
            f"{rate / 1e9:.0f} GFLOP/s (kvstore/bench/batch_floor.py)")
    rows = [time_row(SECTION, f"{w.name}: wall, transformers engine", med[engine],
                     "compute floor", floor, unit="s", note=what)]
    if "vLLM APC" in med:
        rows.append(time_row(SECTION, f"{w.name}: compute floor (any exact engine)", floor,
                             "vLLM APC", med["vLLM APC"], unit="s", goal=GOALS.get(w.name),
                             note="the ratio bounds what any exact engine could show against "
                                  "vLLM APC in this run; " + what))
    return rows


def run(opts: BenchOptions) -> list[BenchRow]:
    """The section: under ``quick`` the toy model, every method, one repeat; else the
    ``$KVSTORE_BENCH_BATCH_MODEL`` shape (default 110m) against vLLM APC alone,
    ``$KVSTORE_BENCH_BATCH_REPEATS`` (default 3) interleaved repeats."""
    from kvstore.integrations.batch.engines.threads import usable_cores

    shape = "toy" if opts.quick else os.environ.get("KVSTORE_BENCH_BATCH_MODEL", "110m")
    if shape not in MODELS:
        raise ValueError(f"KVSTORE_BENCH_BATCH_MODEL={shape!r}: one of {', '.join(MODELS)}")
    repeats = 1 if opts.quick else int(os.environ.get("KVSTORE_BENCH_BATCH_REPEATS", "3"))
    only = [x.strip() for x in os.environ.get("KVSTORE_BENCH_BATCH_WORKLOADS", "").split(",")
            if x.strip()]
    known = [w.name for w in workloads(True)]
    if any(x not in known for x in only):
        raise ValueError(f"KVSTORE_BENCH_BATCH_WORKLOADS={','.join(only)}: names among "
                         f"{', '.join(known)}")
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-batch-", dir=opts.workdir))
    workers: dict[str, VLLMWorker] = {}
    try:
        model = build_model(str(work / "model"), shape=shape)
        if not opts.quick:  # HF's padded batch only on the toy (hours on the real shapes)
            model = None
        threads = usable_cores()  # every method computes on as many cores
        workers["engine"] = EngineWorker(str(work / "model"), threads=threads)
        base = os.environ.get("KVSTORE_BENCH_BATCH_BASELINE")
        if base:
            workers["baseline"] = EngineWorker(str(work / "model"), threads=threads, tree=base)
        py = vllm_python()
        if py is not None:
            workers["apc"] = VLLMWorker(py, str(work / "model"), "apc", threads=threads)
            if opts.quick:
                workers["plan"] = VLLMWorker(py, str(work / "model"), "plan",
                                             str(work / "store"), threads=threads)
        done: list[tuple[Workload, list[_Method]]] = []
        rate = 0.0  # the best GEMM rate of the run, measured between the workloads
        chosen = [w for w in workloads(opts.quick) if not only or w.name in only]
        if chosen:
            _warm(chosen[0], _methods(model, workers))
        for w in chosen:
            rate = max(rate, gemm_rate(ModelShape.of(MODELS[shape]), threads))
            methods = _methods(model, workers)
            _measure(w, methods, repeats)
            done.append((w, methods))
        rate = max(rate, gemm_rate(ModelShape.of(MODELS[shape]), threads))
        return [r for w, methods in done for r in _rows(w, methods, shape, rate)]
    finally:
        for wk in workers.values():
            wk.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(_engine_main(sys.argv[1]))
