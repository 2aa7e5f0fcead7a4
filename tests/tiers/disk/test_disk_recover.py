"""Issue 13 (B): ``kvstore recover`` rebuilds the index from the segments; a store never starts
an empty index over old segment files; segment ids are never reused, segment files never
overwritten."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import struct
from pathlib import Path

import lmdb
import pytest
import torch
from conftest import bit_equal, keyed_kv

from kvstore import KVLayout, StoreCorruptError, open_store
from kvstore.cli import main
from kvstore.errors import KVStoreError, StoreLockedError
from kvstore.tiers.disk import DiskTier, guard
from kvstore.tiers.disk import index as di
from kvstore.tiers.disk import segments as seg
from kvstore.tiers.disk.recover import recover

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
BN = LAY.block_nbytes
MODEL = "recover/test"


def opened(path, model=MODEL, **kw):
    return open_store(path, layout=LAY, model_id=model, device="cpu", gpu_capacity=0,
                      cpu_capacity=64 * BN, disk_capacity="64MiB", **kw)


def chains(s, n=5, blocks=8, base=0):
    return [s.block_keys([(base + c) * 1000 + t for t in range(blocks * LAY.block_tokens)])
            for c in range(n)]


def build(path, *, codec="none", n=5) -> int:
    """A store with ``n`` chains of 8 blocks, each chain flushed on its own (a segment each)."""
    with opened(path, disk_codec=codec) as s:
        for ks in chains(s, n):
            assert s.put(ks, keyed_kv(LAY, ks)).wait() == len(ks)
            s.flush()
    return 8 * n


def fetch_all(path, n=5, model=MODEL) -> list[int]:
    """Blocks fetched per chain (every one checked bit-exact against its key)."""
    with opened(path, model=model) as s:
        out = []
        for ks in chains(s, n):
            got = s.fetch(ks).wait()
            assert bit_equal(got, keyed_kv(LAY, ks[: got.shape[0]]))
            out.append(got.shape[0])
        return out


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def segment_files(path) -> dict[str, str]:
    """name -> sha256 of every segment file."""
    d = Path(path) / "segments"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.suffix == ".safetensors"}


def remove_index(path) -> None:
    for f in (Path(path) / "index").glob("*.mdb"):
        f.unlink()


# -- no empty index over old segments ---------------------------------------------------------

def test_missing_index_beside_segments_is_refused(tmp_path):
    build(tmp_path)
    remove_index(tmp_path)
    with pytest.raises(StoreCorruptError, match=f"kvstore recover --store {tmp_path}"):
        opened(tmp_path)
    with pytest.raises(StoreCorruptError, match="kvstore recover"):
        DiskTier(tmp_path, capacity_bytes=1 << 20, readonly=True)
    assert not (tmp_path / "index" / "data.mdb").exists()  # nothing was created
    (tmp_path / "index" / "data.mdb").write_bytes(b"")  # an empty file is refused the same way
    with pytest.raises(StoreCorruptError, match="0 bytes"):
        opened(tmp_path)
    for cmd in ("ls", "verify", "inspect"):
        rc, _out, err = cli(cmd, "--store", str(tmp_path))
        assert rc == 2, (cmd, err)
    assert os.path.getsize(tmp_path / "index" / "data.mdb") == 0


def test_uninitialized_index_beside_segments_is_refused(tmp_path):
    build(tmp_path)
    remove_index(tmp_path)
    lmdb.open(str(tmp_path / "index"), max_dbs=10).close()  # a valid but empty LMDB file
    with pytest.raises(StoreCorruptError, match="uninitialized"):
        opened(tmp_path)


def test_a_new_store_still_opens(tmp_path):
    with opened(tmp_path / "new") as s:
        ks = chains(s, 1)[0]
        assert s.put(ks, keyed_kv(LAY, ks)).wait() == 8
    assert fetch_all(tmp_path / "new", 1) == [8]


# -- recover -----------------------------------------------------------------------------------

@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_recover_restores_every_block(tmp_path, codec):
    n = build(tmp_path, codec=codec)
    before = segment_files(tmp_path)
    remove_index(tmp_path)
    rc, out, err = cli("recover", "--store", str(tmp_path), "--format", "json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["schema"] == "kvstore.recover/1"
    assert res["index_state"] == "missing" and res["done"]
    assert res["blocks_found"] == res["blocks_recovered"] == n and res["blocks_bad"] == 0
    # every segment carries the records of its namespaces: nothing is lost with the index
    assert not res["namespaces_missing"] and res["namespaces"] == 1
    assert guard.check_index(str(tmp_path / "index")).ok
    # before any engine reopens it, the store is whole: verify finds nothing to drop
    rc, out, _ = cli("verify", "--store", str(tmp_path), "--format", "json")
    assert rc == 0, out
    assert json.loads(out)["blocks_checked"] == n
    assert fetch_all(tmp_path) == [8] * 5
    assert segment_files(tmp_path) == before  # segments are only read


def test_recover_damaged_index_salvages_namespaces(tmp_path):
    n = build(tmp_path)
    data = tmp_path / "index" / "data.mdb"
    os.truncate(data, os.path.getsize(data) // 2)
    old = data.read_bytes()
    res = recover(tmp_path)
    assert res.index_state == "damaged" and "cut off" in res.index_problem
    assert res.blocks_recovered == n and res.ok
    assert res.namespaces == 1 and not res.namespaces_missing
    moved = Path(res.damaged_index)
    assert moved.name.startswith("index.damaged-") and (moved / "data.mdb").read_bytes() == old
    # the namespace record came back: the model is known before any engine opens the store
    rc, out, _ = cli("ls", "--store", str(tmp_path), "--format", "json")
    assert rc == 0 and MODEL in out
    assert fetch_all(tmp_path) == [8] * 5


def test_recover_skips_and_reports_a_corrupt_payload(tmp_path):
    n = build(tmp_path)
    with opened(tmp_path) as s:
        victim = chains(s)[2][3]
    t = DiskTier(tmp_path, capacity_bytes=1 << 30, readonly=True)
    try:
        rec = t.get_record(victim)
    finally:
        t.close()
    path = tmp_path / "segments" / seg.segment_name(rec.segment)
    b = bytearray(path.read_bytes())
    b[rec.offset + 5] ^= 0x40
    os.chmod(path, 0o644)
    path.write_bytes(bytes(b))
    remove_index(tmp_path)
    rc, out, err = cli("recover", "--store", str(tmp_path), "--format", "json")
    assert rc == 1, err  # recovered, with findings
    res = json.loads(out)
    assert res["blocks_bad"] == 1 and res["blocks_recovered"] == n - 1
    (f,) = [f for f in res["findings"] if f["kind"] == "checksum_mismatch"]
    assert f["key"] == victim.hex() and f["path"] == str(path)
    # the bad block is a miss; its chain ends there, every other chain is whole
    assert fetch_all(tmp_path) == [8, 8, 3, 8, 8]
    rc, out, _ = cli("recover", "--store", str(tmp_path))  # the new index is intact
    assert rc == 0 and "intact" in out


def test_recover_keeps_the_newest_copy(tmp_path):
    build(tmp_path, n=2)
    segdir = tmp_path / "segments"
    names = sorted(segment_files(tmp_path))
    top = max(int(x[:16], 16) for x in names)
    # a copy of the first segment under a newer id (an interrupted compaction leaves such)
    src = segdir / names[0]
    dup = segdir / seg.segment_name(top + 10)
    data = bytearray(src.read_bytes())
    old_id = names[0][:16].encode()
    i = data.index(b'"kvstore.segment":"' + old_id)
    data[i + 19:i + 35] = f"{top + 10:016x}".encode()
    dup.write_bytes(bytes(data))
    remove_index(tmp_path)
    res = recover(tmp_path)
    assert res.ok and res.duplicates == 8 and res.blocks_recovered == 16
    t = DiskTier(tmp_path, capacity_bytes=1 << 30, readonly=True)
    try:
        segs = {r.segment for r in t.records()}
    finally:
        t.close()
    assert top + 10 in segs and int(names[0][:16], 16) not in segs
    assert res.next_segment > top + 10
    assert fetch_all(tmp_path, 2) == [8, 8]


def test_after_recover_new_writes_use_fresh_segment_ids(tmp_path):
    build(tmp_path, n=3)
    before = segment_files(tmp_path)
    top = max(int(x[:16], 16) for x in before)
    remove_index(tmp_path)
    res = recover(tmp_path)
    assert res.next_segment > top
    with opened(tmp_path) as s:
        for ks in chains(s, 2, base=50):
            assert s.put(ks, keyed_kv(LAY, ks)).wait() == 8
            s.flush()
    after = segment_files(tmp_path)
    new = set(after) - set(before)
    assert new and all(int(x[:16], 16) > top for x in new)
    assert {k: after[k] for k in before} == before  # no old file touched
    assert fetch_all(tmp_path, 3) == [8, 8, 8]


def test_intact_index_is_left_alone_unless_forced(tmp_path):
    n = build(tmp_path, n=2)
    idx = (tmp_path / "index" / "data.mdb").read_bytes()
    rc, out, _ = cli("recover", "--store", str(tmp_path))
    assert rc == 0 and "intact" in out
    assert (tmp_path / "index" / "data.mdb").read_bytes() == idx
    res = recover(tmp_path, dry_run=True, force=True)
    assert res.blocks_recovered == n and not res.done
    assert (tmp_path / "index" / "data.mdb").read_bytes() == idx
    res = recover(tmp_path, force=True)
    assert res.done and res.index_state == "rebuilt" and res.namespaces == 1
    assert fetch_all(tmp_path, 2) == [8, 8]


def test_recover_refuses_while_the_store_is_open(tmp_path):
    build(tmp_path, n=1)
    with opened(tmp_path), pytest.raises(StoreLockedError, match="close it"):
        recover(tmp_path, force=True)
    # another process with the store open
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(up_r)
            os.close(down_w)
            t = DiskTier(tmp_path, capacity_bytes=1 << 20, readonly=True)
            os.write(up_w, b"x")
            os.read(down_r, 1)
            t.close()
            code = 0
        except BaseException as e:  # reported to the parent
            os.write(up_w, repr(e).encode()[:500])
        finally:
            os._exit(code)
    os.close(up_w)
    os.close(down_r)
    try:
        msg = os.read(up_r, 1000)
        assert msg == b"x", msg
        with pytest.raises(StoreLockedError, match="another process"):
            recover(tmp_path, force=True)
    finally:
        os.write(down_w, b"x")
        os.close(down_w)
        _, status = os.waitpid(pid, 0)
        os.close(up_r)
    assert status == 0
    assert recover(tmp_path, force=True).done


# -- segment ids and files ---------------------------------------------------------------------

def test_an_existing_segment_file_is_never_overwritten(tmp_path):
    segdir = tmp_path / "s"
    segdir.mkdir()
    e = seg.SegmentEntry("aa" * 32, "U8", [4], b"abcd", 4, "none;4;0000000000000000;" + "00" * 32 + ";")
    path, _size, _offs = seg.write_segment(str(segdir), 7, [e])
    first = Path(path).read_bytes()
    e2 = seg.SegmentEntry("bb" * 32, "U8", [4], b"wxyz", 4, e.meta)
    with pytest.raises(FileExistsError):
        seg.write_segment(str(segdir), 7, [e2])
    assert Path(path).read_bytes() == first
    assert sorted(os.listdir(segdir)) == [seg.segment_name(7)]  # no temp file left


def test_next_segment_is_raised_past_the_files_on_disk(tmp_path):
    build(tmp_path, n=2)
    before = segment_files(tmp_path)
    top = max(int(x[:16], 16) for x in before)
    env = lmdb.open(str(tmp_path / "index"), max_dbs=10)
    try:
        with env.begin(write=True) as txn:  # an index restored from an old backup, say
            txn.put(di.META_NEXT_SEGMENT, di.U64.pack(1), db=env.open_db(di.DB_META, txn=txn))
    finally:
        env.close()
    with opened(tmp_path) as s:
        for ks in chains(s, 1, base=70):
            assert s.put(ks, keyed_kv(LAY, ks)).wait() == 8
            s.flush()
    after = segment_files(tmp_path)
    assert {k: after[k] for k in before} == before
    assert all(int(x[:16], 16) > top for x in set(after) - set(before))
    assert fetch_all(tmp_path, 2) == [8, 8]


def test_recover_without_segments_directory_is_an_error(tmp_path):
    (tmp_path / "store").mkdir()
    rc, _out, err = cli("recover", "--store", str(tmp_path / "store"))
    assert rc == 2 and "nothing to recover" in err
    shutil.rmtree(tmp_path / "store")
    rc, _out, err = cli("recover", "--store", str(tmp_path / "store"))
    assert rc == 2 and "does not exist" in err


@pytest.mark.parametrize("damage", ["truncate", "zero-page", "flip-bits", "delete"])
def test_recover_after_index_damage_restores_everything(tmp_path, damage):
    n = build(tmp_path, n=4)
    data = tmp_path / "index" / "data.mdb"
    b = bytearray(data.read_bytes())
    if damage == "truncate":
        b = b[: len(b) // 3]
    elif damage == "zero-page":
        b[2 * 4096:3 * 4096] = bytes(4096)
    elif damage == "flip-bits":
        for pos in range(2 * 4096 + 7, len(b), 997):
            b[pos] ^= 0x10
    if damage == "delete":
        data.unlink()
    else:
        data.write_bytes(bytes(b))
    if damage != "flip-bits":  # (flips may land in free pages only)
        with pytest.raises(StoreCorruptError, match="kvstore recover"):
            opened(tmp_path)
    if damage == "delete":
        assert guard.missing_index_error(str(tmp_path)) is not None
    res = recover(tmp_path, force=True)
    assert res.done and res.blocks_recovered == n and res.ok
    assert guard.require_intact(str(tmp_path / "index")).databases["blocks"] == n
    assert fetch_all(tmp_path, 4) == [8] * 4


# -- issue 26: hostile headers, dropped entries -------------------------------------------------

def _deep_header(depth: int = 200_000) -> bytes:
    """A segment header whose metadata nests ``depth`` levels deep."""
    body = b'{"__metadata__":' + b"[" * depth + b"]" * depth + b"}"
    body += b" " * ((-(8 + len(body))) % 8)
    return struct.pack("<Q", len(body)) + body


@pytest.mark.parametrize("head", [
    b"[" * 200_000 + b"]" * 200_000,
    b'{"a":' * 100_000 + b"0" + b"}" * 100_000,
    b'{"__metadata__":' + b"[" * 100 + b"]" * 100 + b"}",
], ids=["lists", "objects", "past-the-limit"])
def test_a_deeply_nested_segment_header_is_a_format_error(head):
    with pytest.raises(seg.SegmentFormatError, match="deep") as e:
        seg.parse_header(head)
    assert isinstance(e.value, KVStoreError)


def test_header_parsing_is_not_fooled_by_brackets_in_strings():
    head = json.dumps({"__metadata__": {"k": "[" * 5000 + "{\\\"" * 100}, "t": [[1], {}]},
                      separators=(",", ":")).encode("ascii")
    obj, start = seg.parse_header(head)
    assert obj["__metadata__"]["k"].startswith("[[[") and start == 8 + len(head)
    with pytest.raises(seg.SegmentFormatError, match="not ASCII JSON"):
        seg.parse_header(b'{"a":"[}')
    with pytest.raises(seg.SegmentFormatError, match="deep"):  # past the limit, then garbage
        seg.parse_header(b"[" * 65 + b'"\\"' + b"]" * 3)
    with pytest.raises(seg.SegmentFormatError, match="not ASCII JSON"):
        seg.parse_header(b'{"a":1,}')
    with pytest.raises(seg.SegmentFormatError, match="not a JSON object"):
        seg.parse_header(b"[1]")
    with pytest.raises(seg.SegmentFormatError, match="data_offsets"):
        seg.header_tensors(seg.parse_header(b'{"a":{"data_offsets":[0,1e999]}}')[0], 8)


def test_recover_skips_a_segment_with_a_hostile_header_and_rebuilds_the_rest(tmp_path):
    n = build(tmp_path)
    top = max(int(p.stem, 16) for p in (tmp_path / "segments").glob("*.safetensors"))
    hostile = tmp_path / "segments" / seg.segment_name(top + 1)
    hostile.write_bytes(_deep_header() + bytes(64))
    remove_index(tmp_path)
    rc, out, err = cli("recover", "--store", str(tmp_path), "--format", "json")
    assert rc == 1 and "Traceback" not in err, err  # rebuilt, with a finding
    res = json.loads(out)
    assert res["done"] and res["segments_skipped"] == 1 and res["blocks_recovered"] == n
    (f,) = [f for f in res["findings"] if f["kind"] == "bad_segment"]
    assert f["path"] == str(hostile) and "deep" in f["detail"]
    assert fetch_all(tmp_path) == [8] * 5


def test_recover_counts_dropped_header_entries_and_exits_1(tmp_path):
    n = build(tmp_path)
    with opened(tmp_path) as s:
        first = chains(s)[0]
    t = DiskTier(tmp_path, capacity_bytes=1 << 30, readonly=True)
    try:
        sid = t.get_record(first[0]).segment
    finally:
        t.close()
    path = tmp_path / "segments" / seg.segment_name(sid)
    obj, start, _ = seg.read_header(str(path))
    for k, bad in zip(first[:4], [2**62, -1, "x", float("inf")], strict=True):
        obj[k.hex()]["data_offsets"][0] = bad  # (inf is written as Infinity)
    body = json.dumps(obj, separators=(",", ":")).encode("ascii")
    body += b" " * ((-(8 + len(body))) % 8)
    data, mode = path.read_bytes(), path.stat().st_mode
    os.chmod(path, 0o600)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data[start:])
    os.chmod(path, mode)
    remove_index(tmp_path)
    rc, out, err = cli("recover", "--store", str(tmp_path), "--format", "json")
    assert rc == 1, err  # docs/cli.md: recovered, but some blocks could not be
    res = json.loads(out)
    assert res["blocks_bad"] == 4 and res["blocks_found"] == n
    assert res["blocks_recovered"] == n - 4
    bad = sorted(f["key"] for f in res["findings"] if f["kind"] == "bad_entry")
    assert bad == sorted(k.hex() for k in first[:4])
    assert fetch_all(tmp_path) == [0, 8, 8, 8, 8]
    rc, out, _ = cli("recover", "--store", str(tmp_path))
    assert rc == 0 and "intact" in out
    rc, out, _ = cli("verify", "--store", str(tmp_path), "--format", "json")
    assert rc == 1  # what is left of chain 0 is reported
    assert {f["key"] for f in json.loads(out)["findings"]} >= {k.hex() for k in first[4:]}
