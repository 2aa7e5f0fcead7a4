"""LocalSink: a store's KV events, encoded as on the wire, handed to an in-process consumer."""

import pytest
import torch
from conftest import keyed_kv

from kvstore import KVLayout, open_store
from kvstore.events.codec import decode_batch
from kvstore.events.local import LocalSink
from kvstore.events.types import BlockRemoved, BlockStored
from kvstore.routing.index import PrefixIndex

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
K = [bytes([i]) * 32 for i in range(1, 9)]


def sink(batched=False):
    got: list = []
    return LocalSink(lambda b: got.append(decode_batch(b)), block_size=4, batched=batched), got


def test_each_change_is_one_decodable_batch():
    s, got = sink()
    s.stored("warm", K[:3], [None, K[0], K[1]])
    s.removed("warm", [K[2]])
    assert len(got) == 2 and s.batches == 2
    (ev,) = got[0].events
    assert isinstance(ev, BlockStored) and ev.block_hashes == tuple(K[:3])
    assert ev.parent_block_hash is None and ev.block_size == 4 and ev.medium == "CPU"
    assert got[1].events == (BlockRemoved((K[2],), "CPU"),)
    assert len(s) == 2


def test_batched_holds_until_flush_and_merges_one_by_one_removals():
    s, got = sink(batched=True)
    s.stored("warm", K[:4], [None, K[0], K[1], K[2]])
    for k in (K[3], K[2]):  # a put's evictions come one victim at a time
        s.removed("warm", [k])
    s.stored("disk", K[:1], [None])
    assert got == []
    s.flush()
    s.flush()  # nothing pending: no empty batch
    assert len(got) == 1 and s.batches == 1
    stored, removed, disk = got[0].events
    assert removed == BlockRemoved((K[3], K[2]), "CPU")
    assert disk.medium == "STORAGE"
    assert len(stored.block_hashes) == 4


def test_bad_calls_are_refused():
    s, _ = sink()
    with pytest.raises(ValueError, match="tier must be one of"):
        s.stored("remote", K[:1], [None])
    with pytest.raises(ValueError, match="1 keys but 2 parents"):
        s.stored("warm", K[:1], [None, None])
    with pytest.raises(ValueError, match="block_size"):
        LocalSink(lambda b: None, block_size=0)


def test_an_index_fed_by_a_store_matches_the_store_through_evictions():
    index = PrefixIndex()
    index.add_engine("e")
    feed = LocalSink(lambda b: index.apply("e", decode_batch(b).events), block_size=4,
                     batched=True)
    with open_store(None, layout=LAY, model_id="m", device="cpu",
                    cpu_capacity=6 * LAY.block_nbytes,
                    events=feed) as s:
        chains = []
        for p in range(4):
            tokens = list(range(100 * p, 100 * p + 16))
            keys = s.block_keys(tokens)
            s.put(keys, keyed_kv(LAY, keys)).wait()
            feed.flush()
            chains.append(keys)
            for c in chains:  # the index's leading run is the store's, evictions included
                assert index.match(list(c), ["e"]).blocks[0] == s.lookup(c)
        s.evict(chains[-1][2:])
        feed.flush()
        assert index.match(list(chains[-1]), ["e"]).blocks[0] == s.lookup(chains[-1]) == 2
