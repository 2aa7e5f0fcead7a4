"""What ``kvstore serve --kv-events`` publishes: puts, leases, evictions, the disk inventory
a restarted daemon starts with, and a namespace closed for room; read back through the
daemon's snapshot socket."""

import argparse

import pytest
import torch
import zmq
from conftest import wait_until
from support.events import EventDaemon

from kvstore import KVLayout, connect
from kvstore.daemon.event_options import add_arguments, config_from_args
from kvstore.errors import ConfigError
from kvstore.events import AllBlocksCleared, BlockStored, decode_batch
from kvstore.events import frames as fr

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16, block_tokens=4)


def kv(n):
    return torch.randn(LAYOUT.batch_shape(n)).to(LAYOUT.dtype)


def snapshot(endpoint):
    """The daemon's state as (medium, block, parent) triples."""
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.RCVTIMEO, 20_000)
        d.connect(endpoint + ".replay")
        d.send_multipart(fr.snapshot_request())
        events = []
        while (msg := fr.parse_reply(d.recv_multipart())) is not None:
            events.extend(decode_batch(msg.payload).events)
    finally:
        ctx.destroy(linger=0)
    assert events[0] == AllBlocksCleared()
    out = set()
    for e in events[1:]:
        assert isinstance(e, BlockStored) and e.block_size == 4 and e.token_ids == ()
        parent = e.parent_block_hash
        for h in e.block_hashes:
            out.add((e.medium, h, parent))
            parent = h
    return out


def chain_of(keys, medium):
    return {(medium, k, keys[i - 1] if i else None) for i, k in enumerate(keys)}


@pytest.fixture
def daemon(tmp_path):
    d = EventDaemon(tmp_path / "store", tmp_path / "run" / "s.sock", f"ipc://{tmp_path}/ev",
                    "--cpu-capacity", "1MiB", "--disk-capacity", "64MiB", "--max-namespaces", "1")
    d.start()
    yield d
    assert d.stop() == 0, d.log()


def test_puts_evictions_restart_and_leases(daemon):
    with connect(daemon.socket_path, layout=LAYOUT, model_id="m", device="cpu") as c:
        keys = c.block_keys(list(range(20)))
        assert c.put(keys, kv(5)).wait() == 5
        c.flush()  # the store reports the writer's disk copies too
        assert wait_until(lambda: snapshot(daemon.endpoint)
                          == chain_of(keys, "CPU") | chain_of(keys, "STORAGE"))
        c.evict(keys[3:])  # from the store: memory and disk
        assert wait_until(lambda: snapshot(daemon.endpoint)
                          == chain_of(keys[:3], "CPU") | chain_of(keys[:3], "STORAGE"))
    assert daemon.stop() == 0
    daemon.start()
    # the new instance announces what is on disk (the flush wrote the first three)
    assert snapshot(daemon.endpoint) == chain_of(keys[:3], "STORAGE")
    with connect(daemon.socket_path, layout=LAYOUT, model_id="m", device="cpu") as c:
        assert c.lookup(keys) == 3
        out = c.fetch(keys).wait()  # a lease stages them in the warm tier
        assert out.shape[0] == 3
        assert wait_until(lambda: snapshot(daemon.endpoint)
                          == chain_of(keys[:3], "STORAGE") | chain_of(keys[:3], "CPU"))
        c.evict(keys[1:], tier="disk")
        assert wait_until(lambda: snapshot(daemon.endpoint)
                          == chain_of(keys[:1], "STORAGE") | chain_of(keys[:3], "CPU"))


def test_a_namespace_closed_for_room_keeps_its_disk_blocks(daemon):
    with connect(daemon.socket_path, layout=LAYOUT, model_id="m1", device="cpu") as c:
        k1 = c.block_keys(list(range(8)))
        c.put(k1, kv(2)).wait()
        c.flush()
    # --max-namespaces 1: a second model closes the first (its warm tier goes, disk stays)
    with connect(daemon.socket_path, layout=LAYOUT, model_id="m2", device="cpu") as c:
        k2 = c.block_keys(list(range(8)))
        c.put(k2, kv(2)).wait()
        # k2 may reach disk meanwhile (the background writer): STORAGE for it is optional
        assert wait_until(lambda: chain_of(k1, "STORAGE") | chain_of(k2, "CPU")
                          <= (got := snapshot(daemon.endpoint))
                          and got <= chain_of(k1, "STORAGE") | chain_of(k2, "CPU")
                          | chain_of(k2, "STORAGE"))


def test_memory_only_daemon_announces_no_disk(tmp_path):
    d = EventDaemon(tmp_path / "store", tmp_path / "run" / "s.sock", f"ipc://{tmp_path}/ev",
                    "--cpu-capacity", "1MiB", "--disk-capacity", "0")
    with d, connect(d.socket_path, layout=LAYOUT, model_id="m", device="cpu") as c:
        keys = c.block_keys(list(range(8)))
        c.put(keys, kv(2)).wait()
        assert wait_until(lambda: snapshot(d.endpoint) == chain_of(keys, "CPU"))
        c.evict()
        assert wait_until(lambda: snapshot(d.endpoint) == set())


def test_a_taken_endpoint_stops_the_daemon_with_a_clear_error(tmp_path):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUB)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    try:
        d = EventDaemon(tmp_path / "store", tmp_path / "run" / "s.sock",
                        f"tcp://127.0.0.1:{port}", "--disk-capacity", "0")
        with pytest.raises(RuntimeError, match="cannot bind the KV events sockets"):
            d.start()
    finally:
        ctx.destroy(linger=0)


def test_options():
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--kv-events", "tcp://*:5557", "--kv-events-topic",
                                         "kv@h@m", "--kv-events-layout", "array"]))
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.topic, cfg.layout) == (
        "tcp://*:5557", "tcp://*:5558", "kv@h@m", "array")
    assert config_from_args(p.parse_args([])) is None
    with pytest.raises(ConfigError, match="needs --kv-events"):
        config_from_args(p.parse_args(["--kv-events-replay", "tcp://*:1"]))
    for bad in ("udp://x:1", "tcp://host"):
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--kv-events", bad])
        assert e.value.code == 2
