"""lease_into: blocks only on disk read straight into a caller's pages (one piece per layer),
verified; blocks held in memory handed back as warm slots; the warm copies filled afterwards."""

import pytest
import torch
from conftest import keyed_kv
from test_store_disk import _corrupt

from kvstore import KVLayout, open_store

LAY = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
BN, LB = LAY.block_nbytes, LAY.layer_nbytes
PAGES = 64


def opened(path, *, warm=16):
    return open_store(path, layout=LAY, model_id="lease/test", device="cpu",
                      cpu_capacity=warm * BN, disk_capacity="64MiB")


def saved(path, n):
    with opened(path) as s:
        keys = s.block_keys(list(range(n * LAY.block_tokens)))
        kv = keyed_kv(LAY, keys)
        assert s.put(keys, kv).wait() == n
    return keys, kv


class Pages:
    """An engine's per-layer pages ([num_pages, layer bytes] each), pieces as tensors or as
    byte memoryviews (what the vLLM connector hands in)."""

    def __init__(self, kind):
        self.layers = [torch.zeros((PAGES, LB), dtype=torch.uint8) for _ in range(LAY.num_layers)]
        self.views = [memoryview(t.numpy()).cast("B") for t in self.layers]
        self.kind = kind

    def pieces(self, page):
        if self.kind == "tensor":
            return [t[page] for t in self.layers]
        return [v[page * LB:(page + 1) * LB] for v in self.views]

    def block(self, page):
        """The block's bytes as the store holds them (layer after layer)."""
        return torch.cat([t[page] for t in self.layers])

    def copy_from_slab(self, slab, copies, ids):
        for p, slot in copies:
            for layer, t in enumerate(self.layers):
                t[ids[p]].copy_(slab[slot, layer * LB:(layer + 1) * LB])


def flat(kv, i):
    return kv[i].contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("kind", ["tensor", "memoryview"])
def test_disk_blocks_land_in_the_pages_and_then_in_warm(tmp_path, kind):
    keys, kv = saved(tmp_path, 6)
    ids = [40, 3, 4, 5, 17, 0]  # pages in any order
    with opened(tmp_path) as s:
        pg = Pages(kind)
        lease = s.zero_copy.lease_into(keys, lambda p: pg.pieces(ids[p]))
        assert (lease.n, lease.pinned, lease.copies) == (6, (), ())
        for i in range(6):
            assert torch.equal(pg.block(ids[i]), flat(kv, i))
        s.flush()  # the warm copies are read behind the caller's back
        st = s.stats()
        assert st.tier("warm").blocks == 6 and st.fetched_blocks == 6 and st.damaged == 0
        # the next load finds them in memory: warm slots, pinned, for the caller to copy
        pg2 = Pages(kind)
        lease = s.zero_copy.lease_into(keys, lambda p: pg2.pieces(ids[p]))
        assert lease.n == 6 and [p for p, _ in lease.copies] == list(range(6))
        assert len(lease.pinned) == 6
        pg2.copy_from_slab(s.warm_slab, lease.copies, ids)
        s.release_lease(lease.pinned)
        for i in range(6):
            assert torch.equal(pg2.block(ids[i]), flat(kv, i))


def test_memory_and_disk_blocks_mixed(tmp_path):
    keys, kv = saved(tmp_path, 6)
    ids = list(range(10, 16))
    with opened(tmp_path) as s:
        assert s.prefetch(keys[:2]).wait() == 2  # the first two in warm, the rest on disk
        pg = Pages("memoryview")
        lease = s.zero_copy.lease_into(keys, lambda p: pg.pieces(ids[p]))
        assert lease.n == 6 and [p for p, _ in lease.copies] == [0, 1]
        pg.copy_from_slab(s.warm_slab, lease.copies, ids)
        s.release_lease(lease.pinned)
        for i in range(6):
            assert torch.equal(pg.block(ids[i]), flat(kv, i))


def test_single_block(tmp_path):
    keys, kv = saved(tmp_path, 1)
    with opened(tmp_path) as s:
        pg = Pages("memoryview")
        lease = s.zero_copy.lease_into(keys, lambda p: pg.pieces(7))
        assert lease.n == 1 and torch.equal(pg.block(7), flat(kv, 0))


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_block_ends_the_run(tmp_path, how):
    keys, kv = saved(tmp_path, 4)
    _corrupt(tmp_path, how)  # the last block's payload (flip, truncate) or every block
    with opened(tmp_path) as s:
        pg = Pages("memoryview")
        lease = s.zero_copy.lease_into(keys, lambda p: pg.pieces(p))
        n = lease.n
        assert n < 4
        for i in range(n):  # never wrong bytes in the run it reports
            assert torch.equal(pg.block(i), flat(kv, i))
        s.flush()
        st = s.stats()
        assert st.damaged >= 1 and st.fetch_short == 4 - n
        assert st.tier("warm").blocks == n  # only the good leading run joins warm
        assert s.lookup(keys) == n


def test_without_fill_the_blocks_stay_on_disk_only(tmp_path):
    keys, kv = saved(tmp_path, 5)
    with opened(tmp_path) as s:
        for _ in range(2):  # read from disk both times: no warm copy was made
            pg = Pages("memoryview")
            lease = s.zero_copy.lease_into(keys, pg.pieces, fill=False)
            assert (lease.n, lease.copies) == (5, ())
            for i in range(5):
                assert torch.equal(pg.block(i), flat(kv, i))
            s.flush()
            assert s.stats().tier("warm").blocks == 0
        assert s.lookup(keys) == 5 and s.stats().fetched_blocks == 10


def test_without_fill_nothing_in_warm_is_evicted_for_it(tmp_path):
    """A lease without warm copies reserves no warm slots: regression for a fill=False load
    from disk that evicted as many warm blocks as it read, for slots it gave back unused."""
    keys, kv = saved(tmp_path, 8)  # on disk
    with opened(tmp_path, warm=8) as s:
        other = s.block_keys(list(range(1000, 1000 + 8 * LAY.block_tokens)))
        assert s.put(other, keyed_kv(LAY, other)).wait() == 8  # fills the warm tier
        s.flush()
        pg = Pages("memoryview")
        lease = s.zero_copy.lease_into(keys, pg.pieces, fill=False)
        assert lease.n == 8 and all(torch.equal(pg.block(i), flat(kv, i)) for i in range(8))
        s.flush()
        st = s.stats().tier("warm")
        assert st.blocks == 8 and st.evictions == 0
        assert s.lookup(other) == 8
        got = s.fetch(other).wait()
        assert got.shape[0] == 8
        assert torch.equal(got.view(torch.int16), keyed_kv(LAY, other).view(torch.int16))
