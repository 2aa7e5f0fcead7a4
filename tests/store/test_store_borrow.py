"""Store.borrow_blocks: the leading resident run, pinned and read in place."""

import torch
from conftest import random_kv

from kvstore import KVLayout, open_store

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_tokens=4)


def _store(tmp_path=None, **kw):
    kw.setdefault("gpu_capacity", 0)
    kw.setdefault("cpu_capacity", 64 * LAY.block_nbytes)
    kw.setdefault("disk_capacity", 0)
    return open_store(tmp_path, layout=LAY, model_id="m", device="cpu", **kw)


def test_zero_copy_view_pinned_until_released():
    with _store() as s:
        keys = s.block_keys(list(range(8 * 4)))
        kv = random_kv(LAY, 8)
        s.put(keys, kv).wait()
        with s.borrow_blocks(keys[:6]) as b:
            assert len(b) == 6 and b.zero_copy
            assert torch.equal(b.blocks, kv[:6])
            slab = s.state.warm.slab.data
            assert slab.data_ptr() <= b.blocks.data_ptr() < slab.data_ptr() + slab.numel()
            assert s.stats().pinned_blocks == 6
            assert s.evict() == 2  # only the unpinned tail can go
            assert s.lookup(keys) == 6
        assert s.stats().pinned_blocks == 0
        b.release()  # idempotent
        assert s.stats().pinned_blocks == 0


def test_run_ends_at_a_miss_and_gathers_across_tiers():
    with _store(gpu_capacity=3 * LAY.block_nbytes) as s:  # a cpu "hot" tier next to warm
        keys = s.block_keys(list(range(6 * 4)))
        kv = random_kv(LAY, 6)
        s.put(keys, kv).wait()
        s.evict(keys[2:4], tier="hot")  # blocks 2, 3 now only in warm: slots not consecutive
        b = s.borrow_blocks([*keys[:5], bytes(32)])
        try:
            assert len(b) == 5 and torch.equal(b.blocks, kv[:5])
        finally:
            b.release()
        assert s.stats().pinned_blocks == 0
        empty = s.borrow_blocks([bytes(32)])
        assert len(empty) == 0 and empty.blocks.shape[0] == 0
        empty.release()


def test_disk_only_blocks_end_the_run(tmp_path):
    with _store(tmp_path, disk_capacity=64 * LAY.block_nbytes) as s:
        keys = s.block_keys(list(range(4 * 4)))
        kv = random_kv(LAY, 4)
        s.put(keys, kv).wait()
        s.flush()
        s.evict(keys[2:], tier="warm")  # 2 and 3 only on disk now
        with s.borrow_blocks(keys) as b:
            assert len(b) == 2 and torch.equal(b.blocks, kv[:2])
        assert torch.equal(s.fetch(keys).wait(), kv)  # fetch reads the rest


def test_release_after_close_is_harmless():
    s = _store()
    keys = s.block_keys(list(range(8)))
    s.put(keys, random_kv(LAY, 2)).wait()
    b = s.borrow_blocks(keys)
    s.close()
    b.release()
