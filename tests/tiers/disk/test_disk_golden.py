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
from kvstore.tiers.disk import DiskTier, DiskWrite, ReadStatus
from kvstore.tiers.disk import index as di
from kvstore.tiers.disk import segments as seg

K0 = bytes.fromhex("11" * 32)
K1 = bytes.fromhex("22" * 32)
NS = bytes(range(32))  # fixed namespace id of the golden literals
D0 = bytes(range(16))
D1 = bytes(range(16, 32))
T_US = 1_700_000_000_000_000
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16,
                  block_tokens=2, kv_planes=1)  # 16-byte blocks, shape [1, 1, 2, 1, 4]

# segment 0000000000000001 holding K0 (root) and K1 (child of K0), codec none, carrying the
# namespace record GOLDEN_NAMESPACE under the namespace id NS
GOLDEN_SEGMENT = bytes.fromhex(
    "68030000000000007b225f5f6d657461646174615f5f223a7b226b7673746f72652e666f726d6174223a2232222c226b"
    "7673746f72652e7365676d656e74223a2230303030303030303030303030303031222c226b7673746f72652e6e616d65"
    "73706163652e303030313032303330343035303630373038303930613062306330643065306631303131313231333134"
    "31353136313731383139316131623163316431653166223a223964303161363637366636633634363536656134373236"
    "353736333161373636366336663631373433313336303130313032303130343030303130313931393261313631613136"
    "32222c223131313131313131313131313131313131313131313131313131313131313131313131313131313131313131"
    "3131313131313131313131313131313131313131223a226e6f6e653b31363b386334353439366333626130613739383b"
    "303030313032303330343035303630373038303930613062306330643065306631303131313231333134313531363137"
    "313831393161316231633164316531663b222c2232323232323232323232323232323232323232323232323232323232"
    "323232323232323232323232323232323232323232323232323232323232323232323232223a226e6f6e653b31363b65"
    "6561396566646466356164333164633b3030303130323033303430353036303730383039306130623063306430653066"
    "31303131313231333134313531363137313831393161316231633164316531663b313131313131313131313131313131"
    "313131313131313131313131313131313131313131313131313131313131313131313131313131313131313131313131"
    "31227d2c2231313131313131313131313131313131313131313131313131313131313131313131313131313131313131"
    "313131313131313131313131313131313131313131223a7b226474797065223a22463136222c227368617065223a5b31"
    "2c312c322c312c345d2c22646174615f6f666673657473223a5b302c31365d7d2c223232323232323232323232323232"
    "323232323232323232323232323232323232323232323232323232323232323232323232323232323232323232323232"
    "3232223a7b226474797065223a22463136222c227368617065223a5b312c312c322c312c345d2c22646174615f6f6666"
    "73657473223a5b31362c33325d7d7d20000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
)
# an index record of K1: codec 0, segment 1, offset 736, 16/16 bytes, checksum C1, created and
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
    path, size, offsets = seg.write_segment(str(tmp_path), 1, _entries(), {NS: GOLDEN_NAMESPACE})
    assert os.path.basename(path) == "0000000000000001.safetensors"
    with open(path, "rb") as fh:
        data = fh.read()
    assert data == GOLDEN_SEGMENT
    assert size == len(GOLDEN_SEGMENT) == 912 and offsets == [880, 896]
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
    lay = ns.layout
    record = di.encode_namespace((ns.model_id, ns.model_revision, "float16", lay.num_layers,
                                  lay.kv_planes, lay.block_tokens, lay.num_kv_heads,
                                  lay.head_dim, ns.tp_rank, ns.tp_size, ns.format_version, ()))
    entries = [
        seg.SegmentEntry(K0.hex(), "F16", [1, 1, 2, 1, 4], D0, 16, seg.block_meta("none", 16, c0, ns.id, None)),
        seg.SegmentEntry(K1.hex(), "F16", [1, 1, 2, 1, 4], D1, 16, seg.block_meta("none", 16, c1, ns.id, K0)),
    ]
    expect_path, size, offs = seg.write_segment(str(tmp_path), 99, entries, {ns.id: record})
    with open(expect_path, "rb") as fh:
        expect = fh.read().replace(f"{99:016x}".encode(), f"{1:016x}".encode())
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
    # the golden encodings, with this namespace's id, checksum and header size
    assert raw == di.encode_record(di.Rec(0, 0, 1, offs[1], 16, 16, c1, T_US, T_US, ns.id, K0))
    assert seginfo == di.encode_seginfo(di.SegInfo(2, size, 32, 32, T_US))
    assert totals == di.TOTALS.pack(2, 32, 32, 1, size, 32)
    # side indexes are keyed in the namespace's key space: children[ns ‖ K0] = 1, K1 the leaf
    assert children == [(ns.id + K0, bytes.fromhex("01000000"))]
    assert lru == [bytes.fromhex("00060a24181e4000") + ns.id + K1]
    assert version == bytes.fromhex("02000000")
