"""Adversarial reliability pass, round 13: upgrades and version skew. Earlier rounds attacked
one kvstore at a time; this one attacks an operator's upgrade (and rollback) under running
stores: a store directory written by an older or newer kvstore, a daemon and clients of
different releases, a pack exported by one release and imported by another, an events
subscriber of one release on a publisher of another.

The bugs were found by running real older trees out of git history against this one (see
docs/operations.md, "Upgrades"); the tests here fabricate the older or newer release's
artifacts directly (an index in the key layout an older release wrote, a format version
field of another release, a hello reply of an older or newer daemon, a pack header of
another pack format, an event batch with a newer publisher's trailing field), so they do not
depend on git history being present. The promise checked: a pair that can work serves
exactly the bytes put; a pair that cannot is a clear, specific error naming both versions
and what to do, never silent misses, and never damage to the store.
"""

from __future__ import annotations

import os

import lmdb
import msgpack
import pytest
import torch
from support.admin import build_store, kv_for, open_test_store, small_layout

from kvstore.cli import main as cli
from kvstore.errors import FormatVersionError
from kvstore.events.codec import decode_batch
from kvstore.packs import PackError, export_pack, import_pack
from kvstore.tiers.disk import index as di
from kvstore.tiers.disk.recover import recover
from kvstore.wire.handshake import HelloReply

MODEL = "round13/model"


def _index_bytes(store) -> bytes:
    with open(os.path.join(store, "index", "data.mdb"), "rb") as f:
        return f.read()


def _edit_index(store, fn) -> None:
    env = lmdb.open(os.path.join(str(store), "index"), max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            fn(env, txn)
    finally:
        env.close()


def _set_format(store, version: int) -> None:
    def put(env, txn):
        txn.put(di.META_FORMAT, di.U32.pack(version), db=env.open_db(di.DB_META, txn=txn))
    _edit_index(store, put)


def _all_read(store, chains) -> bool:
    """Every block of every chain is found and holds exactly the bytes put."""
    lay = small_layout()
    with open_test_store(store, MODEL) as s:
        for keys in chains:
            if s.lookup(keys) != len(keys):
                return False
            got = s.fetch(keys).wait()
            if not torch.equal(got.view(torch.uint8), kv_for(keys, lay).view(torch.uint8)):
                return False
    return True


def _to_legacy_key_space(env, txn) -> None:
    """Rewrite the index as kvstore before commit 067ffff wrote format 2: blocks and
    children under the bare 32-byte key, lru under last access ‖ key (no namespace id)."""
    for name, strip in ((di.DB_BLOCKS, slice(32, None)), (di.DB_CHILDREN, slice(32, None))):
        db = env.open_db(name, txn=txn)
        items = list(txn.cursor(db=db))
        txn.drop(db, delete=False)
        for k, v in items:
            txn.put(k[strip], v, db=db)
    db = env.open_db(di.DB_LRU, txn=txn)
    items = list(txn.cursor(db=db))
    txn.drop(db, delete=False)
    for k, v in items:
        txn.put(k[:8] + k[40:], v, db=db)


# -- a format-2 store from before per-namespace key spaces ---------------------------------------

def test_store_from_before_per_namespace_key_spaces_is_refused_then_recovered(tmp_path):
    """Found with the tree of 6f88267 (the first format-2 release) and this one: its store
    says format 2, but its index keys are the bare 32-byte key (per-namespace key spaces came
    one commit later without a format bump). This kvstore opened it, every lookup missed, and
    `kvstore ls` said the store held no blocks: a working-looking empty cache (and
    `verify --fix` would drop every block as a bad record). It is now a FormatVersionError at
    open naming `kvstore recover`, which rebuilds the index and keeps every block."""
    store = str(tmp_path / "s")
    chains = build_store(store, MODEL, prompts=3, blocks=3)
    _edit_index(store, _to_legacy_key_space)
    with pytest.raises(FormatVersionError) as ei:
        open_test_store(store, MODEL)
    msg = str(ei.value)
    assert "067ffff" in msg and "kvstore recover --store" in msg and "32 bytes" in msg
    assert cli(["ls", "--store", store]) == 2
    assert cli(["verify", "--fix", "-y", "--store", store]) == 2  # nothing dropped
    res = recover(store)  # not intact for this kvstore: rebuilt without --force
    assert res.done and res.blocks_recovered == 9
    assert _all_read(store, chains)


def test_rollback_records_do_not_hide_this_release_blocks(tmp_path):
    """A rollback to that release writes bare-key records into a store of this layout; rolled
    forward again, the store still opens and serves every block this release put."""
    store = str(tmp_path / "s")
    chains = build_store(store, MODEL, prompts=2, blocks=3)

    def add_legacy(env, txn):
        db = env.open_db(di.DB_BLOCKS, txn=txn)
        k, v = next(iter(txn.cursor(db=db)))
        for i in range(3):  # bare keys sorting before every namespaced one
            txn.put(bytes([0] * 31 + [i]), v, db=db)
    _edit_index(store, add_legacy)
    assert _all_read(store, chains)


# -- recover on a store of another format version ------------------------------------------------

@pytest.mark.parametrize("version", [1, 3])
def test_recover_leaves_a_store_of_another_format_alone(tmp_path, version):
    """Found with the tree of df5e1f1 (format 1): `kvstore recover` called an index of
    another format version "damaged", moved it aside for an empty format-2 index (its
    format-1 segments cannot be recovered) and exited 0 with "engines can start again": the
    release that wrote the store could no longer read it. The same held for a newer format
    (a rollback's recover destroying the newer release's index). Now it is refused, exit 2,
    and nothing is touched."""
    store = str(tmp_path / "s")
    chains = build_store(store, MODEL, prompts=2, blocks=3)
    _set_format(store, version)
    before = _index_bytes(store)
    with pytest.raises(FormatVersionError) as ei:
        recover(store)
    assert f"format version {version}, this kvstore uses 2" in str(ei.value)
    assert cli(["recover", "--store", store]) == 2
    assert _index_bytes(store) == before
    assert not [d for d in os.listdir(store) if d.startswith("index.damaged-")]
    with pytest.raises(FormatVersionError) as ei:  # the open names both versions too
        open_test_store(store, MODEL)
    assert f"format version {version}" in str(ei.value) and "format version 2" in str(ei.value)
    _set_format(store, 2)  # the release that wrote it still reads every block
    assert _all_read(store, chains)


def test_recover_force_still_rebuilds_a_damaged_format_record(tmp_path):
    """--force is the way out when the version record itself is what is damaged: the
    segments are this format, so every block comes back."""
    store = str(tmp_path / "s")
    chains = build_store(store, MODEL, prompts=2, blocks=3)
    _set_format(store, 3)
    res = recover(store, force=True)
    assert res.done and res.blocks_recovered == 6 and res.index_state == "damaged"
    assert _all_read(store, chains)


# -- what held: the daemon's hello across releases, packs, event batches -------------------------

def _reply(n: int) -> list:
    full = [1, b"n" * 32, "/dev/shm/x", 8, 1024, 1 << 20, 64, 16, "kvstore 0.1.0", b"i" * 16,
            [b"f" * 16], "new"]
    return (full + ["a newer daemon's field", [1, 2]])[:n]


@pytest.mark.parametrize("n", [9, 12, 14])
def test_hello_reply_of_an_older_or_newer_daemon_is_read(n):
    r = HelloReply.from_wire(_reply(n))
    assert r.namespace_id == b"n" * 32 and r.max_keys == 64
    assert r.instance == (b"" if n == 9 else b"i" * 16)


def test_pack_of_another_pack_format_is_refused_naming_both(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    build_store(src, MODEL, prompts=2, blocks=2)
    pack = str(tmp_path / "p.kvpack")
    export_pack(src, MODEL, pack)
    with open(pack, "r+b") as f:
        head = f.read(4096)
        at = head.index(b'"kvstore.pack":"1"')
        f.seek(at)
        f.write(b'"kvstore.pack":"2"')
    with pytest.raises(PackError) as ei:
        import_pack(pack, dst, create=True)
    assert ei.value.kind == "version"
    assert "'2'" in str(ei.value) and "format 1" in str(ei.value)
    assert not os.path.exists(os.path.join(dst, "index"))


def test_event_batch_with_a_newer_publisher_trailing_field_is_read():
    """A newer publisher (vLLM's msgspec EventBatch) appending a field to the batch array:
    every batch was refused (EventFormatError, a debug log), so a router fed by it kept an
    empty index. Trailing fields are now ignored, as they already were in array events."""
    ev = ["BlockStored", [b"k" * 32], None, [1, 2, 3, 4], 4, None, "cpu", None]
    payload = msgpack.packb([1.5, [ev], 0, {"future": 1}], use_bin_type=True)
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 0 and len(batch.events) == 1
    assert batch.events[0].block_hashes == (b"k" * 32,)
