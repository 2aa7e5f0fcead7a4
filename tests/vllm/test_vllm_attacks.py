"""Attack round 9: the vLLM connector under the failures deployments meet. A load gives what
vLLM would compute, failures are misses or recomputes (never a crash or hang), a bad config is
a ConfigError at start. Most attacks drive the connector's halves directly; the last run a real
engine in a fresh process (this file is its driver: ``python THIS SPEC.json OUT.json``)."""

from __future__ import annotations

import contextlib
import gc
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.distributed")  # the vLLM CI stage only
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support, as a script too
import torch
from support.vllm_helpers import engine_env, make_llama, prompt

from kvstore import KVLayout
from kvstore.daemon.process import DaemonProcess
from kvstore.errors import ConfigError
from kvstore.integrations.vllm import kvstore_transfer, read_stats
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.metadata import BlockRun, KVStoreConnectorMetadata
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.stats import ConnectorStats
from kvstore.integrations.vllm.store_registry import (
    close_all,
    open_connector_store,
    release_store,
)
from kvstore.integrations.vllm.worker import WorkerSide

BS = 16
H, D2, NPAGES = 2, 8, 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]

pytestmark = pytest.mark.timeout(600)


# -- the connector's halves, driven directly ---------------------------------------------------
def _layout(dtype="bfloat16", block_tokens=BS):
    return KVLayout(num_layers=2, num_kv_heads=H, head_dim=D2, dtype=dtype,
                    block_tokens=block_tokens, kv_planes=1)


def _stats(role):
    return ConnectorStats(role, "embedded", None)


def _open(extra, *, is_scheduler=False, tp_rank=0, tp_size=1, layout=None, revision="r"):
    cfg = ConnectorConfig.from_extra({"prefault": 0, **extra} if "socket" not in extra else extra)
    return open_connector_store(cfg, layout=layout or _layout(), model_id="m",
                                model_revision=revision, ns_extras={"engine": "vllm"},
                                page_kind="cpu", is_scheduler=is_scheduler, tp_rank=tp_rank,
                                tp_size=tp_size)


def _disk(path):
    return _open({"store_path": str(path), "cpu_capacity": "4MiB", "disk_capacity": "64MiB"})


def _pages(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NPAGES, H, BS, D2, generator=g).to(torch.bfloat16) for _ in LAYERS]


def _worker(store, pages):
    ns = bytes(store.namespace_id)
    w = WorkerSide(store, layout=_layout(), namespace_id=ns, plan_namespace_id=ns,
                   page_kind="cpu", layerwise=False, max_model_len=1024, stats=_stats("worker"))
    w.register_kv_caches(dict(zip(LAYERS, pages, strict=True)))
    return w


def _sched(store, **kw):
    return SchedulerSide(store, block_size=BS, namespace_id=bytes(store.namespace_id),
                         stats=_stats("scheduler"), **kw)


def _request(req_id, tokens, salt=None):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens),
                           all_token_ids=list(tokens), cache_salt=salt, lora_request=None,
                           mm_features=None, prompt_embeds=None)


def _blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _step(new=(), cached=(), idle=False):
    """A SchedulerOutput: ``new``/``cached`` = [(req, (new) pages, computed, scheduled)]."""
    news = [SimpleNamespace(req_id=r.request_id, block_ids=(list(p),), num_computed_tokens=c)
            for r, p, c, _ in new]
    cr = SimpleNamespace(req_ids=[r.request_id for r, *_ in cached], resumed_req_ids=set(),
                         new_block_ids=[(list(p),) if p else None for _, p, _, _ in cached],
                         num_computed_tokens=[c for _, _, c, _ in cached])
    sched = {r.request_id: n for r, _, _, n in (*new, *cached)}
    return SimpleNamespace(scheduled_new_reqs=news, scheduled_cached_reqs=cr,
                           num_scheduled_tokens=sched, new_block_ids_to_zero=None,
                           total_num_scheduled_tokens=0 if idle else sum(sched.values()) or 1)


def _tokens(n, seed):
    r = random.Random(seed)
    return [r.randrange(1, 2000) for _ in range(n)]


def _saves(store, keys, pages):
    return KVStoreConnectorMetadata(namespace_id=bytes(store.namespace_id),
                                    saves=[BlockRun("save", list(keys), None, list(pages))])


def _claim(side, req, pages, *, sync):
    """A 4-block hit claimed, ``pages`` allocated, planned: before the step (``sync``: the
    request scheduled with 3 tokens) or in the background (an idle step)."""
    assert side.get_num_new_matched_tokens(req, 0) == (4 * BS, not sync)
    side.update_state_after_alloc(req, _blocks(pages), 4 * BS)
    return side.build_connector_meta(_step(new=[(req, pages, 4 * BS, 3)]) if sync else
                                     _step(idle=True))


def _seed_store(store, tokens, src, pages):
    """Save ``tokens``' full blocks from ``src`` pages ``pages`` and put them on disk only."""
    keys = list(store.block_keys(tokens))[:len(pages)]
    w = _worker(store, src)
    w.wait_for_save(_saves(store, keys, pages))
    w.finish_puts(wait=True)
    store.flush()
    store.evict(tier="warm")
    return keys


def _segment_blocks(store_path):
    """Every block in the store's segment files, in file and offset order: (file, key hex,
    payload offset in the file, bytes, parent key hex)."""
    out = []
    for f in sorted(Path(store_path, "segments").glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        meta = header.pop("__metadata__")
        for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            a, b = t["data_offsets"]
            out.append((f, name, 8 + n + a, b - a, meta[name].split(";")[-1]))
    return out


def _corrupt_block(store_path, *, key=None, index=None):
    """XOR every payload byte of one block in place (its segment file keeps its inode, so an
    open store reads the damage): bit rot of one block, the blocks around it intact."""
    blocks = _segment_blocks(store_path)
    f, _, at, size, _ = next(b for b in blocks if b[1] == key.hex()) if key else blocks[index]
    with open(f, "r+b") as fh:
        fh.seek(at)
        data = bytes(x ^ 0x5A for x in fh.read(size))
        fh.seek(at)
        fh.write(data)


@contextlib.contextmanager
def _seeded(path):
    """An embedded store at ``path`` holding the 4 blocks of a prompt (pages 3, 7, 1, 9 of a
    seeded cache): (store, that prompt's tokens, its keys, a scheduler side on the store)."""
    store, key = _disk(path)
    try:
        base = _tokens(4 * BS, 1)
        keys = _seed_store(store, base, _pages(1), [3, 7, 1, 9])
        yield store, base, keys, _sched(store)
    finally:
        release_store(key)


def test_failed_load_never_saves_blocks_that_attended_over_it(tmp_path):
    """A and B share a prefix in one step: A's load (idle: before the forward) fills pages
    0-3, B hits them in vLLM's own cache and computes its next block over them. Block 2 is
    damaged on disk: pages 2-3 fail, vLLM rewinds both. B's new block attended over the failed
    pages: it must not be saved (its parent is still indexed, so it would be served later as
    wrong KV), and both save their blocks again once recomputed."""
    path = tmp_path / "store"
    with _seeded(path) as (store, base, keys, side):
        a = _request("A", base + _tokens(BS + 3, 2))
        b = _request("B", base + _tokens(BS + 3, 3))
        assert side.get_num_new_matched_tokens(a, 0) == (4 * BS, False)  # idle: sync
        side.update_state_after_alloc(a, _blocks([0, 1, 2, 3, 4, 5]), 4 * BS)
        assert side.get_num_new_matched_tokens(b, 4 * BS) == (0, False)  # vLLM's own hit
        side.update_state_after_alloc(b, _blocks([0, 1, 2, 3, 6, 7]), 0)
        meta = side.build_connector_meta(_step(new=[
            (a, [0, 1, 2, 3, 4, 5], 4 * BS, BS + 3), (b, [0, 1, 2, 3, 6, 7], 4 * BS, BS + 3)]))
        assert [r.block_ids for r in meta.loads] == [[0, 1, 2, 3]]
        assert sorted(r.block_ids[-1] for r in meta.saves) == [4, 6]
        _corrupt_block(path, key=keys[2])
        w = _worker(store, _pages(5))
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        w.finish_puts(wait=True)
        bad = w.get_block_ids_with_load_errors()
        assert bad == {2, 3}
        b_keys = list(store.block_keys(b.prompt_token_ids))
        assert store.lookup(b_keys[4:5]) == 0, "B's block computed over failed pages was saved"
        assert w.stats.counters["skipped_saves"] == 2
        # vLLM rewinds both (B to its own hit, A recomputes the shared pages); both plan
        # their saves again from the first failed block
        side.update_connector_output(SimpleNamespace(invalid_block_ids=bad))
        meta = side.build_connector_meta(_step(cached=[
            (a, [], 2 * BS, 3 * BS + 3), (b, [], 4 * BS, BS + 3)]))
        saved = {r.req_id: (r.keys[0], len(r.keys)) for r in meta.saves}
        assert saved == {"A": (keys[2], 3), "B": (b_keys[2], 3)}


def _until(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not (got := pred()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("abort", [True, False])
def test_pages_a_failed_load_left_are_never_saved_until_rewritten(tmp_path, abort):
    """A's load fails (block 2 rotted): vLLM keeps the failed pages in its own cache for A to
    recompute. D (A's prompt) hits them there before A has (A aborted, or recomputing them in
    chunks): nothing D computes over them is ever saved, not even once A rewrote the pages,
    while A's recomputed blocks are."""
    path = tmp_path / "store"
    with _seeded(path) as (store, base, keys, side):
        a, d = (_request(n, base + _tokens(BS + 3, 2)) for n in "AD")
        meta = _claim(side, a, [0, 1, 2, 3, 4, 5], sync=True)
        _corrupt_block(path, key=keys[2])
        w = _worker(store, _pages(5))
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        side.update_connector_output(SimpleNamespace(invalid_block_ids=(
            bad := w.get_block_ids_with_load_errors())))
        assert bad == {2, 3}
        if abort:
            side.request_finished(a, [])
        assert side.get_num_new_matched_tokens(d, 4 * BS) == (0, False)  # vLLM's own "hit"
        side.update_state_after_alloc(d, _blocks([0, 1, 2, 3, 8, 9]), 0)
        meta = side.build_connector_meta(_step(  # D computes 3 tokens; A its block 2 only
            new=[(d, [0, 1, 2, 3, 8, 9], 4 * BS, 3)], cached=[] if abort else [(a, [], 2 * BS, BS)]))
        assert [(r.req_id, r.keys[0]) for r in meta.saves] == ([] if abort else [("A", keys[2])])
        meta = side.build_connector_meta(_step(cached=[(d, [], 4 * BS + 3, BS)] + (
            [] if abort else [(a, [], 3 * BS, 2 * BS + 3)])))  # D fills its block 4
        assert [(r.req_id, r.keys[0]) for r in meta.saves] == ([] if abort else [("A", keys[3])])


def _busy(side):
    """Another request in the engine: hits below memory then load in the background."""
    side.get_num_new_matched_tokens(_request("busy", [1, 2, 3]), 0)


def test_background_load_aborted_in_flight_or_short_then_retried(tmp_path):
    """A background load in flight (its loader thread held back) when its request is aborted:
    never reported before its reads into the pages are done (vLLM frees them on that report),
    and reported once. A background load that comes back short (blocks evicted since the
    lookup): reported with its missing pages; the retry never claims them again (a loop of
    failing loads) but saves them once recomputed."""
    store, key = _disk(tmp_path / "store")
    try:
        src, t1 = _pages(1), _tokens(4 * BS + 3, 1)
        keys = _seed_store(store, t1, src, [3, 7, 1, 9])
        side = _sched(store)
        _busy(side)
        meta = _claim(side, r1 := _request("r1", t1), [0, 2, 4, 5, 6], sync=False)
        dst = [torch.zeros_like(p) for p in src]
        w = _worker(store, dst)
        gate, entered, lease = threading.Event(), threading.Event(), w._lease

        def held_back(run, *into):
            entered.set()
            assert gate.wait(30)
            return lease(run, *into)

        w._lease = held_back
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        assert entered.wait(30)
        side.request_finished(r1, [])  # aborted: vLLM keeps the pages until reported
        t0 = time.monotonic()
        for _ in range(5):
            assert not w.get_finished(meta), "reported while its reads were in flight"
        assert time.monotonic() - t0 < 1.0, "get_finished waited on a held-back load"
        gate.set()
        assert _until(lambda: w.get_finished(meta)) == {"r1"} and not w.get_finished(meta)
        assert w.get_block_ids_with_load_errors() == set()
        for layer in range(len(LAYERS)):  # its reads were done before the report
            assert torch.equal(dst[layer][[0, 2, 4, 5]], src[layer][[3, 7, 1, 9]])
        w._lease = lease
        meta = _claim(side, r2 := _request("r2", t1), [0, 2, 4, 5, 6], sync=False)
        store.evict(keys[2:])
        w.start_load_kv(meta)
        assert _until(lambda: w.get_finished(meta)) == {"r2"}
        side.update_connector_output(SimpleNamespace(
            invalid_block_ids=(bad := w.get_block_ids_with_load_errors())))
        assert bad == {4, 5}
        _seed_store(store, t1, src, [3, 7, 1, 9])  # back in the index: still not claimed
        assert side.get_num_new_matched_tokens(r2, 0)[0] == 2 * BS
        meta = side.build_connector_meta(_step(new=[(r2, [0, 2, 4, 5, 6], 2 * BS, 2 * BS + 3)]))
        assert [(r.keys[0], len(r.keys)) for r in meta.saves] == [(keys[2], 2)]
        w.close()
    finally:
        release_store(key)


# -- kv_connector_extra_config ---------------------------------------------------------------
# each case is wrong in its last key (the error names it); the last five: a key of the other
# mode, which would do nothing there (an error, as an unknown key is)
@pytest.mark.parametrize("extra", [
    {"store_path": 123}, {"store_path": ""}, {"socket": 5}, {"socket": ""},
    {"socket": "/s", "timeout": "abc"}, {"socket": "/s", "timeout": -1},
    {"socket": "/s", "timeout": True}, {"store_path": "/x", "cpu_capacity": -5},
    {"store_path": "/x", "disk_capacity": "lots"}, {"store_path": "/x", "prefault": "x"},
    {"store_path": "/x", "gpu_capacity": [1]}, {"socket": "/s", "warm_capacity": -1},
    {"store_path": "/x", "stats_path": 5}, {"store_path": "/x", "model_id": 5},
    {"store_path": "/x", "model_revision": ["r"]}, {"store_path": "/x", "eviction": 3},
    {"store_path": "/x", "load_timeout": 0}, {"socket": "/s", "load_timeout": "30s"},
    {"socket": "/s", "cpu_capacity": "16GiB"}, {"socket": "/s", "disk_capacity": "1TiB"},
    {"store_path": "/x", "timeout": 3}, {"store_path": "/x", "warm_capacity": "1GiB"},
    {"cpu_capacity": "1GiB", "salt_policy": "per-uid"},
])
def test_malformed_extra_config_is_a_config_error_naming_the_key(extra):
    with pytest.raises(ConfigError, match=list(extra)[-1]):
        ConnectorConfig.from_extra(extra)


def test_unusable_stats_or_store_path_is_a_config_error_at_start(tmp_path):
    """A stats directory that cannot be made (a file in the way) is refused when the connector
    is made, not silently never written; a store path under a file too."""
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "stats"):
        with pytest.raises(ConfigError, match="stats_path"):
            ConnectorStats("worker", "embedded", str(bad))
    ConnectorStats("worker", "embedded", str(tmp_path / "new" / "stats")).write(force=True)
    assert list((tmp_path / "new" / "stats").glob("worker-*.json"))
    with pytest.raises(ConfigError, match="not a directory"):
        _open({"store_path": str(tmp_path / "file" / "store")})


def test_a_model_given_as_one_file_is_fingerprinted(tmp_path):
    """A model given as one weights file (a GGUF path): another file at that path (another
    quantization, a fine-tune) is another namespace, as for a checkpoint directory."""
    from kvstore.integrations.vllm.config import model_identity

    f = tmp_path / "model.gguf"
    mc = SimpleNamespace(model=str(f), revision=None, hf_config=SimpleNamespace())
    ids = []
    for n in (4096, 4097):  # the sizes differ: the in-process memo keys on name, size, mtime
        f.write_bytes(b"GGUF" + random.Random(n).randbytes(n))
        ids.append(model_identity(SimpleNamespace(model_config=mc), ConnectorConfig()))
    assert ids[0][1] and ids[0] != ids[1], ids


def test_namespaces_never_cross(tmp_path):
    """One store directory, blocks saved by one engine configuration: a lookup from another
    cache_salt, dtype, block size, model revision or TP size finds nothing, and a TP-2 rank's
    blocks are never served to a TP-1 engine."""
    path = tmp_path / "store"
    tokens = _tokens(4 * BS + 3, 1)
    store, key = _open({"store_path": str(path)})
    _seed_store(store, tokens, _pages(1), [3, 7, 1, 9])
    side = _sched(store)
    assert side.get_num_new_matched_tokens(_request("same", tokens), 0)[0] == 4 * BS
    assert side.get_num_new_matched_tokens(_request("salt", tokens, salt="b"), 0) == (0, False)
    release_store(key)
    only_tp2 = _tokens(4 * BS + 3, 2)  # saved by rank 1 of a TP-2 engine only
    rank1, k1 = _open({"store_path": str(path)}, tp_rank=1, tp_size=2)
    _seed_store(rank1, only_tp2, _pages(2), [3, 7, 1, 9])
    release_store(k1)
    for kw in [{}, dict(layout=_layout(dtype="float16")), dict(revision="r2"), dict(tp_size=2),
               dict(layout=_layout(block_tokens=2 * BS)), dict(tp_size=4)]:
        s, k = _open({"store_path": str(path)}, is_scheduler=True, **kw)
        try:  # the same TP-1 config hits its own blocks, never the TP-2 rank's
            n = len(tokens) // s.layout.block_tokens
            assert s.lookup(list(s.block_keys(tokens))[:n]) == (0 if kw else 4), kw
            assert s.lookup(list(s.block_keys(only_tp2))[:n]) == 0, kw
        finally:
            release_store(k)


# -- daemon mode: the daemon dies, hangs, comes back -------------------------------------------
def test_daemon_killed_or_stopped_mid_run_is_misses_then_exact_hits_again(tmp_path):
    """Daemon mode, the daemon killed -9 between the scheduler's lookup and the worker's load:
    the load fails (reported, recomputed), saves are dropped, lookups miss, every call quick;
    a stopped (SIGSTOP) daemon costs at most the client's timeout. Restarted, the connector
    hits again with exactly the bytes saved."""
    sock = Path(tempfile.mkdtemp(prefix="kvs-r9-")) / "kv.sock"  # short, private (0700)
    args = ("--cpu-capacity", "32MiB", "--disk-capacity", "256MiB", "--log-level", "warning")
    daemon = DaemonProcess(tmp_path / "dstore", sock, *args).start()
    store, key = _open({"socket": str(sock), "timeout": 2.0})
    try:
        src = _pages(1)
        w = _worker(store, src)
        side = _sched(store)
        t1, t2 = _tokens(4 * BS + 3, 1), _tokens(4 * BS + 3, 2)
        keys1 = list(store.block_keys(t1))
        save = _saves(store, keys1, [3, 7, 1, 9])
        w.wait_for_save(save)
        w.finish_puts(wait=True)
        r1 = _request("r1", t1)
        meta = _claim(side, r1, [0, 2, 4, 5, 6], sync=True)
        daemon.kill()
        dst = [torch.zeros_like(p) for p in src]
        w2 = _worker(store, dst)
        t0 = time.monotonic()
        w2.start_load_kv(meta)
        w2.wait_for_save(meta)
        assert w2.get_block_ids_with_load_errors() == {0, 2, 4, 5}
        side.request_finished(r1, [])
        assert side.get_num_new_matched_tokens(_request("r2", t2), 0) == (0, False)
        w.wait_for_save(save)
        w.finish_puts(wait=True)
        assert time.monotonic() - t0 < 5.0
        daemon = DaemonProcess(tmp_path / "dstore", sock, *args).start()
        daemon.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        side.get_num_new_matched_tokens(_request("r3", t2), 0)
        assert time.monotonic() - t0 < 6.0, "a stopped daemon held up a lookup past its timeout"
        daemon.signal(signal.SIGCONT)
        # back: saves land and loads give exactly the bytes saved
        save2 = _saves(store, keys2 := list(store.block_keys(t2)), [10, 11, 12, 13])

        def saved():
            w.wait_for_save(save2)
            w.finish_puts(wait=True)
            return store.lookup(keys2) == 4

        assert _until(saved), "the client never came back to the restarted daemon"
        meta = _claim(side, _request("r4", t2), [1, 3, 8, 14, 15], sync=True)
        w2.start_load_kv(meta)
        w2.wait_for_save(meta)
        assert w2.get_block_ids_with_load_errors() == set()
        for layer in range(len(LAYERS)):
            assert torch.equal(dst[layer][[1, 3, 8, 14]], src[layer][[10, 11, 12, 13]])
        w.close(), w2.close()
    finally:
        release_store(key)
        daemon.signal(signal.SIGCONT)
        daemon.stop()


# -- a real engine ------------------------------------------------------------------------------
EBS = 32  # vLLM's block size in the engine tests
FP32_ATOL = 1e-3  # float32: an external hit and a prefill differ only in summation order


def run_steps(spec):
    """One ``vllm.LLM``; each step's prompts go in one ``generate`` (they share steps)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = dict(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
              skip_tokenizer_init=True, enable_prefix_caching=True, block_size=EBS,
              disable_log_stats=False, seed=0, **spec.get("llm_kwargs", {}))
    if spec.get("transfer"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["transfer"])
    llm = LLM(**kw)

    def counters(engine=llm):
        return {m.name: m.value for m in engine.get_metrics() if type(m).__name__ == "Counter"}

    res, before = [], counters()
    for step in spec["steps"]:
        if step.get("reset"):
            llm.reset_prefix_cache()
        sp = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, logprobs=1,
                            detokenize=False, ignore_eos=True)
        salts = step.get("salts") or [None] * len(step["prompts"])
        prompts = [TokensPrompt(prompt_token_ids=list(ids), **({"cache_salt": s} if s else {}))
                   for ids, s in zip(step["prompts"], salts, strict=True)]
        outs, eng = [], llm.llm_engine
        if step.get("abort"):  # one engine step, then the requests are aborted
            for i, p in enumerate(prompts):
                eng.add_request(f"abort-{i}", p, sp)
            eng.step()
            eng.abort_request([f"abort-{i}" for i in range(len(prompts))])
        for o in [] if step.get("abort") else llm.generate(prompts, sp, use_tqdm=False):
            c = o.outputs[0]
            outs.append({"tokens": list(c.token_ids), "logprobs": [
                float(d[t].logprob) for d, t in zip(c.logprobs, c.token_ids, strict=True)]})
        after = counters()
        res.append({"label": step["label"], "outputs": outs,
                    "metrics": {k: v - before.get(k, 0) for k, v in after.items()}})
        before = after
    del llm, counters
    gc.collect()
    close_all()
    return {"steps": res}


def _engine(spec, tmp_path, name, env=None):  # run_steps in a fresh process
    spec_path, out = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, str(spec_path), str(out)],
                          env=engine_env(False, env), capture_output=True, text=True,
                          timeout=500, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.exists(), log[-6000:]
    res = json.loads(out.read_text())
    return {s["label"]: s for s in res["steps"]} | {"log": log}


def _same(got, want):
    assert got["tokens"] == want["tokens"]
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff <= FP32_ATOL, diff


def _prompts():
    return {"P": prompt(300, seed=1), **{f"P{i}": prompt(300, seed=10 + i) for i in (1, 2, 3)}}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """A float32 model, and a store one engine saved P, P1, P2, P3 in (9 blocks each)."""
    d = tmp_path_factory.mktemp("seeded")
    model = make_llama(d / "llama-fp32", dtype="float32")
    spec = {"model": model, "dtype": "float32", "transfer": _transfer(d / "store", d / "stats"),
            "steps": [{"label": "P", "prompts": [_prompts()["P"]]},
                      {"label": "rest", "prompts": list(_prompts().values())[1:]}]}
    _engine(spec, d, "seed")
    return model, d / "store"


def _transfer(store, stats):
    return kvstore_transfer({"store_path": str(store), "cpu_capacity": "64MiB",
                             "disk_capacity": "1GiB", "stats_path": str(stats)})


def test_engine_failed_load_shared_in_its_step_stores_no_wrong_kv(seeded, tmp_path):
    """A real engine: the 5th of P's 9 stored blocks rots on disk. A (= P) and B (P's 9
    blocks + 40 tokens) arrive together: A's load fails from block 4, and B computed its 10th
    block over A's pages in that same step (vLLM's own cache). vLLM recomputes both; what the
    store then serves for B's 10th block must be right: C (B + 40 tokens) loaded from the store
    gives what C computed from scratch (a salt nobody else uses) gives. Then P1's 5th block
    rots too, and its request is aborted in the step its load failed: vLLM keeps the failed
    pages in its own cache, and D (= P1) computes over them; none of that may reach the store:
    P1 loaded from the store afterwards gives what P1 from scratch gives."""
    model, P, P1 = seeded[0], _prompts()["P"], _prompts()["P1"]
    B = P[:288] + prompt(40, seed=7)
    C = B + prompt(40, seed=8)
    store = tmp_path / "store"
    shutil.copytree(seeded[1], store)
    chain = _segment_blocks(store)[:5]  # P's blocks first (saved a step before the others)
    assert all(chain[i][4] == chain[i - 1][1] for i in range(1, 5)) and not chain[0][4]
    _corrupt_block(store, index=4)
    _corrupt_block(store, index=9 + 4)  # P1's (saved first in the next step)
    ref = {"salts": ["nobody-else"], "reset": True}
    spec = {"model": model, "dtype": "float32", "transfer": _transfer(store, tmp_path / "s"),
            "steps": [{"label": "ab", "prompts": [P, B]},
                      {"label": "c", "prompts": [C], "reset": True},
                      {"label": "ref", "prompts": [C], **ref},
                      {"label": "aborted", "prompts": [P1], "abort": True},
                      {"label": "d", "prompts": [P1]}, {"label": "p1", "prompts": [P1], "reset": True},
                      {"label": "ref1", "prompts": [P1], **ref}]}
    res = _engine(spec, tmp_path, "attack")
    assert "Recovered from KV load failure" in res["log"]
    assert read_stats(tmp_path / "s")["worker"]["failed_blocks"] == 10
    assert res["c"]["metrics"]["vllm:external_prefix_cache_hits"] == 320
    _same(res["c"]["outputs"][0], res["ref"]["outputs"][0])
    assert res["p1"]["metrics"]["vllm:external_prefix_cache_hits"] >= 128
    _same(res["p1"]["outputs"][0], res["ref1"]["outputs"][0])


def test_engine_preempted_loaded_requests_and_twin_prompts_stay_exact(seeded, tmp_path):
    """A real engine with room for 30 pages: three prompts that hit the store (9 blocks each,
    loaded), one of them twice in the same step, each decoding 96 tokens: vLLM preempts some
    (their loaded pages freed), resumes them (looked up and loaded again). Every output equals
    the same prompts computed from scratch (a salt nobody else uses) in that engine."""

    model, ps = seeded[0], _prompts()
    store = tmp_path / "store"
    shutil.copytree(seeded[1], store)
    ds = [ps[f"P{i}"] + prompt(20, seed=20 + i) for i in (1, 2, 3)]
    ds.append(ds[0])
    step = {"prompts": ds, "max_tokens": 96}
    spec = {"model": model, "dtype": "float32", "transfer": _transfer(store, tmp_path / "s"),
            "llm_kwargs": {"num_gpu_blocks_override": 30, "max_model_len": 512},
            "steps": [dict(step, label="hit"),
                      dict(step, label="ref", salts=["nobody-else"] * 4, reset=True)]}
    res = _engine(spec, tmp_path, "preempt")
    hit = res["hit"]["metrics"]
    assert hit.get("vllm:num_preemptions", 0) > 0, hit
    assert hit["vllm:external_prefix_cache_hits"] >= 3 * 288, hit
    assert read_stats(tmp_path / "s")["worker"]["failed_blocks"] == 0
    for got, want in zip(res["hit"]["outputs"], res["ref"]["outputs"], strict=True):
        _same(got, want)


if __name__ == "__main__":
    _spec, _out = sys.argv[1:3]
    Path(_out).write_text(json.dumps(run_steps(json.loads(Path(_spec).read_text()))))
