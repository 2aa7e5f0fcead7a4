"""Prefix packs (``kvstore export`` / ``kvstore import``, ``kvstore.packs``): round trips across
two store paths through the CLI, checked through ``kvstore.open_store``; prompt prefixes;
fail-closed import of truncated, altered and wrong-namespace packs; the exact bytes of a
tiny pack; safetensors interop."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.admin import block_bytes, kv_for, open_test_store, prompt_tokens, small_layout

from kvstore import KVLayout, open_store
from kvstore.cli import main
from kvstore.packs import PackError, export_pack, import_pack, open_pack
from kvstore.packs.format import MANIFEST_BYTES
from kvstore.tiers.disk import DiskTier

LAY = small_layout()  # bfloat16 L2 P2 T4 H2 D16: 1 KiB blocks
LAYOUT = "bfloat16 L2 P2 T4 H2 D16"


def _tokens(i: int, blocks: int = 4, shared: int = 2) -> list[int]:
    return prompt_tokens(i, blocks, LAY.block_tokens, shared=shared)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Store P: m/a holds 4 prompts of 4 blocks in 3 groups (prompts 0 and 3 share their
    first 2 blocks: 14 blocks, a forest of 3 trees), m/b one prompt."""
    p = tmp_path_factory.mktemp("packs") / "P"
    for model, prompts in (("m/a", range(4)), ("m/b", range(1))):
        with open_test_store(p, model, LAY) as s:
            for i in prompts:
                keys = s.block_keys(_tokens(i))
                s.put(keys, kv_for(keys, LAY)).wait()
    return p


@pytest.fixture(scope="module")
def pack(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("pack") / "a.kvpack"
    assert main(["export", "--store", str(source), "--namespace", "m/a", "-o", str(out)]) == 0
    return out


def _hits(store, model: str, prompts) -> list[int]:
    """Leading blocks a store opened on ``store`` through the public API finds, per prompt,
    after checking the bytes it fetches."""
    out = []
    with open_store(store, layout=LAY, model_id=model, device="cpu", cpu_capacity="1MiB",
                    disk_capacity="1GiB") as s:
        for i in prompts:
            keys = s.block_keys(_tokens(i))
            n = s.lookup(keys)
            if n:
                got = s.fetch(keys[:n]).wait().contiguous().view(torch.uint8).reshape(n, -1)
                for j in range(n):
                    assert bytes(got[j].numpy()) == bytes(block_bytes(keys[j], LAY.block_nbytes))
            out.append(n)
    return out


def _segments(store) -> list[str]:
    d = os.path.join(store, "segments")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


# -- round trips -------------------------------------------------------------------------------------

def test_round_trip_to_another_store_hits_through_open_store(pack, tmp_path, capsys):
    q = tmp_path / "Q"
    assert main(["import", str(pack), "--store", str(q)]) == 2  # no store there: --create
    assert "--create" in capsys.readouterr().err and not q.exists()
    assert main(["import", str(pack), "--store", str(q), "--create"]) == 0
    out = capsys.readouterr().out
    assert "imported 14 block(s)" in out and "(store created)" in out
    assert _hits(q, "m/a", range(4)) == [4, 4, 4, 4]
    assert _hits(q, "m/b", range(1)) == [0]  # only the exported namespace
    assert main(["import", str(pack), "--store", str(q), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "kvstore.import/1"
    assert (data["imported"], data["present"], data["blocks"]) == (0, 14, 14)


def test_export_json_and_a_forest_in_parent_order(pack, source, capsys):
    with open_pack(str(pack)) as p:
        assert p.header.blocks == 14 and p.header.namespace.model_id == "m/a"
        assert all(q < i for i, q in enumerate(p.parents))
        assert sum(q < 0 for q in p.parents) == 3  # three groups: three first blocks
        t = DiskTier(source, capacity_bytes=0, readonly=True)
        try:
            for i, k in enumerate(p.keys):
                r = t.get_record(k, p.header.namespace_id)
                assert r.parent == (None if p.parents[i] < 0 else p.keys[p.parents[i]])
                assert bytes(p.block(i)) == bytes(block_bytes(k, LAY.block_nbytes))
        finally:
            t.close()


def test_prefix_of_prompts(source, tmp_path, capsys):
    f1, f2 = tmp_path / "p1.json", tmp_path / "p2.json"
    f1.write_text(json.dumps(_tokens(0)))
    f2.write_text(json.dumps(_tokens(3) + list(range(40))))  # same group as 0: shares 2 blocks
    out = tmp_path / "sys.kvpack"
    assert main(["export", "--store", str(source), "--namespace", "m/a", "--prefix-of", str(f1),
                 "--prefix-of", str(f2), "-o", str(out), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "kvstore.export/1"
    assert data["blocks"] == 6 and data["prompts"] == 2 and data["prompt_blocks_missing"] == 10
    q = tmp_path / "Q"
    assert main(["import", str(out), "--store", str(q), "--create"]) == 0
    assert _hits(q, "m/a", range(4)) == [4, 0, 0, 4]


def test_export_of_a_compressed_store_is_raw(tmp_path):
    p = tmp_path / "P"
    with open_test_store(p, "m/z", LAY, disk_codec="zstd") as s:
        keys = s.block_keys(_tokens(0))
        s.put(keys, torch.zeros(LAY.batch_shape(4), dtype=LAY.dtype)).wait()
    res = export_pack(p, "m/z", tmp_path / "z.kvpack")
    assert res.blocks == 4 and res.data_bytes == 4 * LAY.block_nbytes
    imp = import_pack(tmp_path / "z.kvpack", tmp_path / "Q", create=True)
    assert imp.imported == 4


def test_damaged_and_unreachable_blocks_are_left_out(source, tmp_path):
    p = tmp_path / "P"
    shutil.copytree(source, p)
    t = DiskTier(p, capacity_bytes=0)
    nid = next(i.namespace_id for i in t.namespaces() if i.model_id == "m/a")
    with open_test_store(p, "m/a", LAY) as s:
        k0 = [bytes(k) for k in s.block_keys(_tokens(0))]
        k1 = [bytes(k) for k in s.block_keys(_tokens(1))]
    t.delete([k1[1]], namespace_id=nid)  # prompt 1's blocks 2-3 become unreachable
    r = t.get_record(k0[2], nid)
    t.close()
    seg = os.path.join(p, "segments", f"{r.segment:016x}.safetensors")
    with open(seg, "r+b") as f:  # damage prompt 0's block 2: it and block 3 are left out
        f.seek(r.offset)
        f.write(b"\xff" * 8)
    res = export_pack(p, "m/a", tmp_path / "x.kvpack")
    assert (res.unreachable, res.damaged) == (2, 1)
    with open_pack(str(tmp_path / "x.kvpack")) as pk:
        assert k0[2] not in pk.keys and k0[3] not in pk.keys and k1[2] not in pk.keys
        assert res.blocks == len(pk.keys) == 14 - 1 - 2 - 2


def test_export_refusals(source, pack, tmp_path, capsys):
    assert main(["export", "--store", str(source), "--namespace", "m/a", "-o", str(pack)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["export", "--store", str(source), "--namespace", "m/nope", "-o",
                 str(tmp_path / "x")]) == 2
    assert "no namespace matches" in capsys.readouterr().err
    f = tmp_path / "p.json"
    f.write_text("[1, 2, 3, 4, 5, 6, 7, 8]")
    assert main(["export", "--store", str(source), "--namespace", "m/a", "--prefix-of", str(f),
                 "-o", str(tmp_path / "x")]) == 2
    assert "nothing to export" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["export", "--store", str(source), "--namespace", "m/a", "-o", str(pack),
                 "--force"]) == 0


# -- fail-closed import -------------------------------------------------------------------------------

def _refused(pack_path, q, capsys, kind: str | None = None, *extra: str) -> str:
    before = _segments(q)
    assert main(["import", str(pack_path), "--store", str(q), "--create", *extra]) == 1
    err = capsys.readouterr().err
    assert "refused" in err and (kind is None or kind in err)
    assert _segments(q) == before  # nothing written
    return err


@pytest.mark.parametrize("cut", ["header", "manifest", "blocks", "last_byte"])
def test_truncated_packs_import_nothing(pack, tmp_path, capsys, cut):
    with open_pack(str(pack)) as p:
        h = p.header
    data = pack.read_bytes()
    at = {"header": 40, "manifest": h.data_start + 10,
          "blocks": h.blocks_start + 3 * h.block_nbytes, "last_byte": len(data) - 1}[cut]
    bad = tmp_path / "t.kvpack"
    bad.write_bytes(data[:at])
    err = _refused(bad, tmp_path / "Q", capsys, "truncated")
    assert not (tmp_path / "Q").exists() or not _segments(tmp_path / "Q")
    assert "truncated" in err


def test_appended_bytes_are_refused(pack, tmp_path, capsys):
    bad = tmp_path / "t.kvpack"
    bad.write_bytes(pack.read_bytes() + b"\0")
    _refused(bad, tmp_path / "Q", capsys, "altered")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_flipped_bit_is_refused(pack, tmp_path_factory, where, bit):
    data = bytearray(pack.read_bytes())
    i = int(where * len(data))
    data[i] ^= 1 << bit
    d = tmp_path_factory.mktemp("flip")
    bad = d / "f.kvpack"
    bad.write_bytes(bytes(data))
    with pytest.raises(PackError) as ei:
        import_pack(bad, d / "Q", create=True)
    assert ei.value.kind in ("altered", "not_a_pack", "truncated", "version")
    assert not (d / "Q").exists()


def test_altered_block_names_the_block(pack, tmp_path, capsys):
    with open_pack(str(pack)) as p:
        at = p.header.blocks_start + 5 * p.header.block_nbytes + 100
        key = p.keys[5].hex()[:16]
    data = bytearray(pack.read_bytes())
    data[at] ^= 0x40
    bad = tmp_path / "a.kvpack"
    bad.write_bytes(bytes(data))
    q = tmp_path / "Q"
    _put_other(q)
    err = _refused(bad, q, capsys, "altered")
    assert f"block 5 (key {key})" in err
    assert _hits(q, "m/a", range(4)) == [0, 0, 0, 0]


def _put_other(q) -> None:
    with open_test_store(q, "m/other", LAY) as s:
        keys = s.block_keys(_tokens(0))
        s.put(keys, kv_for(keys, LAY)).wait()


@pytest.mark.parametrize("args,field", [
    (["--model", "m/b", "--layout", LAYOUT], "model"),
    (["--model", "m/a", "--layout", "bfloat16 L2 P2 T8 H2 D16"], "layout"),
    (["--model", "m/a", "--layout", "float16 L2 P2 T4 H2 D16"], "dtype"),
    (["--model", "m/a", "--layout", LAYOUT + " tp1/2"], "tp_rank"),
    (["--model", "m/a", "--layout", LAYOUT, "--revision", "r1"], "revision"),
    (["--expect-namespace", "m/b"], "not 'm/b'"),
])
def test_a_pack_for_another_namespace_imports_nothing(pack, tmp_path, capsys, args, field):
    q = tmp_path / "Q"
    _put_other(q)
    err = _refused(pack, q, capsys, "wrong_namespace", *args)
    assert field in err and "nothing was imported" in err
    t = DiskTier(q, capacity_bytes=0, readonly=True)
    try:
        assert {i.model_id for i in t.namespaces()} == {"m/other"}  # not even registered
    finally:
        t.close()


def test_expected_namespace_that_matches(pack, tmp_path):
    from kvstore.admin.nsmatch import parse_layout

    res = import_pack(pack, tmp_path / "Q", create=True,
                      expect=parse_layout(LAYOUT, model_id="m/a"))
    assert res.imported == 14 and res.created_store


def test_not_a_pack(tmp_path, capsys):
    f = tmp_path / "x.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(4)}, str(f))
    _refused(f, tmp_path / "Q", capsys, "not_a_pack")
    assert main(["import", str(tmp_path / "missing"), "--store", str(tmp_path / "Q"),
                 "--create"]) == 2


def test_dry_run_writes_nothing(pack, tmp_path, capsys):
    q = tmp_path / "Q"
    _put_other(q)
    before = _segments(q)
    assert main(["import", str(pack), "--store", str(q), "--dry-run"]) == 0
    assert "14 would be imported" in capsys.readouterr().out and _segments(q) == before


def test_a_failed_write_publishes_nothing(pack, tmp_path, monkeypatch):
    from kvstore.errors import DiskError

    q = tmp_path / "Q"
    _put_other(q)
    before = _segments(q)

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the segments' durable write fails
    with pytest.raises(DiskError):
        import_pack(pack, q)
    monkeypatch.undo()
    assert _segments(q) == before and _hits(q, "m/a", range(4)) == [0, 0, 0, 0]


# -- the exact bytes -----------------------------------------------------------------------------------

GOLDEN_HEADER = (
    '{"__metadata__":{"kvstore.pack":"1","kvstore.namespace_id":'
    '"4314e7bb2195b078fd11610a67bce33b9b95dc7536ec862d9e79613ab72984f8","kvstore.namespace":'
    '"9d01ab676f6c64656e2f7061636ba0a7666c6f61743136010101010100010190","kvstore.blocks":"2",'
    '"kvstore.manifest_xxh3":"3a59834c1aa6cdd6"},'
    '"kvstore.keys":{"dtype":"U8","shape":[2,32],"data_offsets":[0,64]},'
    '"kvstore.parents":{"dtype":"I64","shape":[2],"data_offsets":[64,80]},'
    '"kvstore.checksums":{"dtype":"U64","shape":[2],"data_offsets":[80,96]},'
    '"kvstore.blocks":{"dtype":"F16","shape":[2,1,1,1,1,1],"data_offsets":[96,100]}}    ')
GOLDEN_DATA = (
    "c40a7a474deee4e800e3d1449e17f93c8b4658eb73db08c3d60fdd8f871236ab"  # key 0
    "b5e4d2c5a7d9451142dbba3c85097552f0dbe642e3f96a59355f40b5aa099fa9"  # key 1
    "ffffffffffffffff" "0000000000000000"  # parents: -1, 0
    "7d173adcfa199873" "714beec9134ddfc9"  # block checksums (u64 LE)
    "003c" "0040")  # the blocks: float16 1.0, 2.0


def test_golden_bytes_of_a_tiny_pack(tmp_path):
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16,
                   block_tokens=1, kv_planes=1)
    with open_store(tmp_path / "s", layout=lay, model_id="golden/pack", device="cpu",
                    cpu_capacity=128, disk_capacity="1MiB") as s:
        keys = s.block_keys([7, 8])
        s.put(keys, torch.tensor([1.0, 2.0], dtype=torch.float16).view(2, 1, 1, 1, 1, 1)).wait()
    export_pack(tmp_path / "s", "golden/pack", tmp_path / "g.kvpack")
    got = (tmp_path / "g.kvpack").read_bytes()
    header = GOLDEN_HEADER.encode("ascii")
    assert len(header) % 8 == 0 and (8 + len(header)) % 8 == 0
    assert got == len(header).to_bytes(8, "little") + header + bytes.fromhex(GOLDEN_DATA)
    assert len(GOLDEN_DATA) // 2 == MANIFEST_BYTES * 2 + 4
    assert bytes.fromhex(GOLDEN_DATA[:128]) == b"".join(keys)


def test_a_pack_is_a_safetensors_file(pack, source):
    from safetensors import safe_open

    with safe_open(str(pack), "pt") as f:
        meta = f.metadata()
        blocks = f.get_tensor("kvstore.blocks")
        keys = f.get_tensor("kvstore.keys")
        parents = f.get_tensor("kvstore.parents")
    assert meta["kvstore.pack"] == "1" and meta["kvstore.blocks"] == "14"
    assert blocks.shape == (14, *LAY.block_shape) and blocks.dtype == LAY.dtype
    assert keys.shape == (14, 32) and parents.dtype == torch.int64
    k = bytes(keys[0].numpy())
    assert bytes(blocks[0].contiguous().view(torch.uint8).reshape(-1).numpy()) == bytes(
        block_bytes(k, LAY.block_nbytes))


# -- issue 26: hostile headers and files that are not regular files ------------------------------

def _deep_header(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    """A pack-sized header whose metadata nests ``depth`` levels deep."""
    body = b'{"__metadata__":' + opener * depth + b"0" + closer * depth + b"}"
    body += b" " * ((-(8 + len(body))) % 8)
    return len(body).to_bytes(8, "little") + body


@pytest.mark.parametrize("nest", ["list", "object"])
def test_a_deeply_nested_header_is_refused_not_a_traceback(tmp_path, capsys, nest):
    opener, closer = (b"[", b"]") if nest == "list" else (b'{"a":', b"}")
    depth = 200_000 if nest == "list" else 100_000  # within the 4 MiB header limit
    bad = tmp_path / "deep.kvpack"
    bad.write_bytes(_deep_header(depth, opener, closer) + bytes(64))
    with pytest.raises(PackError) as e:
        open_pack(str(bad))
    assert e.value.kind == "not_a_pack" and "deep" in str(e.value) and str(bad) in str(e.value)
    err = _refused(bad, tmp_path / "Q", capsys, "not_a_pack")
    assert "Traceback" not in err and "Recursion" not in err


def _fifo_writer(path: str, stop):
    """Unblocks a reader that opened the FIFO (the code before issue 26 did, and hung)."""
    import threading

    def run() -> None:
        while not stop.wait(0.05):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: nobody has it open for reading
                continue
            os.close(fd)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("what", ["fifo", "device", "directory"])
def test_only_a_regular_file_is_read_as_a_pack(tmp_path, capsys, what):
    import threading

    if what == "fifo":
        target = tmp_path / "pipe.kvpack"
        os.mkfifo(target)
        name = "FIFO"
    elif what == "device":
        target = tmp_path / "null.kvpack"
        os.symlink("/dev/null", target)  # a link to a device is refused too
        name = "device"
    else:
        target = tmp_path / "dir.kvpack"
        target.mkdir()
        name = "directory"
    stop = threading.Event()
    writer = _fifo_writer(str(target), stop) if what == "fifo" else None
    try:
        with pytest.raises(PackError) as e:
            import_pack(target, tmp_path / "Q", create=True)
        msg = str(e.value)
        assert e.value.kind == "not_a_pack" and str(target) in msg
        assert name in msg and "not a regular file" in msg
        _refused(target, tmp_path / "Q", capsys, "not_a_pack")
    finally:
        stop.set()
        if writer is not None:
            writer.join()
