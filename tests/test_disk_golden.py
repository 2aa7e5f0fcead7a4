"""Golden bytes of the disk tier's on-disk format (docs/format.md). A change here is a format
change: bump DISK_FORMAT_VERSION and document it."""

from __future__ import annotations

import os

import lmdb
import torch
import xxhash
from safetensors import safe_open

from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tiers import disk_index as di
from kvstore.tiers import segments as seg
from kvstore.tiers.disk import DiskTier, DiskWrite, ReadStatus

K0 = bytes.fromhex("11" * 32)
K1 = bytes.fromhex("22" * 32)
NS = bytes(range(32))  # fixed namespace id of the golden literals
D0 = bytes(range(16))
D1 = bytes(range(16, 32))
T_US = 1_700_000_000_000_000
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16,
                  block_tokens=2, kv_planes=1)  # 16-byte blocks, shape [1, 1, 2, 1, 4]

# segment 0000000000000001 holding K0 (root) and K1 (child of K0), codec none
GOLDEN_SEGMENT = bytes.fromhex(
    "c8020000000000007b225f5f6d657461646174615f5f223a7b226b7673746f72652e666f726d6174223a2232222c226b"
    "7673746f72652e7365676d656e74223a2230303030303030303030303030303031222c22313131313131313131313131"
    "313131313131313131313131313131313131313131313131313131313131313131313131313131313131313131313131"
    "31313131223a226e6f6e653b31363b386334353439366333626130613739383b30303031303230333034303530363037"
    "303830393061306230633064306530663130313131323133313431353136313731383139316131623163316431653166"
    "3b222c223232323232323232323232323232323232323232323232323232323232323232323232323232323232323232"
    "3232323232323232323232323232323232323232223a226e6f6e653b31363b656561396566646466356164333164633b"
    "303030313032303330343035303630373038303930613062306330643065306631303131313231333134313531363137"
    "313831393161316231633164316531663b31313131313131313131313131313131313131313131313131313131313131"
    "313131313131313131313131313131313131313131313131313131313131313131227d2c223131313131313131313131"
    "313131313131313131313131313131313131313131313131313131313131313131313131313131313131313131313131"
    "3131313131223a7b226474797065223a22463136222c227368617065223a5b312c312c322c312c345d2c22646174615f"
    "6f666673657473223a5b302c31365d7d2c22323232323232323232323232323232323232323232323232323232323232"
    "32323232323232323232323232323232323232323232323232323232323232323232223a7b226474797065223a224631"
    "36222c227368617065223a5b312c312c322c312c345d2c22646174615f6f666673657473223a5b31362c33325d7d7d20"
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
)
# index record of K1: codec 0, segment 1, offset 736, 16/16 bytes, checksum C1, created and
# last access 1_700_000_000 s, namespace NS, parent K0
GOLDEN_RECORD = bytes.fromhex(
    "01000100000000000100000000000000e00200000000000010000000000000001000000000000000dc31adf5ddefa9ee"
    "00401e18240a060000401e18240a0600000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "1111111111111111111111111111111111111111111111111111111111111111"
)
GOLDEN_SEGINFO = bytes.fromhex(
    "0100000002000000f0020000000000002000000000000000200000000000000000401e18240a0600")
GOLDEN_TOTALS = bytes.fromhex(
    "0200000000000000200000000000000020000000000000000100000000000000f0020000000000002000000000000000")
GOLDEN_NAMESPACE = bytes.fromhex(
    "9d01a6676f6c64656ea472657631a7666c6f6174313601010201040001019192a161a162")


# block checksums: xxh3_64(data, seed=xxh3_64(namespace id ‖ key))
C0, C1 = 0x8C45496C3BA0A798, 0xEEA9EFDDF5AD31DC


def test_golden_block_checksums():
    assert seg.block_checksum(K0, NS, D0) == C0
    assert seg.block_checksum(K1, NS, D1) == C1
    seed = xxhash.xxh3_64_intdigest(NS + K1)
    assert xxhash.xxh3_64_intdigest(D1, seed=seed) == C1
    # bound to the key and the namespace: the same bytes under another identity fail
    assert seg.block_checksum(K0, NS, D1) != C1
    assert seg.block_checksum(K1, bytes(32), D1) != C1


def _entries():
    c0, c1 = C0, C1
    return [
        seg.SegmentEntry(K0.hex(), "F16", [1, 1, 2, 1, 4], D0, 16, seg.block_meta("none", 16, c0, NS, None)),
        seg.SegmentEntry(K1.hex(), "F16", [1, 1, 2, 1, 4], D1, 16, seg.block_meta("none", 16, c1, NS, K0)),
    ]


def test_golden_segment_bytes(tmp_path):
    path, size, offsets = seg.write_segment(str(tmp_path), 1, _entries())
    assert os.path.basename(path) == "0000000000000001.safetensors"
    with open(path, "rb") as fh:
        data = fh.read()
    assert data == GOLDEN_SEGMENT
    assert size == len(GOLDEN_SEGMENT) == 752 and offsets == [720, 736]
    assert os.listdir(tmp_path) == ["0000000000000001.safetensors"]  # no temp file left
    with safe_open(path, framework="pt") as f:
        t = f.get_tensor(K1.hex())
        assert t.dtype == torch.float16 and tuple(t.shape) == (1, 1, 2, 1, 4)
        assert t.view(torch.uint8).reshape(-1).numpy().tobytes() == D1


def test_golden_index_encodings():
    rec = di.Rec(0, 0, 1, 736, 16, 16, C1, T_US, T_US, NS, K0)
    assert di.encode_record(rec) == GOLDEN_RECORD
    assert len(GOLDEN_RECORD) == di.RECORD.size == 128
    assert di.decode_record(GOLDEN_RECORD) == rec
    assert di.encode_seginfo(di.SegInfo(2, 752, 32, 32, T_US)) == GOLDEN_SEGINFO
    assert di.TOTALS.pack(2, 32, 32, 1, 752, 32) == GOLDEN_TOTALS
    ns_fields = ("golden", "rev1", "float16", 1, 1, 2, 1, 4, 0, 1, 1, (("a", "b"),))
    assert di.encode_namespace(ns_fields) == GOLDEN_NAMESPACE
    assert di.decode_namespace(GOLDEN_NAMESPACE) == ns_fields
    # LMDB keys: namespace id ‖ block key; lru: last access (u64 BE) ‖ that
    assert di.dbkey(NS, K0) == NS + K0 and len(di.dbkey(NS, K0)) == 64
    assert di.lru_key(T_US, di.dbkey(NS, K0)) == bytes.fromhex("00060a24181e4000") + NS + K0


def test_tier_writes_the_golden_bytes(tmp_path):
    """End to end: the tier's first segment and K1's record are the golden bytes, with the
    namespace id of the registered namespace in place of the fixed one."""
    ns = Namespace.create("golden", LAYOUT)
    t = DiskTier(tmp_path, capacity_bytes=1 << 20, clock=lambda: T_US / 1e6)
    try:
        t.register_namespace(ns)
        items = [DiskWrite(K0, None, ns.id, torch.frombuffer(bytearray(D0), dtype=torch.uint8)),
                 DiskWrite(K1, K0, ns.id, torch.frombuffer(bytearray(D1), dtype=torch.uint8))]
        assert t.write_blocks(items) == [K0, K1]
        dst = torch.empty(16, dtype=torch.uint8)
        assert t.read_into(K1, dst) is ReadStatus.OK and dst.numpy().tobytes() == D1
    finally:
        t.close()
    data = (tmp_path / "segments" / "0000000000000001.safetensors").read_bytes()
    c0, c1 = seg.block_checksum(K0, ns.id, D0), seg.block_checksum(K1, ns.id, D1)
    expect = (GOLDEN_SEGMENT.replace(NS.hex().encode(), ns.id.hex().encode())
              .replace(f"{C0:016x}".encode(), f"{c0:016x}".encode())
              .replace(f"{C1:016x}".encode(), f"{c1:016x}".encode()))
    assert data == expect
    env = lmdb.open(str(tmp_path / "index"), max_dbs=10, readonly=True)
    try:
        with env.begin() as txn:
            raw = txn.get(ns.id + K1, db=env.open_db(di.DB_BLOCKS, txn=txn, create=False))
            children = list(txn.cursor(db=env.open_db(di.DB_CHILDREN, txn=txn, create=False)))
            lru = [k for k, _ in txn.cursor(db=env.open_db(di.DB_LRU, txn=txn, create=False))]
            seginfo = txn.get(di.BE64.pack(1), db=env.open_db(di.DB_SEGS, txn=txn, create=False))
            meta = env.open_db(di.DB_META, txn=txn, create=False)
            version = txn.get(di.META_FORMAT, db=meta)
            totals = txn.get(di.META_TOTALS, db=meta)
    finally:
        env.close()
    assert raw == GOLDEN_RECORD.replace(NS, ns.id).replace(C1.to_bytes(8, "little"),
                                                           c1.to_bytes(8, "little"))
    assert seginfo == GOLDEN_SEGINFO
    assert totals == GOLDEN_TOTALS
    # side indexes are keyed in the namespace's key space: children[ns ‖ K0] = 1, K1 the leaf
    assert children == [(ns.id + K0, bytes.fromhex("01000000"))]
    assert lru == [bytes.fromhex("00060a24181e4000") + ns.id + K1]
    assert version == bytes.fromhex("02000000")
