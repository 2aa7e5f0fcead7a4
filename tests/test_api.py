"""The typed surface of kvstore.api: the store and the client are KVCaches; only the embedded
store offers the zero-copy data plane."""

from __future__ import annotations

import torch

from kvstore import KVLayout, open_store
from kvstore.api import KVCache, PinReceipt, Tier, ZeroCopy

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, block_tokens=2)


def test_store_is_a_kvcache_with_zero_copy():
    with open_store(None, layout=LAY, model_id="api/test", device="cpu",
                    cpu_capacity=64 * LAY.block_nbytes) as s:
        assert isinstance(s, KVCache) and isinstance(s, ZeroCopy)
        keys = s.block_keys(list(range(8)))
        s.put(keys, torch.zeros(LAY.batch_shape(4), dtype=LAY.dtype)).wait()
        with s.pin(keys) as r:
            assert isinstance(r, PinReceipt) and len(r) == 4
            assert s.evict(keys) == 0  # pinned
        assert s.evict(keys, tier=Tier.WARM) >= 1  # a Tier is its name
        assert s.lookup(keys) == 0


def test_client_is_a_kvcache_without_zero_copy(memory_daemon):
    import kvstore

    c = kvstore.connect(memory_daemon.socket_path, layout=LAY, model_id="api/test")
    try:
        assert isinstance(c, KVCache) and not isinstance(c, ZeroCopy)
    finally:
        c.close()


def test_pin_receipt_releases_once():
    calls = []
    r = PinReceipt(calls.append, [b"k" * 32])
    with r:
        pass
    r.release()
    assert calls == [[b"k" * 32]]
