"""Behaviour of the store (memory tiers).

Every test using ``make_store`` runs twice (see conftest.py): against the embedded store and
against a ``kvstore serve`` daemon through ``kvstore.connect``. Tests marked
``embedded_only`` are about the hot tier, which a daemon does not have (it owns no GPU; its
clients copy from its shared-memory warm tier to their own devices).
"""

import os
import threading
from pathlib import Path

import pytest
import torch
from conftest import random_kv

from kvstore import (
    ConfigError,
    KVLayout,
    NamespaceMismatchError,
    SizeError,
    StoreClosedError,
    TensorMismatchError,
    TokenError,
    Transfer,
    open_store,
)
from kvstore.errors import KeyFormatError


def test_put_lookup_fetch_round_trip(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(30)))  # 7 full blocks of 4, 2 tokens left over
    assert len(keys) == 7
    assert s.lookup(keys) == 0
    kv = random_kv(small_layout, 7)
    t = s.put(keys, kv)
    assert isinstance(t, Transfer) and t.wait() == 7 and t.done()
    assert s.lookup(keys) == 7
    got = s.fetch(keys).wait()
    assert got.shape == small_layout.batch_shape(7)
    assert torch.equal(got.view(torch.int16), kv.view(torch.int16))  # bit-exact


def test_fetch_into_caller_buffer(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(16)))
    kv = random_kv(small_layout, 4)
    s.put(keys, kv).wait()
    buf = torch.zeros(small_layout.batch_shape(6), dtype=small_layout.dtype)
    res = s.fetch(keys, out=buf).wait()
    assert res.data_ptr() == buf.data_ptr() and res.shape[0] == 4
    assert torch.equal(buf[:4], kv) and not buf[4:].any()


def test_partial_hit_and_fetch_stops_at_miss(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(24)))
    s.put(keys[:3], random_kv(small_layout, 3)).wait()
    assert s.lookup(keys) == 3
    got = s.fetch(keys).wait()
    assert got.shape[0] == 3  # fewer blocks than asked: callers check the length
    other = s.block_keys(list(range(100, 124)))
    assert s.lookup(other) == 0 and s.fetch(other).wait().shape[0] == 0


def test_put_skips_duplicates_and_counts_them(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(16)))
    kv = random_kv(small_layout, 4)
    assert s.put(keys[:2], kv[:2]).wait() == 2
    assert s.put(keys, kv).wait() == 2
    st = s.stats()
    assert st.put_blocks == 4 and st.put_duplicates == 2 and st.blocks == 4


def test_suffix_put_extends_cached_prefix(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(32)))
    kv = random_kv(small_layout, 8)
    s.put(keys[:3], kv[:3]).wait()
    n = s.lookup(keys)
    assert s.put(keys[n:], kv[n:]).wait() == 5
    assert torch.equal(s.fetch(keys).wait(), kv)


def test_put_of_orphan_suffix_is_dropped(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(32)))
    # the prefix keys[:3] is not cached: these blocks could never be reached by lookup
    assert s.put(keys[3:], random_kv(small_layout, 5)).wait() == 0
    assert s.stats().put_dropped == 5 and s.stats().blocks == 0


def test_salt_isolates_tenants(make_store, small_layout):
    s = make_store()
    a = s.block_keys(list(range(16)), salt="tenant-a")
    b = s.block_keys(list(range(16)), salt=b"tenant-b")
    s.put(a, random_kv(small_layout, 4)).wait()
    assert s.lookup(a) == 4 and s.lookup(b) == 0


def test_keys_of_another_namespace_are_rejected(make_store, small_layout):
    s1 = make_store(model_id="model-a")
    s2 = make_store(model_id="model-b")
    keys = s1.block_keys(list(range(16)))
    with pytest.raises(NamespaceMismatchError, match="block_keys"):
        s2.put(keys, random_kv(small_layout, 4))
    with pytest.raises(NamespaceMismatchError):
        s2.lookup(keys)
    with pytest.raises(NamespaceMismatchError):
        s2.fetch(keys[1:])
    # the store stays usable
    k2 = s2.block_keys(list(range(16)))
    assert s2.put(k2, random_kv(small_layout, 4)).wait() == 4


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda lay: torch.zeros(lay.batch_shape(2), dtype=torch.float32), "dtype"),
        (lambda lay: torch.zeros((2, 2, 2, 4, 2, 5), dtype=lay.dtype), "shape"),
        (lambda lay: torch.zeros(lay.batch_shape(3), dtype=lay.dtype), "3 blocks but 2 keys"),
        (lambda lay: torch.zeros(lay.block_shape, dtype=lay.dtype), "shape"),
        (lambda lay: torch.zeros(lay.batch_shape(2), dtype=lay.dtype, device="meta"), "on meta"),
        (lambda lay: [[0.0]], "torch.Tensor"),
    ],
)
def test_put_validates_synchronously(make_store, small_layout, bad, match):
    s = make_store()
    keys = s.block_keys(list(range(8)))
    with pytest.raises(TensorMismatchError, match=match):
        s.put(keys, bad(small_layout))
    assert s.stats().puts == 0 and s.lookup(keys) == 0
    assert s.put(keys, random_kv(small_layout, 2)).wait() == 2  # still usable


def test_bad_keys_and_tokens(make_store, small_layout):
    s = make_store()
    with pytest.raises(KeyFormatError):
        s.lookup([b"short"])
    with pytest.raises(TypeError):
        s.lookup(b"x" * 32)
    with pytest.raises(TokenError):
        s.block_keys([1, -2, 3, 4])
    with pytest.raises(TokenError):
        s.block_keys([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(TokenError):
        s.block_keys([2**32, 0, 0, 0])


def test_fetch_out_validation(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(8)))
    with pytest.raises(TensorMismatchError, match="holds 1 blocks"):
        s.fetch(keys, out=torch.empty(small_layout.batch_shape(1), dtype=small_layout.dtype))
    with pytest.raises(TensorMismatchError, match="dtype"):
        s.fetch(keys, out=torch.empty(small_layout.batch_shape(2)))
    nc = torch.empty(small_layout.batch_shape(4), dtype=small_layout.dtype)[::2]
    with pytest.raises(TensorMismatchError, match="contiguous"):
        s.fetch(keys, out=nc)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"cpu_capacity": 10}, SizeError, "smaller than one block"),
        ({"gpu_capacity": "100B"}, SizeError, "smaller than one block"),
        ({"cpu_capacity": "lots"}, SizeError, "not a size"),
        ({"gpu_capacity": 0, "cpu_capacity": 0}, ConfigError, "both 0"),
        ({"device": "cuda:0"}, ConfigError, "CUDA is not available"),
        ({"device": "tpu"}, ConfigError, "device"),
        ({"admission": "sometimes"}, ConfigError, "admission"),
        ({"layout": "llama"}, ConfigError, "KVLayout"),
        ({"model_id": ""}, ConfigError, "model_id"),
    ],
)
def test_open_store_errors(small_layout, kw, exc, match):
    if kw.get("device") == "cuda:0" and torch.cuda.is_available():
        pytest.skip("CUDA present")
    args = dict(layout=small_layout, model_id="m", device="cpu", gpu_capacity="1MiB",
                cpu_capacity="1MiB")
    args.update(kw)
    with pytest.raises(exc, match=match):
        open_store(None, **args)


def test_path_accepts_str_and_pathlike(small_layout, tmp_path):
    for p in (str(tmp_path / "a"), tmp_path / "b", os.fspath(tmp_path / "c")):
        with open_store(p, layout=small_layout, model_id="m", device="cpu",
                        cpu_capacity="1MiB") as s:
            assert isinstance(s.config.path, Path)
    with pytest.raises(ConfigError, match="PathLike"):
        open_store(42, layout=small_layout, model_id="m")


def test_use_after_close(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(8)))
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.lookup(keys), lambda: s.fetch(keys), lambda: s.stats(),
                 lambda: s.put(keys, random_kv(small_layout, 2)), lambda: s.block_keys([1] * 8),
                 lambda: s.pin(keys), lambda: s.flush(), lambda: s.evict()):
        with pytest.raises(StoreClosedError, match="open_store"):
            call()


@pytest.mark.embedded_only  # hot tier
def test_put_spills_from_hot_to_warm(make_store, small_layout):
    s = make_store(hot_blocks=2, warm_blocks=8)
    keys = s.block_keys(list(range(24)))
    kv = random_kv(small_layout, 6)
    assert s.put(keys, kv).wait() == 6
    st = s.stats()
    assert st.tier("hot").blocks == 2 and st.tier("warm").blocks == 4
    assert torch.equal(s.fetch(keys).wait(), kv)


@pytest.mark.embedded_only  # hot tier
def test_hot_victims_demote_to_warm(make_store, small_layout):
    s = make_store(hot_blocks=2, warm_blocks=8)
    a = s.block_keys(list(range(8)))
    b = s.block_keys(list(range(100, 108)))
    kv_a, kv_b = random_kv(small_layout, 2, seed=1), random_kv(small_layout, 2, seed=2)
    s.put(a, kv_a).wait()
    s.put(b, kv_b).wait()
    st = s.stats()
    assert st.tier("hot").blocks == 2 and st.tier("warm").blocks == 2
    assert st.tier("warm").demotions_in == 2
    assert torch.equal(s.fetch(a).wait(), kv_a) and torch.equal(s.fetch(b).wait(), kv_b)


@pytest.mark.embedded_only  # hot tier
def test_fetch_promotes_from_warm(make_store, small_layout):
    s = make_store(hot_blocks=4, warm_blocks=8)
    keys = s.block_keys(list(range(16)))
    kv = random_kv(small_layout, 4)
    s.put(keys, kv).wait()
    assert s.evict(keys, tier="hot") == 4  # demoted
    st = s.stats()
    assert st.tier("hot").blocks == 0 and st.tier("warm").blocks == 4
    assert torch.equal(s.fetch(keys).wait(), kv)
    s.flush()  # promotion into hot completes behind the fetch
    st = s.stats()
    assert st.tier("hot").blocks == 4 and st.tier("hot").promotions_in == 4


def test_warm_only_store(make_store, small_layout):
    s = make_store(hot_blocks=0, warm_blocks=4)
    keys = s.block_keys(list(range(16)))
    kv = random_kv(small_layout, 4)
    s.put(keys, kv).wait()
    assert [t.name for t in s.stats().tiers] == ["warm"]
    assert torch.equal(s.fetch(keys).wait(), kv)


def test_lru_evicts_leaves_first_and_keeps_prefix_closed(make_store, small_layout):
    s = make_store(hot_blocks=0, warm_blocks=4)
    a = s.block_keys(list(range(16)))
    s.put(a, random_kv(small_layout, 4)).wait()
    b = s.block_keys(list(range(1000, 1008)))
    assert s.put(b, random_kv(small_layout, 2)).wait() == 2
    # the two leaves of chain a went, its prefix stayed
    assert s.lookup(a) == 2 and s.lookup(b) == 2


def test_pinned_blocks_survive_pressure(make_store, small_layout):
    s = make_store(hot_blocks=0, warm_blocks=4)
    a = s.block_keys(list(range(16)))
    s.put(a, random_kv(small_layout, 4)).wait()
    with s.pin(a) as receipt:
        assert len(receipt) == 4 and s.stats().pinned_blocks == 4
        b = s.block_keys(list(range(1000, 1008)))
        assert s.put(b, random_kv(small_layout, 2)).wait() == 0
        assert s.stats().put_dropped == 2 and s.lookup(a) == 4
        assert s.evict(a) == 0
    assert s.stats().pinned_blocks == 0
    assert s.put(b, random_kv(small_layout, 2)).wait() == 2


def test_pin_unpin_counts(make_store, small_layout):
    s = make_store()
    a = s.block_keys(list(range(16)))
    s.put(a[:2], random_kv(small_layout, 2)).wait()
    r1 = s.pin(a)
    assert len(r1) == 2  # only held leading blocks are pinned
    r2 = s.pin(a)
    r1.release()
    r1.release()  # idempotent
    assert s.stats().pinned_blocks == 2
    assert s.unpin(a) == 2
    assert s.unpin(a) == 0
    r2.release()


def test_evict_removes_descendants(make_store, small_layout):
    s = make_store()
    keys = s.block_keys(list(range(24)))
    s.put(keys, random_kv(small_layout, 6)).wait()
    assert s.evict(keys[2:3]) == 4  # block 2 and its descendants 3..5
    assert s.lookup(keys) == 2
    assert s.evict() == 2 and s.stats().blocks == 0


def test_evict_bad_tier(make_store):
    s = make_store()
    with pytest.raises(ConfigError, match="tier"):
        s.evict(tier="ssd")


def test_stats_add_up(make_store, small_layout):
    s = make_store(hot_blocks=2, warm_blocks=3)
    ks = s.block_keys(list(range(40)))
    s.put(ks, random_kv(small_layout, 10)).wait()
    st = s.stats()
    assert st.put_blocks + st.put_duplicates + st.put_dropped == 10
    assert 0 < st.blocks <= 5
    for t in st.tiers:
        assert t.used_bytes == t.blocks * small_layout.block_nbytes
    assert sum(t.blocks for t in st.tiers) == st.blocks
    assert s.lookup(ks) + 0 == st.blocks
    st = s.stats()
    assert st.hits + st.misses == 10 and 0 < st.hit_rate < 1


def test_concurrent_put_fetch_threads(make_store, small_layout):
    s = make_store(hot_blocks=6, warm_blocks=12)
    errors = []

    def worker(seed):
        try:
            for i in range(30):
                toks = [seed * 1000 + (i % 5)] * 4 + list(range(12))
                keys = s.block_keys(toks)
                kv = random_kv(small_layout, 4, seed=seed * 100 + (i % 5))
                s.put(keys, kv).wait()
                got = s.fetch(keys).wait()
                assert torch.equal(got, kv[: got.shape[0]])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s.flush()  # background promotions release their pins
    assert s.stats().pinned_blocks == 0


def test_float32_and_mla_layouts(make_store):
    for lay in (
        KVLayout(num_layers=3, num_kv_heads=1, head_dim=8, dtype=torch.float32, block_tokens=2),
        KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, kv_planes=1, dtype=torch.float16),
    ):
        blocks = (64 << 10) // lay.block_nbytes
        s = make_store(hot_blocks=blocks, warm_blocks=blocks, layout=lay)
        keys = s.block_keys(list(range(lay.block_tokens * 3)))
        kv = random_kv(lay, 3)
        s.put(keys, kv).wait()
        assert torch.equal(s.fetch(keys).wait(), kv)


def test_shared_memory_lease_and_granted_put(small_layout, tmp_path):
    shm = f"/dev/shm/kvstore-test-{os.getpid()}-{id(tmp_path)}"
    s = open_store(tmp_path / "s", layout=small_layout, model_id="m", device="cpu",
                   cpu_capacity=8 * small_layout.block_nbytes, warm_shared_memory=shm)
    try:
        keys = s.block_keys(list(range(16)))
        kv = random_kv(small_layout, 4)
        grant = s.grant_put(keys)
        assert grant.positions == [0, 1, 2, 3] and s.lookup(keys) == 0  # nothing visible yet
        assert s.grant_put(keys).keys == []  # granted keys count as held for a second put
        flat = kv.reshape(4, -1).view(torch.uint8)
        for p, slot in zip(grant.positions, grant.slots, strict=True):
            s.warm_slab[slot].copy_(flat[p])
        assert s.commit_put(grant) == 4 and s.lookup(keys) == 4
        s.flush()  # the disk writer pins blocks while it writes them
        got, slots = s.lease_warm(keys)
        assert got == list(keys) and s.stats().pinned_blocks == 4
        assert torch.equal(s.warm_slab[slots].view(small_layout.dtype).view(kv.shape), kv)
        s.release_lease(got)
        assert s.stats().pinned_blocks == 0
        other = s.block_keys(list(range(100, 108)))
        g2 = s.grant_put(other)
        s.abort_put(g2)  # a client died mid-put
        assert s.lookup(other) == 0 and s.stats().pinned_blocks == 0
        s.flush()
    finally:
        s.close()
    assert not os.path.exists(shm)
