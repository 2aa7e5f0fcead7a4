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
