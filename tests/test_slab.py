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
