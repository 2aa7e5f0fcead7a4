"""Helpers for testing and benchmarking the vLLM connector against a real vLLM engine.

- :func:`make_llama`: a Llama checkpoint with seeded random weights (no download).
- :func:`run_engine`: one ``vllm.LLM`` in *this* process running a list of steps (prompts
  as token ids), returning tokens, logprobs, wall times and vLLM's counters per step.
- :func:`run_engine_subprocess`: the same in a fresh Python process (a fresh engine each
  time), which is how tests/vllm and ``tools/vllm_bench.py`` use it; that process runs this
  file as a script::

      python tests/support/vllm_helpers.py SPEC.json OUT.json

The connector's own helpers live in the package: ``kvstore_transfer`` (``KVTransferConfig``
arguments) and ``read_stats`` (the counters under ``stats_path``), both in
:mod:`kvstore.integrations.vllm`.

Importing this module does not import vLLM; :func:`run_engine` does.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: this file, which run_engine_subprocess runs as a script
_SCRIPT = Path(__file__).resolve()


# -- models ------------------------------------------------------------------------------------
def make_llama(
    path: str | os.PathLike[str], *, hidden: int = 256, layers: int = 2, heads: int = 4,
    kv_heads: int = 2, head_dim: int = 64, intermediate: int | None = None, vocab: int = 2048,
    max_positions: int = 8192, dtype: str = "bfloat16", seed: int = 0,
) -> str:
    """Save a Llama with seeded random weights to ``path`` (``save_pretrained``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_positions, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # wider init than the default (0.02): logits spread, so greedy choices have clear margins
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(str(path))
    return str(path)


def prompt(n: int, seed: int, vocab: int = 2048) -> list[int]:
    """``n`` deterministic pseudo-random token ids in ``[1, vocab)``."""
    import random

    r = random.Random(seed)
    return [r.randrange(1, vocab) for _ in range(n)]


def example_transfer(storage: str) -> dict[str, Any]:
    """``KVTransferConfig`` arguments for vLLM's built-in ``ExampleConnector``."""
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage}}


# -- store damage (for the failure tests) ----------------------------------------------------------
def segment_files(store_path: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(store_path, "segments").glob("*.safetensors"))


def corrupt_segments(store_path: str | os.PathLike[str], *, every: int = 4096) -> int:
    """Flip one byte every ``every`` bytes of each segment's payload (the header is kept, so
    the files still parse: only checksums catch it). Returns the files touched."""
    files = segment_files(store_path)
    for f in files:
        data = bytearray(f.read_bytes())
        header = 8 + int.from_bytes(data[:8], "little")
        for i in range(header + 17, len(data), every):
            data[i] ^= 0x5A
        f.write_bytes(bytes(data))
    return len(files)


def drop_page_cache(paths: Sequence[str | os.PathLike[str]]) -> int:
    """``posix_fadvise(DONTNEED)`` every file under ``paths`` (no root needed)."""
    n = 0
    for root in paths:
        for dirpath, _, files in os.walk(root):
            for name in files:
                p = os.path.join(dirpath, name)
                try:
                    fd = os.open(p, os.O_RDONLY)
                except OSError:
                    continue
                with contextlib.suppress(OSError):
                    os.fsync(fd)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    n += 1
                finally:
                    os.close(fd)
    return n


# -- one engine, in this process -------------------------------------------------------------------
def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # metrics are optional (disable_log_stats)
        return out
    for m in metrics:
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)) and type(m).__name__ == "Counter":
            out[m.name] = out.get(m.name, 0) + v
    return out


def run_engine(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Start one ``vllm.LLM`` from ``spec`` and run its steps (see module docstring).

    ``spec``: ``model``, ``dtype``, ``block_size``, optional ``transfer`` (KVTransferConfig
    kwargs), ``max_num_batched_tokens``, ``max_model_len``, ``llm_kwargs``, and ``steps``:
    each ``{"label", "prompts": [[ids]], "max_tokens", "logprobs", "salts",
    "drop_page_cache": [paths], "reset_prefix_cache": bool, "sleep": s}``.
    """
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = dict(
        model=spec["model"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=True,
        skip_tokenizer_init=True, enable_prefix_caching=spec.get("enable_prefix_caching", True),
        block_size=spec.get("block_size", 32), disable_log_stats=False,
        seed=spec.get("seed", 0),
    )
    for name in ("max_num_batched_tokens", "max_model_len", "max_num_seqs"):
        if spec.get(name):
            kw[name] = spec[name]
    kw.update(spec.get("llm_kwargs", {}))
    if spec.get("transfer"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["transfer"])
    t0 = time.perf_counter()
    llm = LLM(**kw)
    result: dict[str, Any] = {"start_s": time.perf_counter() - t0, "steps": [], "pid": os.getpid()}
    before = _counters(llm)
    for step in spec.get("steps", []):
        if step.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        if step.get("drop_page_cache"):
            drop_page_cache(step["drop_page_cache"])
        if step.get("sleep"):
            time.sleep(step["sleep"])
        sp = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0,
                            logprobs=step.get("logprobs"), detokenize=False, ignore_eos=True)
        salts = step.get("salts") or [None] * len(step["prompts"])
        outs, secs = [], []
        for ids, salt in zip(step["prompts"], salts, strict=True):
            p = TokensPrompt(prompt_token_ids=list(ids))
            if salt is not None:
                p["cache_salt"] = salt
            t = time.perf_counter()
            o = llm.generate([p], sp, use_tqdm=False)[0]
            secs.append(time.perf_counter() - t)
            c = o.outputs[0]
            lps = None
            if c.logprobs is not None:
                lps = [float(d[tok].logprob) for d, tok in zip(c.logprobs, c.token_ids, strict=True)]
            outs.append({"tokens": list(c.token_ids), "logprobs": lps,
                         "num_cached_tokens": getattr(o, "num_cached_tokens", None)})
        after = _counters(llm)
        delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        before = after
        result["steps"].append({"label": step.get("label", ""), "outputs": outs,
                                "seconds": secs, "metrics": delta})
    result["metrics"] = before
    t = time.perf_counter()
    del llm
    gc.collect()
    from kvstore.integrations.vllm.store_registry import close_all  # flush what is still open

    close_all()
    result["close_s"] = time.perf_counter() - t
    return result


# -- one engine, in a fresh process ----------------------------------------------------------------
def engine_env(multiprocessing: bool = False, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.update(extra or {})
    return env


class EngineRunError(RuntimeError):
    def __init__(self, msg: str, log: str) -> None:
        super().__init__(f"{msg}\n--- engine log (tail) ---\n{log[-6000:]}")
        self.log = log


def run_engine_subprocess(
    spec: Mapping[str, Any], *, multiprocessing: bool = False, timeout: float = 600,
    env: Mapping[str, str] | None = None, python: str | None = None,
) -> dict[str, Any]:
    """:func:`run_engine` in a fresh interpreter; the result also has the engine's ``log``."""
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-") as d:
        spec_path, out_path = Path(d, "spec.json"), Path(d, "out.json")
        spec_path.write_text(json.dumps(spec))
        t = time.perf_counter()
        proc = subprocess.run(
            [python or sys.executable, str(_SCRIPT), str(spec_path), str(out_path)],
            env=engine_env(multiprocessing, env), capture_output=True, text=True,
            timeout=timeout, check=False,
        )
        wall = time.perf_counter() - t
        log = proc.stdout + proc.stderr
        if proc.returncode != 0 or not out_path.exists():
            raise EngineRunError(f"engine process exited with {proc.returncode}", log)
        res = json.loads(out_path.read_text())
    res["log"] = log
    res["wall_s"] = wall
    return res


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(f"usage: python {_SCRIPT.name} SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    res = run_engine(spec)
    Path(args[1]).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
