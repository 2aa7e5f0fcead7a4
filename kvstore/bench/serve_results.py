"""What one client run of the serve section measured: the figures of vLLM's client's
``--save-result`` JSON (:func:`parse_result`), vLLM's Prometheus counters (:func:`parse_metrics`)
and their deltas around the run, the external hit rates from them (:func:`hit_rates`), and the
:class:`RunResult` that holds them (:func:`find` looks one up)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.bench.serve_scale import BLOCK


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
            "completed": f("completed"), "failed": f("failed"), "duration_s": f("duration"),
            "max_ttft_ms": max(ttfts_ms(path), default=float("nan"))}


def ttfts_ms(path: str | os.PathLike[str]) -> list[float]:
    """Each request's TTFT in ms, in the order sent, from a ``--save-detailed`` result (its
    ``ttfts``, seconds; a failed request's is 0 there and left out here)."""
    d = json.loads(Path(path).read_text())
    raw = d.get("ttfts")
    if not isinstance(raw, list):
        return []
    return [round(float(t) * 1e3, 3) for t in raw if isinstance(t, (int, float)) and t > 0]


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
    #: each request's TTFT (ms, in the order sent): the client's per-request detail
    ttfts_ms: list[float] = field(default_factory=list)

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
