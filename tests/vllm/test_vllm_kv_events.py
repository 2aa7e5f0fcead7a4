"""kvstore's KV events read by consumers written against vLLM's own event classes
(``vllm.distributed.kv_events``), and vLLM's own publisher read by kvstore's subscriber."""

from __future__ import annotations

import time

import pytest
import zmq

from kvstore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventsConfig,
    encode_batch,
)
from kvstore.events.publisher import EventPublisher
from kvstore.routing import EngineSpec, Subscriber

kv_events = pytest.importorskip("vllm.distributed.kv_events")  # the vLLM CI stage only
msgspec = pytest.importorskip("msgspec")
V = kv_events

A, B = b"a" * 32, b"b" * 32


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def vllm_stored(hashes, parent, medium, tokens=(), size=16):
    return V.BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                         token_ids=list(tokens), block_size=size, lora_id=None, medium=medium,
                         lora_name=None)


CASES = [
    (EventBatch(1.25, (BlockStored((A, B), None, (), 16, "CPU"),), 0),
     V.KVEventBatch(ts=1.25, events=[vllm_stored([A, B], None, "CPU")], data_parallel_rank=0)),
    (EventBatch(2.0, (BlockStored((B,), A, (1, 2, 3, 4), 4, "STORAGE"),
                      BlockRemoved((A,), "GPU"), AllBlocksCleared()), None),
     V.KVEventBatch(ts=2.0, events=[vllm_stored([B], A, "STORAGE", (1, 2, 3, 4), 4),
                                    V.BlockRemoved(block_hashes=[A], medium="GPU"),
                                    V.AllBlocksCleared()])),
    (EventBatch(3.5, (BlockStored((7, 2**63), 5, (), 16, None),), 3),  # vLLM's int hashes
     V.KVEventBatch(ts=3.5, events=[vllm_stored([7, 2**63], 5, None)], data_parallel_rank=3)),
    (EventBatch(4.0, (), 0), V.KVEventBatch(ts=4.0, events=[], data_parallel_rank=0)),
]


@pytest.mark.parametrize("ours, theirs", CASES)
def test_kvstore_writes_the_bytes_vllm_writes(ours, theirs):
    assert encode_batch(ours) == msgspec.msgpack.encode(theirs)


@pytest.mark.parametrize("ours, theirs", CASES)
def test_vllm_decodes_kvstore_events(ours, theirs):
    got = msgspec.msgpack.Decoder(type=V.KVEventBatch).decode(encode_batch(ours))
    assert got == theirs


# vLLM before 0.28 declared its events ``array_like``: the same classes, with that option
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class Stored(_Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class Cleared(_Event, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


def test_array_layout_is_what_array_like_structs_read():
    ours = EventBatch(1.0, (BlockStored((A,), None, (), 16, "CPU"), BlockRemoved((A,), "CPU"),
                            AllBlocksCleared()), 0)
    want = Batch(1.0, [Stored([A], None, [], 16, None, "CPU", None), Removed([A], "CPU"),
                       Cleared()], 0)
    assert msgspec.msgpack.Decoder(type=Batch).decode(encode_batch(ours, "array")) == want
    assert encode_batch(ours, "array") == msgspec.msgpack.encode(want)


def test_a_vllm_style_consumer_follows_kvstore_and_replays(tmp_path):
    """The live stream and the 8-byte replay request, as vLLM's example subscriber uses them."""
    dec = msgspec.msgpack.Decoder(type=V.KVEventBatch)
    with EventPublisher(EventsConfig(f"ipc://{tmp_path}/ev", heartbeat_s=0.05)) as pub:
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVTIMEO, 10_000)
            sub.connect(pub.endpoint)
            topic, seq, payload = sub.recv_multipart()  # a heartbeat: joined
            sink = pub.sink(b"n" * 32, 16)
            sink.stored("hot", [A, B], [None, A])
            events = []
            while not events:
                topic, seq, payload = sub.recv_multipart()
                events = dec.decode(payload).events
            assert events == [vllm_stored([A, B], None, "GPU")]
            req = ctx.socket(zmq.DEALER)
            req.setsockopt(zmq.RCVTIMEO, 10_000)
            req.connect(pub.replay_endpoint)
            req.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = []
            while True:
                _, topic, seq_b, payload = req.recv_multipart()
                if seq_b == V.ZmqEventPublisher.END_SEQ:
                    break
                replayed.append(dec.decode(payload))
            assert replayed[0].events == [V.AllBlocksCleared()]
            assert any(b.events == events for b in replayed)
        finally:
            ctx.destroy(linger=0)


def test_kvstore_follows_vllms_own_publisher(tmp_path):
    pub = V.ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/vllm",
                              replay_endpoint=f"ipc://{tmp_path}/vllm.replay")
    try:
        spec = EngineSpec("vllm", f"ipc://{tmp_path}/vllm",
                          replay_endpoint=f"ipc://{tmp_path}/vllm.replay")
        with Subscriber([spec], silence_s=None, request_timeout_s=1.0) as sub:
            hashes = [11, 12, 13]

            def step():
                pub.publish(V.KVEventBatch(ts=time.time(),
                                           events=[vllm_stored(hashes, None, "GPU")]))
                return sub.index.match(hashes).blocks == (3,)

            assert wait_until(step, timeout=30), sub.stats()
            pub.publish(V.KVEventBatch(ts=time.time(), events=[
                V.BlockRemoved(block_hashes=[12], medium="GPU")]))
            assert wait_until(lambda: sub.index.match(hashes).blocks == (1,), timeout=30)
            st = sub.stats()[0]
            assert not st.snapshot_supported and st.bad_messages == 0 and st.state == "live"
    finally:
        pub.shutdown()
