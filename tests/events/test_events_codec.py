"""vLLM's KV event schema: kvstore's encoder against bytes vLLM's own encoder wrote, the
decoder on both layouts, and on garbage (it raises EventFormatError and nothing else)."""

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFormatError,
    decode_batch,
    encode_batch,
)
from kvstore.events.codec import DEFAULT_MAX_PAYLOAD

A = b"a" * 32

#: msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[A],
#: parent_block_hash=None, token_ids=[1, 2], block_size=16, lora_id=None, medium="CPU",
#: lora_name=None), BlockRemoved(block_hashes=[A], medium="CPU"), AllBlocksCleared()]))
#: with vLLM 0.32's classes (vllm/distributed/kv_events.py), data_parallel_rank unset
VLLM_032_BYTES = (
    b"\x93\xcb?\xf8\x00\x00\x00\x00\x00\x00\x93\x88\xa4type\xabBlockStored\xacblock_hashes"
    b"\x91\xc4 " + A + b"\xb1parent_block_hash\xc0\xa9token_ids\x92\x01\x02\xaablock_size"
    b"\x10\xa7lora_id\xc0\xa6medium\xa3CPU\xa9lora_name\xc0\x83\xa4type\xacBlockRemoved"
    b"\xacblock_hashes\x91\xc4 " + A + b"\xa6medium\xa3CPU\x81\xa4type\xb0AllBlocksCleared\xc0"
)
GOLDEN = EventBatch(1.5, (BlockStored((A,), None, (1, 2), 16, "CPU"),
                          BlockRemoved((A,), "CPU"), AllBlocksCleared()), None)


def test_encoder_writes_what_vllm_writes():
    assert encode_batch(GOLDEN) == VLLM_032_BYTES
    assert decode_batch(VLLM_032_BYTES) == GOLDEN


def test_array_layout_is_the_tagged_array_form():
    obj = msgpack.unpackb(encode_batch(GOLDEN, "array"))
    assert obj == [1.5, [["BlockStored", [A], None, [1, 2], 16, None, "CPU", None],
                         ["BlockRemoved", [A], "CPU"], ["AllBlocksCleared"]], None]
    assert decode_batch(encode_batch(GOLDEN, "array")) == GOLDEN


def test_older_publishers_decode():
    # vLLM 0.8-era events: array-like, no medium, 64-bit int hashes, no data_parallel_rank
    payload = msgpack.packb([2.0, [["BlockStored", [7, 2**64 - 1], None, [1] * 32, 16, None],
                                   ["BlockRemoved", [7]], ["AllBlocksCleared"]]])
    b = decode_batch(payload)
    assert b.data_parallel_rank is None
    assert b.events == (BlockStored((7, 2**64 - 1), None, (1,) * 32, 16, None),
                        BlockRemoved((7,), None), AllBlocksCleared())


def test_newer_fields_and_events_are_skipped():
    ev = {"type": "BlockStored", "block_hashes": [A], "parent_block_hash": None,
          "token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU",
          "lora_name": None, "group_idx": 0, "locality": "LOCAL", "session_id": "s"}
    payload = msgpack.packb([1.0, [ev, {"type": "SomethingNew", "x": 1}], 0], use_bin_type=True)
    assert decode_batch(payload).events == (BlockStored((A,), None, (), 16, "GPU"),)


@pytest.mark.parametrize("obj, why", [
    ({"ts": 1.0}, "array"),
    ([1.0], "array"),
    (["x", []], "ts"),
    ([1.0, {}], "events"),
    ([1.0, [], "rank"], "data_parallel_rank"),
    ([1.0, [5]], "map or a tagged array"),
    ([1.0, [{"block_hashes": []}]], "tag"),
    ([1.0, [["BlockStored", [A], None]]], "at least 4"),
    ([1.0, [{"type": "BlockStored", "block_hashes": [A]}]], "lacks"),
    ([1.0, [["BlockStored", [A], None, [], 0]]], "block_size"),
    ([1.0, [["BlockStored", [A], None, [], True]]], "block_size"),  # bool is no int
    ([1.0, [["BlockStored", [A], None, ["t"], 16]]], "token_ids"),
    ([1.0, [["BlockStored", [1.5], None, [], 16]]], "bytes or a 64-bit int"),
    ([1.0, [["BlockStored", [b""], None, [], 16]]], "empty"),
    ([1.0, [["BlockRemoved", "x"]]], "array"),
    ([1.0, [["BlockRemoved", [A], 3]]], "medium"),
])
def test_malformed_batches_are_refused(obj, why):
    with pytest.raises(EventFormatError, match=why):
        decode_batch(msgpack.packb(obj, use_bin_type=True))


def test_bounds():
    big = encode_batch(EventBatch(1.0, (BlockStored((A,) * 1000, None, (), 16, "CPU"),)))
    with pytest.raises(EventFormatError, match="exceeds"):
        decode_batch(big, max_payload=len(big) - 1)
    with pytest.raises(EventFormatError, match="trailing"):
        decode_batch(big + b"\x00")
    long_hash = msgpack.packb([1.0, [["BlockRemoved", [b"x" * 65], None]]], use_bin_type=True)
    with pytest.raises(EventFormatError):
        decode_batch(long_hash)


def test_truncated_payloads_never_decode():
    payload = encode_batch(GOLDEN)
    for n in range(len(payload)):
        with pytest.raises(EventFormatError):
            decode_batch(payload[:n])


hashes = st.one_of(st.binary(min_size=1, max_size=64),
                   st.integers(min_value=-(2**63), max_value=2**64 - 1))
media = st.sampled_from([None, "GPU", "CPU", "STORAGE", "X"])
events = st.one_of(
    st.builds(BlockStored, st.lists(hashes, max_size=5).map(tuple), st.none() | hashes,
              st.lists(st.integers(0, 2**32 - 1), max_size=8).map(tuple),
              st.integers(1, 1024), media, st.none() | st.integers(0, 100),
              st.none() | st.text(max_size=8)),
    st.builds(BlockRemoved, st.lists(hashes, max_size=5).map(tuple), media),
    st.just(AllBlocksCleared()),
)
batches = st.builds(EventBatch, st.floats(allow_nan=False, allow_infinity=False),
                    st.lists(events, max_size=6).map(tuple), st.none() | st.integers(0, 64))


@settings(max_examples=200, deadline=None)
@given(batches, st.sampled_from(["map", "array"]))
def test_roundtrip(batch, layout):
    assert decode_batch(encode_batch(batch, layout)) == batch


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_format_errors(data):
    with contextlib.suppress(EventFormatError):
        assert isinstance(decode_batch(data), EventBatch)


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.sampled_from(["type", "block_hashes", "medium", "block_size",
                                       "token_ids", "parent_block_hash", "x"]), inner,
                      max_size=5),
    max_leaves=25)


@settings(max_examples=150, deadline=None)
@given(st.lists(plain, max_size=3), st.sampled_from(["BlockStored", "BlockRemoved", "Other"]))
def test_random_structures_raise_only_format_errors(fields, tag):
    for events_obj in ([[tag, *fields]], [dict(zip(["type", "block_hashes", "medium"],
                                                   [tag, *fields], strict=False))]):
        payload = msgpack.packb([1.0, events_obj, 0], use_bin_type=True)
        try:
            b = decode_batch(payload, DEFAULT_MAX_PAYLOAD)
        except EventFormatError:
            continue
        assert isinstance(b, EventBatch)
