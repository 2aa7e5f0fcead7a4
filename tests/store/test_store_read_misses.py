"""``stats().damaged`` counts only blocks whose bytes are corrupt or gone; a block a lower
tier held at lookup but did not give to the read for another reason (removed since by
another process, a read the process cannot make now: EMFILE) is ``stats().read_misses``.

Regression: both were ``damaged``, so an engine at its descriptor limit, or two engines
sharing a store whose disk budget evicts, looked like disk damage to whoever alerted on it.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
from conftest import keyed_kv

from kvstore import KVLayout, open_store
from kvstore.tiers.disk.bound import BoundDisk
from kvstore.tiers.disk.segments import FdCache

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_tokens=4)


def opened(path, warm=64):
    return open_store(path, layout=LAY, model_id="read/misses", device="cpu", gpu_capacity=0,
                      cpu_capacity=warm * LAY.block_nbytes, disk_capacity="64MiB")


def flushed_chain(path, n=6):
    with opened(path) as s:
        keys = s.block_keys(list(range(n * LAY.block_tokens)))
        kv = keyed_kv(LAY, keys)
        assert s.put(keys, kv).wait() == n
        s.flush()
    return keys, kv


def test_a_read_that_cannot_be_made_now_is_a_read_miss_not_damage(tmp_path, monkeypatch):
    keys, kv = flushed_chain(tmp_path)
    with opened(tmp_path) as s:
        def no_descriptors(self, segment_id):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        monkeypatch.setattr(FdCache, "acquire", no_descriptors)
        assert s.fetch(keys).wait().shape[0] == 0
        st = s.stats()
        assert st.damaged == 0 and st.read_misses >= 1 and st.fetch_short == len(keys)
        monkeypatch.undo()
        got = s.fetch(keys).wait()  # the entries stayed: served once the read can be made
        assert torch.equal(got.view(torch.int16), kv.view(torch.int16))
        assert s.stats().damaged == 0


def test_a_block_removed_between_lookup_and_read_is_a_read_miss_not_damage(tmp_path,
                                                                          monkeypatch):
    keys, _kv = flushed_chain(tmp_path)
    real = BoundDisk.read

    def evicted_meanwhile(self, found, dsts, mirrors=None):  # another process evicts them
        self.disk.delete_owned(list(found.keys), self.namespace_id)
        return real(self, found, dsts, mirrors)

    with opened(tmp_path) as s:
        monkeypatch.setattr(BoundDisk, "read", evicted_meanwhile)
        assert s.fetch(keys).wait().shape[0] == 0
        st = s.stats()
        assert st.damaged == 0 and st.read_misses >= 1


@pytest.mark.parametrize("how", ["flip", "delete"])
def test_corrupt_or_missing_bytes_are_still_damage(tmp_path, how):
    keys, kv = flushed_chain(tmp_path)
    segs = sorted((tmp_path / "segments").glob("*.safetensors"))
    assert len(segs) == 1
    seg = segs[0]
    if how == "flip":
        data = bytearray(seg.read_bytes())
        data[-3] ^= 0xFF  # inside the last block
        seg.write_bytes(bytes(data))
    else:
        seg.unlink()
    with opened(tmp_path) as s:
        n = s.fetch(keys).wait().shape[0]
        assert n == (len(keys) - 1 if how == "flip" else 0)
        st = s.stats()
        assert st.damaged >= 1 and st.read_misses == 0
