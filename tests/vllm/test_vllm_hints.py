"""Per-request hints through a real vLLM engine: a request's ``kv_transfer_params``
(``{"kvstore_session": ..., "kvstore_priority": ...}``, what the OpenAI server passes from the
request body, here ``SamplingParams.extra_args``) reach the store as its saves' put hint; a bad
value is logged and ignored, and the request still runs and saves (docs/vllm.md "Per-request
hints").

The engine runs in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with a memory-only
embedded store under ``eviction: lru``, so the script reads the warm tier's eviction order from
the connector's store after the requests: a priority -1 put starts on probation, at the victim
end, ahead of every block put before it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.vllm_helpers import engine_env, make_llama

pytestmark = pytest.mark.timeout(600)

_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt
from support.vllm_helpers import prompt
from kvstore.integrations.vllm import kvstore_transfer, store_registry

model, out = sys.argv[1], sys.argv[2]
llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
          enable_prefix_caching=True, block_size=32, seed=0,
          kv_transfer_config=KVTransferConfig(**kvstore_transfer(
              {"cpu_capacity": "64MiB", "eviction": "lru"})))
reqs = [("plain", None), ("background", {"kvstore_priority": -1}),
        ("chat", {"kvstore_session": "conversation-42", "kvstore_priority": 0}),
        ("bad", {"kvstore_priority": "high", "kvstore_session": "x"})]
got = {}
for i, (name, params) in enumerate(reqs):
    ids = prompt(4 * 32 + 1, seed=100 + i)  # 4 full blocks, saved once computed
    sp = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    o = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    got[name] = {"ids": ids, "tokens": list(o.outputs[0].token_ids)}
stores = [entry[0] for entry in store_registry._shared.values()]
assert len(stores) == 1, stores
store = stores[0]
store.flush()
order = [bytes(k) for k in store.state.warm.lru_order()]
for name in got:
    keys = [bytes(k) for k in store.block_keys(got[name]["ids"])]
    got[name]["pos"] = [order.index(k) if k in order else None for k in keys]
json.dump(got, open(out, "w"))
"""


def test_kv_transfer_params_hint_reaches_the_store_and_a_bad_one_is_ignored(tmp_path):
    model = make_llama(tmp_path / "llama")
    out = tmp_path / "out.json"
    from pathlib import Path

    tests_dir = str(Path(__file__).resolve().parent.parent)  # for support.vllm_helpers
    env = engine_env(False, {"PYTHONPATH": tests_dir, "VLLM_LOGGING_LEVEL": "WARNING"})
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, model, str(out)], env=env,
                          capture_output=True, text=True, timeout=540, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    got = json.loads(out.read_text())
    for name, r in got.items():
        assert len(r["tokens"]) == 2, name  # every request ran, the bad-hint one too
        assert None not in r["pos"], (name, r["pos"])  # and its 4 prompt blocks were saved
    # lru order, best victim first: the priority -1 put started on probation, ahead of the
    # blocks put before it; the others (no hint, a session, a bad hint ignored) in put order
    back, plain, chat, bad = (got[k]["pos"] for k in ("background", "plain", "chat", "bad"))
    assert max(back) < min(plain), (back, plain)
    assert max(plain) < min(chat) and max(chat) < min(bad), (plain, chat, bad)
    # the bad value was logged, naming what was wrong, and ignored
    assert "ignoring its kv_transfer_params hint" in log, log[-4000:]
    assert "PutHint.priority must be an int" in log
