"""The copy engine: queue ordering, concurrency, failures and close with work in flight."""

import threading
import time

import pytest
import torch
from conftest import random_kv

from kvstore import KVLayout, StoreClosedError, Transfer, TransferError, open_store
from kvstore.store.copy_engine import CopyEngine, Job

LAY = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_tokens=4)
BN = LAY.block_nbytes


def store(tmp_path=None, hot=8, warm=16, **kw):
    return open_store(tmp_path, layout=LAY, model_id="ce", device="cpu", gpu_capacity=hot * BN,
                      cpu_capacity=warm * BN, **kw)


def test_engine_runs_jobs_in_submission_order_per_path():
    eng = CopyEngine(torch.device("cpu"))
    order = []
    ts = []
    for i in range(20):
        t = Transfer()

        def run(stream, i=i):
            time.sleep(0.001 * (i % 3))
            order.append(i)
            return []

        def finish(ok, err, t=t, i=i):
            t.set_result(i)

        ts.append(eng.submit("h2d", Job(t, run, finish)))
    assert [t.wait(5) for t in ts] == list(range(20))
    assert order == list(range(20))
    eng.close()
    with pytest.raises(StoreClosedError):
        eng.submit("h2d", Job(Transfer(), lambda s: [], lambda ok, e: None))


def test_engine_reports_job_errors_through_the_transfer():
    eng = CopyEngine(torch.device("cpu"))
    t = Transfer()

    def run(stream):
        raise OSError("device fell off the bus")

    def finish(ok, err):
        assert not ok
        t.set_error(err)

    eng.submit("d2h", Job(t, run, finish))
    with pytest.raises(Exception, match="fell off"):
        t.wait(5)
    assert eng.counters()["d2h"] == (1, 0, 1)
    eng.close()


def test_cancel_on_close_fails_queued_jobs_cleanly():
    eng = CopyEngine(torch.device("cpu"))
    gate = threading.Event()
    started = threading.Event()
    first = Transfer()

    def run_first(stream):
        started.set()
        gate.wait(30)
        return []

    eng.submit("h2d", Job(first, run_first, lambda ok, e: first.set_result(ok)))
    assert started.wait(30)  # the first job is running, the next ones stay queued
    queued = [Transfer() for _ in range(5)]
    finished = []
    for t in queued:
        eng.submit("h2d", Job(t, lambda s: [], lambda ok, e, t=t: (finished.append(ok), t.set_error(e) if e else t.set_result(1))))
    closer = threading.Thread(target=eng.close, kwargs={"cancel": True})
    closer.start()
    deadline = time.monotonic() + 5
    while not eng._workers["h2d"]._closing and time.monotonic() < deadline:
        time.sleep(0.001)  # close() has marked the queue before the running job finishes
    gate.set()
    closer.join(30)
    assert first.wait(30) is True
    assert finished == [False] * 5
    for t in queued:
        with pytest.raises(Exception, match="closed"):
            t.wait(30)


def test_fetch_after_put_sees_the_bytes():
    with store() as s:
        for i in range(30):
            keys = s.block_keys([i] * 4 + list(range(8)))
            kv = random_kv(LAY, 3, seed=i)
            s.put(keys, kv)  # no wait: the fetch queued after it must still see its bytes
            got = s.fetch(keys).wait(5)
            assert got.shape[0] == 3 and torch.equal(got, kv)


def test_fetch_layerwise_readiness():
    with store() as s:
        keys = s.block_keys(list(range(12)))
        kv = random_kv(LAY, 3)
        s.put(keys, kv).wait()
        t = s.fetch(keys)
        for layer in range(LAY.num_layers):
            t.wait_layer(layer, timeout=5)
        assert torch.equal(t.wait(), kv)


def test_failed_put_copy_leaves_nothing_visible(monkeypatch):
    with store(hot=0) as s:
        keys = s.block_keys(list(range(12)))
        real = s.state.warm.slab.write

        def broken(slots, src, non_blocking=False):
            real(slots[:1], src[:1])  # part of the bytes land, then the copy fails
            raise RuntimeError("DMA error (injected)")

        monkeypatch.setattr(s.state.warm.slab, "write", broken)
        t = s.put(keys, random_kv(LAY, 3))
        f = s.fetch(keys)  # queued behind the failing put
        assert t.wait(5) == 0
        assert f.wait(5).shape[0] == 0  # a miss, never the partial bytes
        assert s.lookup(keys) == 0
        st = s.stats()
        assert st.put_dropped == 3 and st.pinned_blocks == 0 and st.blocks == 0
        monkeypatch.undo()
        assert s.put(keys, random_kv(LAY, 3)).wait(5) == 3


def test_failing_disk_read_in_the_middle_of_a_batch(tmp_path, monkeypatch):
    from kvstore.tiers.disk import ReadStatus

    with store(tmp_path, hot=0, warm=16) as s:
        keys = s.block_keys(list(range(24)))
        kv = random_kv(LAY, 6)
        s.put(keys, kv).wait()
        s.flush()
        s.evict(tier="warm")
        real = s.state.lower[0].disk.read_many

        calls = []

        def flaky(ks, dsts, **kw):
            out = real(ks, dsts, **kw)
            calls.append(len(ks))
            if len(calls) == 1:  # the fetch's read (the warm copies are read after it)
                out[3] = ReadStatus.DAMAGED
                dsts[3].fill_(0xAB)  # garbage where the bad block would be
            return out

        monkeypatch.setattr(s.state.lower[0].disk, "read_many", flaky)
        got = s.fetch(keys).wait(5)
        assert got.shape[0] == 3 and torch.equal(got, kv[:3])
        s.flush()  # the warm copies of the three are made behind the fetch
        assert calls == [6, 3]
        st = s.stats()
        assert st.damaged == 1 and st.pinned_blocks == 0
        # only the valid leading run entered memory (prefix-closed)
        assert st.tier("warm").blocks == 3


def test_concurrent_fetch_put_evict_from_threads(tmp_path):
    errors = []
    with store(tmp_path, hot=4, warm=6) as s:
        def worker(w):
            try:
                for i in range(40):
                    toks = [w * 100 + i % 7] * 4 + list(range(8))
                    keys = s.block_keys(toks)
                    kv = random_kv(LAY, 3, seed=w * 100 + i % 7)
                    s.put(keys, kv)
                    got = s.fetch(keys).wait(10)
                    assert torch.equal(got, kv[: got.shape[0]])
                    if i % 9 == 0:
                        s.evict(keys[1:], tier="hot")
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        s.flush()
        st = s.stats()
        assert st.pinned_blocks == 0 and st.dirty_blocks == 0


def test_close_with_transfers_in_flight(tmp_path):
    s = store(tmp_path)
    ts = []
    for i in range(50):
        keys = s.block_keys([i] * 4 + list(range(8)))
        ts.append(s.put(keys, random_kv(LAY, 3, seed=i)))
        ts.append(s.fetch(keys))
    s.close()
    for t in ts:
        assert t.done()  # everything queued completed (or failed) before close returned
    with store(tmp_path) as s2:
        keys = s2.block_keys([49] * 4 + list(range(8)))
        assert s2.lookup(keys) == 3


class _FaultingEvent:
    """An event whose query raises, as an asynchronous CUDA error surfaces."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_an_event_that_raises_fails_its_job_and_the_worker_keeps_running():
    eng = CopyEngine(torch.device("cpu"))
    bad = Transfer(num_layers=2)

    def finish(t):
        return lambda ok, err: t.set_error(err) if err else t.set_result(ok)

    eng.submit("h2d", Job(bad, lambda stream: [_FaultingEvent(), _FaultingEvent()], finish(bad)))
    with pytest.raises(TransferError, match="illegal memory access"):
        bad.wait_layer(0, 5)  # the old worker thread died here: this waited for ever
    after = Transfer()
    eng.submit("h2d", Job(after, lambda stream: [], finish(after)))
    assert after.wait(5) is True
    assert eng.drain(5)
    assert eng.counters()["h2d"] == (2, 1, 1)
    eng.close()


class _StuckEvent:
    def query(self) -> bool:
        return False


def test_a_copy_that_never_completes_fails_within_the_bound():
    eng = CopyEngine(torch.device("cpu"), copy_timeout_s=0.2)
    t = Transfer()
    eng.submit("h2d", Job(t, lambda stream: [_StuckEvent()],
                          lambda ok, err: t.set_error(err) if err else t.set_result(ok)))
    with pytest.raises(TransferError, match="did not complete within"):
        t.wait(5)
    assert eng.drain(5)  # the old drain spun for ever: pending never reached 0
    eng.close()


class _DoneAt:
    """An event that completes at a given time (a copy the device finishes then)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at


def _finish(t):
    return lambda ok, err: t.set_error(err) if err else t.set_result(ok)


def test_the_copy_bound_starts_when_the_copy_is_queued_not_while_its_job_waits_for_a_put():
    """A fetch's job waits on its own thread for a put still copying (up to the bound), then
    queues its copy: the copy's bound counts from then, not from the wait's start."""
    eng = CopyEngine(torch.device("cpu"), copy_timeout_s=2.0)
    put, fetch = Transfer(), Transfer()
    t0 = time.monotonic()
    eng.submit("d2h", Job(put, lambda stream: [_DoneAt(t0 + 1.5)], _finish(put)))

    def run(stream):
        put.wait(10)  # FetchPlan.deps: the put's bytes first
        return [_DoneAt(time.monotonic() + 0.8)]

    eng.submit("h2d", Job(fetch, run, _finish(fetch)))
    assert fetch.wait(10) is True  # 0.8 s of copy: well within the 2 s bound
    assert eng.device_errors() == 0
    eng.close()


def test_the_copy_bound_of_a_job_queued_behind_another_starts_when_that_one_completes():
    """Copies on one stream run one after the other: the second's bound is not spent while
    the device is still doing the first."""
    eng = CopyEngine(torch.device("cpu"), copy_timeout_s=2.0)
    first, second = Transfer(), Transfer()
    t0 = time.monotonic()
    eng.submit("h2d", Job(first, lambda stream: [_DoneAt(t0 + 1.5)], _finish(first)))
    eng.submit("h2d", Job(second, lambda stream: [_DoneAt(t0 + 2.3)], _finish(second)))
    assert first.wait(10) is True
    assert second.wait(10) is True  # 0.8 s after the first: within the bound
    assert eng.device_errors() == 0
    eng.close()
