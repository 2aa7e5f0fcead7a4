"""Regression tests for issue 13's store-level defects: never wrong KV, never a lost block.

Each test reproduces a defect found by an adversarial run against the public API.
"""

from __future__ import annotations

import lmdb
import torch
from conftest import bit_equal, keyed_kv

from kvstore import KVLayout, open_store
from kvstore.tiers.disk import index as di

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
BN = LAY.block_nbytes


def opened(path, *, warm=64, model="nwk/test", **kw):
    return open_store(path, layout=LAY, model_id=model, device="cpu", gpu_capacity=0,
                      cpu_capacity=warm * BN, disk_capacity="64MiB", **kw)


def chains(s, n_chains=4, blocks=6):
    return [s.block_keys([c * 1000 + t for t in range(blocks * LAY.block_tokens)])
            for c in range(n_chains)]


def _mutate_records(path, fn):
    """Apply ``fn(txn, blocks_db)`` to the closed store's index in one write transaction."""
    env = lmdb.open(str(path / "index"), max_dbs=10, subdir=True)
    try:
        with env.begin(write=True) as txn:
            fn(txn, env.open_db(di.DB_BLOCKS, txn=txn, create=False))
    finally:
        env.close()


def _check_fetch(s, keys) -> int:
    """Fetch ``keys``; every block returned must hold exactly its own key's bytes."""
    got = s.fetch(keys).wait()
    n = got.shape[0]
    assert bit_equal(got, keyed_kv(LAY, keys[:n])), "wrong KV served"
    return n


def test_flipped_stored_bytes_never_serves_another_blocks_kv(tmp_path):
    """A bit flip in the stored-bytes field of one record: fetches of other chains that reuse
    the warm slots freed by the failed read must still get their own bytes (the reading threads
    finish before any slot is released), and no fetch raises."""
    with opened(tmp_path) as s:
        cs = chains(s)
        for keys in cs:
            assert s.put(keys, keyed_kv(LAY, keys)).wait() == len(keys)
        s.flush()
        victim = di.dbkey(s.namespace_id, bytes(cs[0][1]))

    def flip(txn, db):
        raw = bytearray(txn.get(victim, db=db))
        raw[24 + 2] ^= 1 << 4  # bit 20 of the u64 stored-bytes field
        txn.put(victim, bytes(raw), db=db)

    _mutate_records(tmp_path, flip)
    with opened(tmp_path, warm=16) as s:
        for _ in range(30):
            assert _check_fetch(s, cs[0]) <= 1
            assert _check_fetch(s, cs[1]) == len(cs[1])
            assert _check_fetch(s, cs[1]) == len(cs[1])
            s.evict(cs[1], tier="warm")
        assert s.stats().damaged >= 1
        # the damaged block and everything after it is a miss, the rest of the store is whole
        assert s.lookup(cs[0]) == 1
        for keys in cs[1:]:
            assert _check_fetch(s, keys) == len(keys)


def test_swapped_records_are_a_miss_not_each_others_kv(tmp_path):
    """Two records with their location and checksum fields swapped: the checksum is bound to
    the key, so neither block is served as the other."""
    with opened(tmp_path) as s:
        cs = chains(s, n_chains=2)
        for keys in cs:
            s.put(keys, keyed_kv(LAY, keys)).wait()
        s.flush()
        a, b = (di.dbkey(s.namespace_id, bytes(c[2])) for c in cs)

    def swap(txn, db):
        ra, rb = bytearray(txn.get(a, db=db)), bytearray(txn.get(b, db=db))
        ra[8:48], rb[8:48] = rb[8:48], ra[8:48]  # segment, offset, sizes, checksum
        txn.put(a, bytes(ra), db=db)
        txn.put(b, bytes(rb), db=db)

    _mutate_records(tmp_path, swap)
    with opened(tmp_path) as s:
        assert _check_fetch(s, cs[0]) == 2
        assert _check_fetch(s, cs[1]) == 2
        assert s.stats().damaged == 2


def test_same_key_twice_in_one_put_leaks_no_slot(tmp_path):
    with opened(tmp_path, warm=64) as s:
        keys = s.block_keys(list(range(4)))
        a = keys[0]
        kv = keyed_kv(LAY, [a, a])
        for _ in range(8):
            assert s.put([a, a], kv).wait() == 1
            s.flush()
            s.evict()
        st = s.stats().tier("warm")
        assert st.blocks == 0
        # every slot is usable again: a put of 64 distinct blocks fits entirely
        many = s.block_keys(list(range(64 * LAY.block_tokens)))
        assert s.put(many, keyed_kv(LAY, many)).wait() == 64


def test_other_namespace_cannot_evict_a_tenants_flushed_blocks(tmp_path):
    """Embedded, two namespaces on one path: ``evict`` with the victim's keys is a no-op."""
    with opened(tmp_path, model="victim") as v, opened(tmp_path, model="attacker") as a:
        keys = v.block_keys(list(range(8 * LAY.block_tokens)))
        assert v.put(keys, keyed_kv(LAY, keys)).wait() == 8
        v.flush()
        raw = [bytes(k) for k in keys]  # plain bytes: a KeyChain of another store is refused
        assert a.evict(raw) == 0
        assert a.evict(raw, tier="disk") == 0
        assert a.evict() == 0
        v.evict(keys, tier="warm")  # the victim's own memory copy goes: disk must still hold it
        assert v.lookup(keys) == 8
        assert _check_fetch(v, keys) == 8
    with opened(tmp_path, model="victim") as v:
        assert v.lookup(keys) == 8


def test_other_namespace_cannot_shadow_a_tenants_future_blocks(tmp_path):
    """The attacker puts the victim's keys first (with its own bytes): the victim's own later
    put + flush is not skipped, and after a restart the victim has all of its blocks."""
    with opened(tmp_path, model="victim") as v:
        keys = v.block_keys(list(range(8 * LAY.block_tokens)))
    raw = [bytes(k) for k in keys]
    with opened(tmp_path, model="attacker") as a:
        junk = torch.zeros(LAY.batch_shape(8), dtype=LAY.dtype)
        assert a.put(raw, junk).wait() == 8
        a.flush()
    with opened(tmp_path, model="victim") as v:
        assert v.lookup(keys) == 0
        assert v.put(keys, keyed_kv(LAY, keys)).wait() == 8
        v.flush()
    with opened(tmp_path, model="victim", warm=4) as v:
        assert v.lookup(keys) == 8
        assert _check_fetch(v, keys) == 8
    with opened(tmp_path, model="attacker") as a:
        got = a.fetch(raw).wait()  # the attacker keeps its own bytes, never the victim's
        assert got.shape[0] == 8 and bit_equal(got, junk)
