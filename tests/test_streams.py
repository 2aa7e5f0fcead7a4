"""The stream-ordering rule (kvstore/streams.py) on the CPU, through the recording fake.

A store opened with ``RecordingStreams`` takes the CUDA branches (copies on per-path streams,
events polled by the workers) while its tensors stay on the CPU; the fake checks every
declared access against what its stream waited for. Each test has a negative control: the
same scenario with the wait removed must be caught, so the fake is known to see the race.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import random_kv

import kvstore.store.fetch as fetch_mod
import kvstore.store.paged as paged_mod
import kvstore.store.put as put_mod
import kvstore.streams as streams
from kvstore import KVLayout, TensorMismatchError, Transfer, TransferError, open_store
from kvstore.store.copy_engine import CopyEngine, Job
from kvstore.store.put import OverflowJob
from kvstore.streams import RecordingStreams, handoff, host_wait

LAY = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_tokens=4)
BN = LAY.block_nbytes


def store(hot=8, warm=16, path=None, **kw):
    return open_store(path, layout=LAY, model_id="streams", device="cpu", gpu_capacity=hot * BN,
                      cpu_capacity=warm * BN, **kw)


def no_wait(monkeypatch, module):
    """The negative control: copies stop waiting for the caller's stream (the old code)."""
    monkeypatch.setattr(module, "begin_copy", lambda streams, h, stream: None)


# -- rule 1: producer side ------------------------------------------------------------------
def test_put_copy_waits_for_the_stream_that_produced_kv(fake):
    fwd = fake.new_stream("forward")
    with store() as s, fake.use(fwd):
        keys = s.block_keys(list(range(3 * 4)))
        kv = random_kv(LAY, 3)
        fake.access(fwd, writes=[kv], what="forward")  # the forward writes kv, no sync
        assert s.put(keys, kv).wait(5) == 3
        assert fake.violations == []
        waits = [e for e in fake.log if e[0] == "wait"]
        assert ("wait", waits[0][1], "forward") in waits  # the put stream waited on forward
        assert ("hand_over", waits[0][1]) in fake.log  # kv adopted by the copy stream
        assert torch.equal(s.fetch(keys).wait(5), kv)


def test_the_fake_catches_a_put_that_does_not_wait(fake, monkeypatch):
    no_wait(monkeypatch, put_mod)
    fwd = fake.new_stream("forward")
    with store() as s, fake.use(fwd):
        kv = random_kv(LAY, 2)
        fake.access(fwd, writes=[kv], what="forward")
        s.put(s.block_keys(list(range(8))), kv).wait(5)
    assert any("forward" in v for v in fake.violations)


def test_fetch_into_a_reused_out_waits_for_its_last_use(fake, monkeypatch):
    fwd = fake.new_stream("forward")
    with store() as s, fake.use(fwd):
        keys = s.block_keys(list(range(12)))
        kv = random_kv(LAY, 3)
        s.put(keys, kv).wait(5)
        out = torch.empty_like(kv)
        fake.access(fwd, reads=[out], what="last step's scatter")  # still reading out
        got = s.fetch(keys, out=out).wait(5)
        fake.access(fwd, reads=[got], what="consumer")  # after wait(): ordered by the host
        assert fake.violations == []
        assert torch.equal(got, kv)
    no_wait(monkeypatch, fetch_mod)
    fake.violations.clear()
    with store() as s, fake.use(fwd):
        keys = s.block_keys(list(range(12)))
        s.put(keys, kv).wait(5)
        out = torch.empty_like(kv)
        fake.access(fwd, reads=[out], what="last step's scatter")
        s.fetch(keys, out=out).wait(5)
    assert any("scatter" in v for v in fake.violations)


def test_save_from_gathers_on_the_caller_stream_and_the_put_waits_for_it(fake, monkeypatch):
    fwd = fake.new_stream("forward")
    pages = [torch.randn(2, 8, 4, 2, 4) for _ in range(3)]  # flash layout, page_size 4
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                   block_tokens=4, kv_planes=2)
    with open_store(None, layout=lay, model_id="sf", device="cpu", gpu_capacity=8 * lay.block_nbytes,
                    cpu_capacity=8 * lay.block_nbytes) as s, fake.use(fwd):
        keys = s.block_keys(list(range(8)))
        fake.access(fwd, writes=pages, what="forward")
        assert s.save_from(pages, [3, 5], keys).wait(5) == 2
        assert fake.violations == []
        dst = [torch.zeros_like(p) for p in pages]
        fake.access(fwd, writes=dst, what="previous step")
        t = s.load_into(keys, dst, [1, 2])
        for i in range(3):
            t.wait_layer(i, 5)
        assert t.wait(5) == 2
        fake.access(fwd, reads=dst, what="attention")
        assert fake.violations == []
        for p, d in zip(pages, dst, strict=True):
            assert torch.equal(d[:, 1], p[:, 3]) and torch.equal(d[:, 2], p[:, 5])
    no_wait(monkeypatch, paged_mod)
    no_wait(monkeypatch, fetch_mod)
    fake.violations.clear()
    with open_store(None, layout=lay, model_id="sf", device="cpu", gpu_capacity=8 * lay.block_nbytes,
                    cpu_capacity=8 * lay.block_nbytes) as s, fake.use(fwd):
        keys = s.block_keys(list(range(8)))
        s.save_from(pages, [3, 5], keys).wait(5)
        dst = [torch.zeros_like(p) for p in pages]
        fake.access(fwd, writes=dst, what="previous step")
        s.load_into(keys, dst, [1, 2]).wait(5)
    assert any("previous step" in v for v in fake.violations)


def test_put_overflow_copy_waits_for_the_producer(fake):
    fwd = fake.new_stream("forward")
    kv = random_kv(LAY, 2)
    with fake.use(fwd):
        fake.access(fwd, writes=[kv], what="forward")
        h = handoff(fake, kv)
    job = OverflowJob([b"k" * 32], [None], kv, [1], Transfer(), None, 0, h.ready, fake)
    assert torch.equal(job.host_bytes(0), kv[1].reshape(-1).view(torch.uint8))
    assert fake.violations == []
    bad = OverflowJob([b"k" * 32], [None], kv, [1], Transfer(), None, 0, None, fake)
    with fake.use(fwd):
        fake.access(fwd, writes=[kv], what="forward again")
    bad.host_bytes(0)  # the old code: no event to wait for
    assert any("forward again" in v for v in fake.violations)


def test_put_overflow_surfaces_a_failed_producer(fake, monkeypatch):
    monkeypatch.setattr(streams, "COPY_TIMEOUT_S", 0.2)
    ev = fake.event()
    ev.record(fake.new_stream("forward"))
    ev.hang = True
    job = OverflowJob([b"k" * 32], [None], random_kv(LAY, 1), [0], Transfer(), None, 0, ev, fake)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="did not complete"):
        job.host_bytes(0)
    assert time.monotonic() - t0 < 5


# -- rule 2/3: device errors fail the job, never hang the engine --------------------------------
def test_a_device_error_fails_the_fetch_and_the_engine_keeps_running(fake):
    with store() as s:
        keys = s.block_keys(list(range(12)))
        kv = random_kv(LAY, 3)
        s.put(keys, kv).wait(5)
        fake.fail_after(0, RuntimeError("CUDA error: an illegal memory access was encountered"))
        t = s.fetch(keys)
        with pytest.raises(TransferError, match="illegal memory access"):
            t.wait(5)
        assert s.stats().fetch_short >= 3  # counted: a miss for the caller
        fake.heal()
        assert torch.equal(s.fetch(keys).wait(5), kv)  # the worker is still alive
        assert s.state.engine.device_errors() == 1


def test_a_device_error_drops_the_put(fake):
    with store() as s:
        keys = s.block_keys(list(range(12)))
        fake.fail_after(0, RuntimeError("CUDA error: misaligned address"))
        assert s.put(keys, random_kv(LAY, 3)).wait(5) == 0
        fake.heal()
        assert s.lookup(keys) == 0
        assert s.stats().put_dropped == 3
        kv = random_kv(LAY, 3, seed=1)
        assert s.put(keys, kv).wait(5) == 3
        assert torch.equal(s.fetch(keys).wait(5), kv)


def test_a_hung_copy_fails_within_the_bound_and_drain_returns(fake, monkeypatch):
    monkeypatch.setattr(streams, "COPY_TIMEOUT_S", 0.3)
    with store() as s:
        keys = s.block_keys(list(range(12)))
        s.put(keys, random_kv(LAY, 3)).wait(5)
        fake.hang_after(0)
        t = s.fetch(keys)
        with pytest.raises(TransferError, match="did not complete"):
            t.wait_layer(0, 10)
        assert s.state.engine.drain(10)
        fake.heal()


def test_releasing_a_borrowed_view_waits_for_the_caller_stream(fake):
    fwd = fake.new_stream("forward")
    with store() as s, fake.use(fwd):
        keys = s.block_keys(list(range(8)))
        s.put(keys, random_kv(LAY, 2)).wait(5)
        b = s.borrow_blocks(keys)
        fake.hang_after(0)  # the kernels reading the view have not finished
        b.release()
        time.sleep(0.05)
        cat = s.state.catalog
        assert all(cat.is_pinned(k) for k in keys)  # not recycled under a reader
        fake.heal()
        for job in list(s.state.engine._workers["h2d"]._inflight):
            for ev in job.events:
                ev.hang = False
        assert s.state.engine.drain(5)
        assert not any(cat.is_pinned(k) for k in keys)


def test_fetch_refuses_an_out_on_another_device():
    with store() as s:
        keys = s.block_keys(list(range(8)))
        with pytest.raises(TensorMismatchError, match="allocate out on cpu"):
            s.fetch(keys, out=torch.empty(LAY.batch_shape(2), dtype=LAY.dtype, device="meta"))


# -- the engine on its own --------------------------------------------------------------------
def test_engine_worker_survives_an_event_that_raises():
    fake = RecordingStreams()
    eng = CopyEngine(torch.device("cpu"), streams=fake, copy_timeout_s=5)
    bad = fake.event()
    bad.error = RuntimeError("CUDA error: unspecified launch failure")
    first, second = Transfer(num_layers=2), Transfer()
    results: list = []

    def fin(t):
        def finish(ok, err):
            results.append(ok)
            t.set_error(err) if err else t.set_result(ok)
        return finish

    eng.submit("h2d", Job(first, lambda st: [bad, bad], fin(first)))
    eng.submit("h2d", Job(second, lambda st: [st.record_event()], fin(second)))
    with pytest.raises(TransferError, match="launch failure"):
        first.wait_layer(1, 5)
    assert second.wait(5) is True  # jobs queued after it still run
    assert eng.drain(5)
    eng.close()


def test_host_wait_is_bounded():
    fake = RecordingStreams()
    ev = fake.event()
    ev.record(fake.new_stream())
    ev.hang = True
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="did not complete within"):
        host_wait(ev, 0.1)
    assert time.monotonic() - t0 < 2


def test_puts_run_on_their_own_path_and_a_fetch_waits_for_a_put_still_copying(fake):
    with store() as s:
        eng = s.state.engine
        keys = s.block_keys(list(range(8)))
        kv = random_kv(LAY, 2)
        gate = threading.Event()
        eng.submit("d2h", Job(Transfer(), lambda st: (gate.wait(5), [])[1],
                              lambda ok, e: None))  # the put path is busy
        put = s.put(keys, kv)
        other = s.fetch(s.block_keys(list(range(100, 108))))
        assert other.wait(2).shape[0] == 0  # fetches do not queue behind puts
        fetched = s.fetch(keys)  # planned on the pending put: waits for its bytes
        gate.set()
        assert put.wait(5) == 2
        assert torch.equal(fetched.wait(5), kv)
        assert eng.counters()["d2h"][0] == 2 and eng.counters()["h2d"][0] >= 1


# -- demotion (hot -> warm): an async copy on the d2h stream, never under the lock -----------------
def _gate_d2h(eng):
    """Hold the d2h worker until the returned event is set (jobs queue behind it)."""
    gate = threading.Event()
    eng.submit("d2h", Job(Transfer(), lambda st: (gate.wait(10), [])[1], lambda ok, e: None))
    return gate


def test_demotion_is_enqueued_on_the_d2h_stream_and_the_lock_is_not_held_across_it(fake):
    fwd = fake.new_stream("forward")
    with store(hot=2, warm=8) as s, fake.use(fwd):
        eng, cat = s.state.engine, s.state.catalog
        d2h, h2d = eng.stream("d2h").name, eng.stream("h2d").name
        a, kv_a = s.block_keys(list(range(8))), random_kv(LAY, 2)
        s.put(a, kv_a).wait(5)
        assert s.stats().tier("hot").blocks == 2
        for k in a:  # waiting for a disk writer (whose host reads must not see a partial copy)
            cat.mark_dirty(k)
        gate = _gate_d2h(eng)  # the copies queued from now on have not landed
        b, kv_b = s.block_keys(list(range(100, 108))), random_kv(LAY, 2, seed=1)
        put_b = s.put(b, kv_b)  # hot is full of a's blocks (no lower copy): demoted
        # put returned with the demotion copies in flight: the lock is free meanwhile
        took: list[bool] = []

        def take() -> None:
            ok = s.state.lock.acquire(timeout=2)
            took.append(ok)
            if ok:
                s.state.lock.release()

        th = threading.Thread(target=take)
        th.start()
        th.join()
        assert took == [True]
        assert s.lookup(a) == 2  # still found (warm, pending)
        assert all(cat.is_pinned(k) and k in s.state.pending for k in a)  # pinned until it lands
        assert not any(cat.is_dirty(k) for k in a)  # the writer takes them once they landed
        demotions = [e for e in fake.log if e[0] == "access" and e[2] == "demotion"]
        assert demotions == [("access", d2h, "demotion")] * 2  # not on the caller's stream
        assert ("wait", h2d, d2h) in fake.log  # a promotion into a freed slot comes after it
        fetched = s.fetch(a)  # planned on the demotions in flight: waits for them
        gate.set()
        assert put_b.wait(5) == 2 and torch.equal(fetched.wait(5), kv_a)
        assert eng.drain(5)
        assert not any(cat.is_pinned(k) or k in s.state.pending for k in a)
        assert all(cat.is_dirty(k) for k in a)
        st = s.stats()
        assert st.tier("warm").demotions_in == 2
        assert torch.equal(s.fetch(b).wait(5), kv_b) and torch.equal(s.fetch(a).wait(5), kv_a)
        assert fake.violations == []


def _promote_into_a_slot_freed_by_demotion(s):
    """hot holds one block: a fetch of a warm block promotes it into the slot that the
    demotion of the hot block frees, while that demotion's copy has not been seen done."""
    b, kv_b = s.block_keys(list(range(100, 104))), random_kv(LAY, 1, seed=2)
    a, kv_a = s.block_keys(list(range(4))), random_kv(LAY, 1, seed=3)
    s.put(b, kv_b).wait(5)
    s.put(a, kv_a).wait(5)  # b demoted, a in hot
    s.flush()
    gate = _gate_d2h(s.state.engine)
    assert torch.equal(s.fetch(b).wait(5), kv_b)  # promotion: demotes a, takes its slot
    gate.set()
    s.flush()
    assert torch.equal(s.fetch(a).wait(5), kv_a) and torch.equal(s.fetch(b).wait(5), kv_b)


def test_a_promotion_into_a_slot_freed_by_demotion_waits_for_the_copy(fake, monkeypatch):
    with store(hot=1, warm=8) as s:
        _promote_into_a_slot_freed_by_demotion(s)
        assert s.stats().tier("hot").promotions_in >= 1
    assert fake.violations == []
    # negative control: without the h2d stream's wait on the demotion's event, the fake sees
    # the promotion overwrite the hot slot the demotion copy is still reading
    orig = streams.FakeStream.wait_event

    def skip(self, ev):
        if self is not h2d[0] or ev.stream != d2h[0]:
            orig(self, ev)

    with store(hot=1, warm=8) as s:
        h2d, d2h = [s.state.engine.stream("h2d")], [s.state.engine.stream("d2h").name]
        monkeypatch.setattr(streams.FakeStream, "wait_event", skip)
        _promote_into_a_slot_freed_by_demotion(s)
    assert any("promotion" in v and "demotion" in v for v in fake.violations), fake.violations
