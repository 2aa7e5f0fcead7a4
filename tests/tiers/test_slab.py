import mmap

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore import KVLayout
from kvstore.tiers.slab import Slab, SlotAllocator, runs


def test_runs_coalesce_adjacent_slots():
    assert list(runs([3, 4, 5, 9, 10, 2])) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert list(runs([])) == []


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=60))
def test_allocator_never_double_allocates(ops):
    a = SlotAllocator(10)
    held: set[int] = set()
    for alloc, n in ops:
        if alloc:
            got = a.allocate(n)
            assert len(got) == min(n, 10 - len(held))
            assert not set(got) & held and all(0 <= s < 10 for s in got)
            held |= set(got)
        elif held:
            s = held.pop()
            a.release(s)
        assert a.free_count == 10 - len(held)


def test_slab_read_write_round_trip():
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, block_tokens=2)
    slab = Slab(lay, 5 * lay.block_nbytes + 7, torch.device("cpu"), pin_memory=False)
    assert slab.slots == 5 and slab.nbytes == 5 * lay.block_nbytes
    src = torch.randint(0, 255, (3, lay.block_nbytes), dtype=torch.uint8)
    slab.write([4, 0, 1], src)
    dst = torch.empty_like(src)
    slab.read([4, 0, 1], dst)
    assert torch.equal(src, dst)
    assert slab.block(0).shape == lay.block_shape


def test_shared_slab_keeps_a_key_directory_beside_it(tmp_path):
    import os

    import torch

    from kvstore.layout import KVLayout
    from kvstore.tiers.memory import MemoryTier
    from kvstore.tiers.slab import directory_path

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, block_tokens=2)
    path = str(tmp_path / "warm.slab")
    tier = MemoryTier("warm", lay, 8 * lay.block_nbytes, torch.device("cpu"), shared_path=path)
    d = tier.slab.directory
    assert d is not None and os.path.exists(directory_path(path))
    k = bytes(range(32))
    (slot,) = tier.allocate(1)
    tier.insert(k, slot)
    assert d.leading_run(k) == 1
    tier.remove(k)
    assert d.leading_run(k) == 0
    tier.slab.close()
    assert not os.path.exists(directory_path(path)) and not os.path.exists(path)


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t`` that are in memory (mincore over its whole pages)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel()) // page * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(b & 1 for b in vec)


def test_prefault_makes_a_host_slab_resident_without_touching_its_bytes(tmp_path):
    from kvstore.tiers import slab as slab_mod

    # slabs over fresh files: untouched pages are certainly not resident (an anonymous slab
    # may reuse memory a test before freed, resident already)
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_tokens=16)
    cold = Slab(lay, 64 * lay.block_nbytes, torch.device("cpu"), pin_memory=False,
                shared_path=str(tmp_path / "cold"))
    assert cold.prefault is None
    slab = Slab(lay, 64 * lay.block_nbytes, torch.device("cpu"), pin_memory=False,
                shared_path=str(tmp_path / "warm"), prefault=True)
    src = torch.randint(0, 255, (8, lay.block_nbytes), dtype=torch.uint8)
    slab.write(list(range(8)), src)  # copies racing the prefault keep their bytes
    assert slab.prefault is not None and slab.prefault.done.wait(30)
    if slab.prefault.error is not None:  # a kernel before 5.14: nothing done, and said why
        assert "MADV_POPULATE_WRITE" in slab.prefault.error
        return
    pages = (slab.nbytes - 2 * slab_mod._PAGE) // slab_mod._PAGE
    assert _resident_pages(slab.data) >= pages
    assert _resident_pages(cold.data) < pages // 2
    dst = torch.empty_like(src)
    slab.read(list(range(8)), dst)
    assert torch.equal(dst, src)
    slab.close()  # joins the (finished) thread
    cold.close()


def test_prefault_without_kernel_support_is_a_noop(monkeypatch):
    import errno

    from kvstore.tiers import slab as slab_mod

    monkeypatch.setattr(slab_mod, "_madvise", lambda addr, n, advice: errno.EINVAL)
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_tokens=16)
    slab = Slab(lay, 8 * lay.block_nbytes, torch.device("cpu"), pin_memory=False, prefault=True)
    assert slab.prefault is not None and slab.prefault.done.wait(10)
    assert slab.prefault.error is not None and "Invalid argument" in slab.prefault.error
    slab.close()


def test_prefault_stops_at_close(monkeypatch):
    import threading

    from kvstore.tiers import slab as slab_mod

    calls = []
    gate = threading.Event()

    def slow(addr, n, advice):
        calls.append(n)
        gate.wait(10)
        return 0

    monkeypatch.setattr(slab_mod, "_madvise", slow)
    monkeypatch.setattr(slab_mod, "_PREFAULT_CHUNK", 1 << 16)
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_tokens=16)
    slab = Slab(lay, 64 * lay.block_nbytes, torch.device("cpu"), pin_memory=False, prefault=True)
    assert slab.prefault is not None
    threading.Timer(0.05, gate.set).start()
    slab.close()  # waits for the chunk in flight, then no more
    assert slab.prefault.done.is_set() and len(calls) == 1


def _gated_madvise(monkeypatch):
    """The prefault's ``madvise`` held at its first call until ``go`` is set; ``calls``."""
    import ctypes
    import threading

    import pytest

    from kvstore.tiers import slab as slab_mod

    probe = ctypes.create_string_buffer(3 * mmap.PAGESIZE)
    addr = -(-ctypes.addressof(probe) // mmap.PAGESIZE) * mmap.PAGESIZE
    if slab_mod._madvise(addr, mmap.PAGESIZE, slab_mod.MADV_POPULATE_WRITE):
        pytest.skip("no MADV_POPULATE_WRITE here (Linux < 5.14): nothing to pace")
    real, go, calls = slab_mod._madvise, threading.Event(), []

    def gated(addr, n, advice):
        calls.append(n)
        go.wait(10)
        return real(addr, n, advice)

    monkeypatch.setattr(slab_mod, "_madvise", gated)
    return go, calls


def test_prefault_stands_aside_while_the_foreground_is_busy(tmp_path, monkeypatch):
    """Issue 31 item 7: the prefault waits between calls while ``busy()`` is true."""
    import threading
    import time

    go, calls = _gated_madvise(monkeypatch)
    busy = threading.Event()
    busy.set()
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_tokens=16)
    slab = Slab(lay, 512 * lay.block_nbytes, torch.device("cpu"), pin_memory=False,  # 16 MiB
                shared_path=str(tmp_path / "warm"), prefault=True)
    pf = slab.prefault
    assert pf is not None
    pf.pace(busy.is_set)
    go.set()  # the call begun before pace() ends; then it stands aside
    time.sleep(0.3)
    assert len(calls) == 1 and not pf.done.is_set() and pf.pauses == 1
    assert pf.faulted == 2 << 20
    busy.clear()  # the foreground went quiet: it goes on to the end
    assert pf.done.wait(30) and len(calls) == -(-slab.nbytes // (2 << 20))
    if pf.error is None:
        assert _resident_pages(slab.data) >= (slab.nbytes - 2 * mmap.PAGESIZE) // mmap.PAGESIZE
    slab.close()


def test_store_prefault_waits_for_a_copy_in_flight(tmp_path, monkeypatch):
    """Issue 31 item 7, through open_store: while a copy runs on the store's copy engine (a
    fetch's read, a put's copy) the warm slab's prefault faults nothing in; afterwards it
    does the whole slab. Before, it ran alongside the first operations after an open."""
    import threading
    import time

    from kvstore import open_store
    from kvstore.store.copy_engine import Job
    from kvstore.transfer import Transfer

    go, calls = _gated_madvise(monkeypatch)
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, block_tokens=16)
    with open_store(None, layout=lay, model_id="m", device="cpu", cpu_capacity="16MiB",
                    warm_shared_memory=str(tmp_path / "warm")) as s:
        warm = s.state.warm.slab
        pf, engine = warm.prefault, s.state.engine
        assert pf is not None
        release, t = threading.Event(), Transfer()

        def copying(stream):  # a copy that takes until release is set
            release.wait(10)
            return []

        engine.submit("disk_read", Job(t, copying, lambda ok, err: t.set_result(ok)))
        go.set()
        time.sleep(0.3)
        assert len(calls) <= 2 and not pf.done.is_set()  # the call in flight, at most
        assert engine.busy() and pf.faulted <= 2 << 20
        release.set()
        assert t.wait() is True and pf.done.wait(30) and len(calls) == 8
        if pf.error is None:
            assert pf.faulted == warm.nbytes
            assert _resident_pages(warm.data) >= (warm.nbytes - 2 * mmap.PAGESIZE) // mmap.PAGESIZE
        with engine.foreground():  # a caller's own reads (Fetcher.read_into) count too
            assert engine.busy()
        assert not engine.busy()


class FakeRegistrar:
    """A :class:`~kvstore.tiers.slab.HostRegistrar` that records instead of page-locking."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.live: dict[int, int] = {}

    def available(self):
        return True

    def register(self, ptr, nbytes):
        assert ptr not in self.live, "registered twice"
        self.calls.append(("register", ptr, nbytes))
        self.live[ptr] = nbytes

    def unregister(self, ptr):
        assert ptr in self.live, "unregistered without a register"
        self.calls.append(("unregister", ptr))
        del self.live[ptr]


def _pinned_slab(monkeypatch, **kw):
    import kvstore.tiers.slab as slab_mod

    fake = FakeRegistrar()
    monkeypatch.setattr(slab_mod, "REGISTRAR", fake)
    # torch's caching host allocator must not be what pins the slab
    real_empty = torch.empty

    def empty(*a, **k):
        assert not k.get("pin_memory"), "pinned through torch's caching host allocator"
        return real_empty(*a, **k)

    monkeypatch.setattr(torch, "empty", empty)
    lay = KVLayout(num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float16, block_tokens=4)
    slab = Slab(lay, 5 * lay.block_nbytes + 100, torch.device("cpu"), pin_memory=True, **kw)
    monkeypatch.setattr(torch, "empty", real_empty)
    return fake, slab


def test_pinned_slab_registers_exactly_its_bytes_and_unregisters_at_close(monkeypatch):
    from kvstore.memcheck import pinned_host_bytes

    before = pinned_host_bytes()
    fake, slab = _pinned_slab(monkeypatch)
    ptr = slab.data.data_ptr()
    assert fake.calls == [("register", ptr, slab.nbytes)]  # exact: no rounding up
    assert slab.pinned_nbytes == slab.nbytes == 5 * slab.layout.block_nbytes
    assert pinned_host_bytes() - before == slab.nbytes  # memcheck counts what is locked
    slab.write([4], torch.full((1, slab.layout.block_nbytes), 7, dtype=torch.uint8))
    assert int(slab.data[4].sum()) == 7 * slab.layout.block_nbytes
    slab.close()
    assert fake.calls == [("register", ptr, slab.nbytes), ("unregister", ptr)]
    assert fake.live == {} and pinned_host_bytes() == before
    slab.close()  # idempotent: one unregister per register
    assert len(fake.calls) == 2


def test_pinned_shared_slab_registers_its_mapping_and_unregisters_at_close(monkeypatch, tmp_path):
    path = str(tmp_path / "warm.slab")
    fake, slab = _pinned_slab(monkeypatch, shared_path=path)
    ptr = slab.data.data_ptr()
    assert fake.calls == [("register", ptr, slab.nbytes)]
    slab.close()
    assert fake.calls[-1] == ("unregister", ptr) and fake.live == {}
