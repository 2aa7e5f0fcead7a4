"""Issue 13, admin side: ``verify --fix`` plans, asks and repairs instead of dropping intact
blocks (9); ``prune`` and ``verify`` find the blocks that no lookup can reach once their parent
is gone (11); a store that a daemon serves is changed through the daemon or not at all (10)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.admin import (
    block_bytes,
    build_store,
    check_disk_bytes,
    kv_for,
    open_test_store,
    prompt_tokens,
    small_layout,
)

from kvstore import connect
from kvstore.admin import AdminError, list_blocks, prune, verify
from kvstore.cli import main
from kvstore.namespace import Namespace
from kvstore.tiers.disk import DiskTier, DiskWrite, ReadStatus
from kvstore.tiers.disk import segments as seg

LAY = small_layout()
OLD_S = 3 * 86400


def _json(capsys, schema: str) -> dict:
    data = json.loads(capsys.readouterr().out)
    assert data.pop("schema") == schema
    return data


def _records(p) -> list:
    t = DiskTier(p, capacity_bytes=0, readonly=True)
    try:
        return list(t.records())
    finally:
        t.close()


def _seg_path(p, sid: int) -> str:
    return os.path.join(p, "segments", seg.segment_name(sid))


def _segments(p) -> set[str]:
    return {n for n in os.listdir(os.path.join(p, "segments")) if n.endswith(".safetensors")}


def _flip(p, rec, at: int = 100) -> None:
    """Flip one byte inside a block's payload."""
    with open(_seg_path(p, rec.segment), "r+b") as f:
        f.seek(rec.offset + at)
        b = f.read(1)
        f.seek(rec.offset + at)
        f.write(bytes([b[0] ^ 0xFF]))


def _smash_header(p, sid: int) -> bytes:
    """Overwrite 8 bytes inside the segment's safetensors JSON header (payloads untouched);
    returns the file's bytes after that."""
    path = _seg_path(p, sid)
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"\x00" * 8)
    with open(path, "rb") as f:
        return f.read()


def _chain(p, n: int = 10) -> tuple[list[bytes], list]:
    """One prompt of ``n`` blocks in one segment; (keys, records in chain order)."""
    (keys,) = build_store(p, "chain/model", prompts=1, blocks=n)
    by_key = {r.key: r for r in _records(p)}
    return keys, [by_key[k] for k in keys]


def _old_chain(p, n: int = 10, model: str = "old/model") -> list[bytes]:
    """A chain of ``n`` blocks written ``OLD_S`` ago (older than any grace period)."""
    ns = Namespace.create(model, LAY)
    keys = [bytes([0xC0, i]) + bytes([i + 1]) * 30 for i in range(n)]
    t = DiskTier(p, capacity_bytes="1GiB", clock=lambda: time.time() - OLD_S)
    try:
        t.register_namespace(ns)
        t.write_blocks([DiskWrite(k, keys[i - 1] if i else None, ns.id,
                                  torch.from_numpy(block_bytes(k, LAY.block_nbytes)))
                        for i, k in enumerate(keys)])
    finally:
        t.close()
    return keys


def _engine_drops(p, key: bytes) -> None:
    """Read ``key`` through a writable tier, as an engine's fetch does: damage drops it."""
    t = DiskTier(p, capacity_bytes="1GiB")
    try:
        dst = torch.empty(LAY.block_nbytes, dtype=torch.uint8)
        assert t.read_into(key, dst) is ReadStatus.DAMAGED
        assert t.get_record(key) is None
    finally:
        t.close()


def _leading_run(p, keys) -> int:
    t = DiskTier(p, capacity_bytes=0, readonly=True)
    try:
        return t.leading_run(keys)
    finally:
        t.close()


def _consistent(p) -> None:
    """The index and its side indexes (children counts, LRU, segment accounting) agree."""
    t = DiskTier(p, capacity_bytes=0, readonly=True)
    try:
        assert t.check(grace_s=0) == []
    finally:
        t.close()


# -- 9: verify --fix plans, asks, repairs ------------------------------------------------------

def test_verify_fix_rewrites_a_damaged_header_and_keeps_every_intact_block(tmp_path, capsys):
    p = tmp_path / "store"
    keys, recs = _chain(p)
    (sid,) = {r.segment for r in recs}
    smashed = _smash_header(p, sid)
    old_name = seg.segment_name(sid)
    # the engine still reads every block: reads go by the index records, not the header
    ok, bad = check_disk_bytes(p)
    assert ok == 10 and bad == []

    assert main(["verify", "--store", str(p), "--format", "json"]) == 1
    data = _json(capsys, "kvstore.verify/1")
    assert {f["kind"] for f in data["findings"]} == {"bad_header"}
    assert {f["action"] for f in data["findings"]} == {"repair"}
    assert {f["key"] for f in data["findings"]} == {k.hex() for k in keys}
    plan = data["plan"]
    assert (plan["repair_blocks"], plan["repair_bytes"], plan["repair_segments"]) == \
        (10, 10 * 1024, 1)
    assert plan["drop_blocks"] == plan["unreachable_blocks"] == 0

    # no terminal, no -y: the plan is shown, nothing changes
    assert main(["verify", "--store", str(p), "--fix"]) == 1
    cap = capsys.readouterr()
    assert "refusing" in cap.err and "-y" in cap.err
    assert "Will repair 10 intact block(s) (10.0 KiB) of 1 segment(s)" in cap.out
    assert "bad_header" in cap.out and "repair" in cap.out
    assert Path(_seg_path(p, sid)).read_bytes() == smashed and len(_records(p)) == 10
    # --dry-run: the same plan, nothing changes
    assert main(["verify", "--store", str(p), "--fix", "--dry-run", "--format", "json"]) == 1
    data = _json(capsys, "kvstore.verify/1")
    assert data["fix"] is False and data["plan"]["repair_blocks"] == 10
    assert Path(_seg_path(p, sid)).read_bytes() == smashed

    assert main(["verify", "--store", str(p), "--fix", "-y"]) == 0
    out = capsys.readouterr().out
    assert "Fixed 10 of 10 problem(s), 0 left." in out
    # a fresh segment holds the blocks; the damaged file was never written to, and is gone
    after = _records(p)
    assert {r.key for r in after} == set(keys)
    (new_sid,) = {r.segment for r in after}
    assert new_sid != sid and _segments(p) == {seg.segment_name(new_sid)}
    assert old_name not in _segments(p)
    obj, start, _ = seg.read_header(_seg_path(p, new_sid))
    listed = seg.header_tensors(obj, start)
    assert all(listed[r.key.hex()] == (r.offset, r.stored_nbytes) for r in after)
    ok, bad = check_disk_bytes(p)
    assert ok == 10 and bad == []
    assert main(["verify", "--store", str(p)]) == 0
    _consistent(p)
    with open_test_store(p, "chain/model") as s:
        keys2 = s.block_keys(prompt_tokens(0, 10, LAY.block_tokens))
        assert s.lookup(keys2) == 10
        assert torch.equal(s.fetch(keys2).wait().view(torch.uint8),
                           kv_for(keys2, LAY).view(torch.uint8))


def test_verify_fix_drops_what_fails_its_checksum_and_repairs_the_rest(tmp_path, capsys):
    p = tmp_path / "store"
    keys, recs = _chain(p)
    _flip(p, recs[5])  # block 6 of 10: bad bytes
    _smash_header(p, recs[0].segment)  # and the whole segment's header

    res = verify(p)
    kinds = {f.key: (f.kind, f.action) for f in res.findings}
    assert {kinds[k.hex()] for k in keys[:5]} == {("bad_header", "repair")}
    assert kinds[keys[5].hex()] == ("checksum_mismatch", "drop")
    assert {kinds[k.hex()] for k in keys[6:]} == {("unreachable", "drop")}
    assert (res.plan.repair_blocks, res.plan.drop_blocks, res.plan.unreachable_blocks) == \
        (5, 1, 4)
    assert not res.ok and len(_records(p)) == 10  # read-only

    assert main(["verify", "--store", str(p), "--fix", "-y", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.verify/1")
    assert data["unfixed"] == 0 and all(f["fixed"] for f in data["findings"])
    assert {r.key for r in _records(p)} == set(keys[:5])
    assert _leading_run(p, keys) == 5
    ok, bad = check_disk_bytes(p)
    assert ok == 5 and bad == []
    assert main(["verify", "--store", str(p)]) == 0
    _consistent(p)


def test_verify_fix_asks_on_a_terminal(tmp_path):
    p = tmp_path / "store"
    keys, recs = _chain(p, 4)
    _smash_header(p, recs[0].segment)

    def run(answer: bytes) -> subprocess.CompletedProcess:
        master, slave = pty.openpty()
        try:
            os.write(master, answer)  # typed ahead: the terminal holds it until the prompt
            proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "verify", "--fix",
                                     "--store", str(p)], stdin=slave, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            os.close(slave)
            out, err = proc.communicate(timeout=120)
        finally:
            os.close(master)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    r = run(b"n\n")
    assert r.returncode == 1 and "Fix 4 problem(s) as listed? [y/N]" in r.stderr
    assert "Nothing changed." in r.stderr and verify(p).plan.repair_blocks == 4
    r = run(b"y\n")
    assert r.returncode == 0, r.stderr
    assert "Fixed 4 of 4 problem(s)" in r.stdout
    assert verify(p).ok and {x.key for x in _records(p)} == set(keys)


def test_negative_grace_is_a_usage_error(tmp_path, capsys):
    p = tmp_path / "store"
    build_store(p, "m/a", prompts=1, blocks=2)
    for argv in (["verify", "--grace", "-5"], ["prune", "--grace", "-1"],
                 ["verify", "--grace", "nan"], ["prune", "--grace", "soon"]):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--store", str(p)])
        assert e.value.code == 2, argv
        assert "argument --grace" in capsys.readouterr().err
    with pytest.raises(AdminError, match="grace"):
        verify(p, grace_s=-5)
    with pytest.raises(AdminError, match="grace"):
        prune(p, grace_s=-1)
    assert main(["verify", "--store", str(p), "--grace", "0"]) == 0


# -- 11: blocks below a missing block ----------------------------------------------------------

def test_prune_removes_the_subtree_below_a_dropped_block(tmp_path, capsys):
    p = tmp_path / "store"
    keys = _old_chain(p)
    other = _old_chain(p, 3, model="other/model")
    by_key = {r.key: r for r in _records(p)}
    _flip(p, by_key[keys[4]])
    _engine_drops(p, keys[4])  # the damaged block is dropped as an engine's fetch does
    assert len(list_blocks(p, filters=["model=old/model"]).items) == 9
    assert _leading_run(p, keys) == 4  # 5 of the 9 can never be looked up

    assert main(["prune", "--store", str(p), "--dry-run", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.prune/1")
    below = {k.hex() for k in keys[5:]}
    assert {f["key"] for f in data["findings"] if f["kind"] == "unreachable"} == below
    assert data["unreachable"] == 5 and data["unreachable_bytes"] == 5 * 1024
    assert len(_records(p)) == 12  # dry run
    assert main(["prune", "--store", str(p), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Would remove 5 item(s)" in out and "5 unreachable block(s) (5.0 KiB" in out
    assert "Nothing to prune" not in out

    assert main(["prune", "--store", str(p)]) == 1  # no terminal, no -y: refused
    assert "pass -y" in capsys.readouterr().err
    assert main(["prune", "--store", str(p), "-y"]) == 0
    out = capsys.readouterr().out
    assert "Pruned 5 item(s)" in out and "5 unreachable block(s)" in out
    left = {r.key for r in _records(p)}
    assert left == set(keys[:4]) | set(other)
    _consistent(p)  # children counts and the LRU index follow the removal
    assert main(["prune", "--store", str(p), "--dry-run"]) == 0
    assert "Nothing to prune." in capsys.readouterr().out
    assert main(["verify", "--store", str(p)]) == 0
    # the surviving prefix still works, and the chain can be written again after it
    t = DiskTier(p, capacity_bytes="1GiB")
    try:
        ns = Namespace.create("old/model", LAY)
        t.write_blocks([DiskWrite(k, keys[i + 3], ns.id,
                                  torch.from_numpy(block_bytes(k, LAY.block_nbytes)))
                        for i, k in enumerate(keys[4:])])
        assert t.leading_run(keys) == 10
    finally:
        t.close()
    _consistent(p)


def test_prune_leaves_young_unreachable_blocks_alone_unless_grace_allows(tmp_path, capsys):
    p = tmp_path / "store"
    keys, recs = _chain(p)  # written just now
    _flip(p, recs[4])
    _engine_drops(p, keys[4])

    assert main(["prune", "--store", str(p), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Nothing to prune." in out
    assert "5 unreachable block(s) written less than 60 s ago are left alone" in out
    assert "--grace 0" in out
    assert main(["prune", "--store", str(p), "-y", "--grace", "0", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.prune/1")
    assert data["unreachable"] == 5 and data["young_unreachable"] == 0
    assert {r.key for r in _records(p)} == set(keys[:4])
    _consistent(p)


def test_verify_reports_unreachable_blocks_and_fix_removes_them(tmp_path, capsys):
    p = tmp_path / "store"
    keys = _old_chain(p)
    by_key = {r.key: r for r in _records(p)}
    _flip(p, by_key[keys[2]])
    _engine_drops(p, keys[2])

    assert main(["verify", "--store", str(p), "--format", "json"]) == 1
    data = _json(capsys, "kvstore.verify/1")
    assert {(f["kind"], f["key"]) for f in data["findings"]} == {
        ("unreachable", k.hex()) for k in keys[3:]}
    root = next(f for f in data["findings"] if f["key"] == keys[3].hex())
    assert keys[2].hex()[:16] in root["detail"] and "not in the store" in root["detail"]
    assert data["plan"]["unreachable_blocks"] == 7

    assert main(["verify", "--store", str(p), "--fix", "-y"]) == 0
    out = capsys.readouterr().out
    assert "unreachable" in out and "Fixed 7 of 7 problem(s)" in out
    assert {r.key for r in _records(p)} == set(keys[:2])
    _consistent(p)
    assert main(["verify", "--store", str(p)]) == 0


# -- 10: a store that a daemon serves ----------------------------------------------------------

DISK = ("--cpu-capacity", "1MiB", "--disk-capacity", "16MiB")


def test_rm_goes_through_the_serving_daemon_and_repairs_are_refused(serve, tmp_path, capsys):
    d = serve(*DISK)
    store = tmp_path / "store"
    c = connect(d.socket_path, layout=LAY, model_id="served/model", device="cpu", timeout=10)
    try:
        keys = c.block_keys(prompt_tokens(0, 8, LAY.block_tokens))
        assert c.put(keys, kv_for(keys, LAY)).wait() == 8
        c.flush()
        assert len(_records(store)) == 8 and c.lookup(keys) == 8  # on disk and warm
        s = ["--store", str(store)]

        # read-only commands work next to the daemon
        assert main(["ls", *s, "-q"]) == 0
        (nsid,) = capsys.readouterr().out.split()
        assert main(["inspect", *s]) == 0
        assert main(["verify", *s]) == 0
        assert main(["prune", *s, "--dry-run"]) == 0
        capsys.readouterr()
        # changes the daemon's memory would not see are refused, naming its socket
        for argv in (["prune", "-y"], ["verify", "--fix", "-y"], ["compact"]):
            assert main([argv[0], *s, *argv[1:]]) == 2, argv
            err = capsys.readouterr().err
            assert str(d.socket_path) in err and len(err.strip().splitlines()) == 1
        assert len(_records(store)) == 8

        # rm goes through the daemon: its warm tier stops serving the blocks too
        assert main(["rm", nsid, *s, "-y"]) == 0
        out = capsys.readouterr().out
        assert "Removed 8 block(s)" in out and f"through the daemon at {d.socket_path}" in out
        assert c.lookup(keys) == 0 and c.fetch(keys).wait().shape[0] == 0
        c.flush()
        assert _records(store) == []
        # blocks that may still be only in the daemon's memory go too
        assert c.put(keys, kv_for(keys, LAY)).wait() == 8
        assert main(["rm", nsid, *s, "-y"]) == 0
        assert "through the daemon" in capsys.readouterr().out
        assert c.lookup(keys) == 0
        c.flush()
        assert _records(store) == []

        assert c.put(keys, kv_for(keys, LAY)).wait() == 8
        c.flush()
        assert main(["rm", keys[5].hex(), *s, "-y", "--format", "json"]) == 0
        data = _json(capsys, "kvstore.rm/1")
        assert data["daemon"] == str(d.socket_path) and data["plan"]["descendants"] == 2
        assert data["removed_blocks"] == 3 and data["freed_bytes"] == 3 * 1024
        assert c.lookup(keys) == 5
        assert {r.key for r in _records(store)} == {bytes(k) for k in keys[:5]}
    finally:
        c.close()
    assert d.stop() == 0
    # no daemon any more: the offline path again
    assert main(["compact", "--store", str(store), "--format", "json"]) == 0
    _json(capsys, "kvstore.compact/1")
    assert main(["rm", keys[0].hex(), "--store", str(store), "-y", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.rm/1")
    assert data["daemon"] is None and data["removed_blocks"] == 5


def test_disk_check_fix_keeps_intact_blocks_of_a_damaged_header(tmp_path):
    # DiskTier.check(fix=True) (which verify_data reads every block) repairs the same way
    p = tmp_path / "store"
    keys, recs = _chain(p, 6)
    _flip(p, recs[5])
    _smash_header(p, recs[0].segment)
    t = DiskTier(p, capacity_bytes="1GiB")
    try:
        found = {f.key: f for f in t.check(grace_s=0)}
        assert {found[k].kind for k in keys[:5]} == {"bad_header"}
        assert found[keys[5]].kind == "checksum_mismatch"
        fixed = t.check(fix=True, grace_s=0)
        assert all(f.fixed for f in fixed) and len(fixed) == 6
        assert t.check(grace_s=0) == []
        assert {r.key for r in t.records()} == set(keys[:5])
        assert all(r.segment != recs[0].segment for r in t.records())
    finally:
        t.close()
    ok, bad = check_disk_bytes(p)
    assert ok == 5 and bad == []


def test_repair_judges_each_item_again(tmp_path):
    # the plan says "unreachable", but the missing parent is written again before the fix
    # runs: its subtree is reachable again and stays
    from kvstore.admin.repairing import repair

    p = tmp_path / "store"
    keys = _old_chain(p, 6)
    by_key = {r.key: r for r in _records(p)}
    _flip(p, by_key[keys[2]])
    _engine_drops(p, keys[2])
    res = verify(p)
    assert res.plan.unreachable_blocks == 3 and not res.ok
    t = DiskTier(p, capacity_bytes="1GiB")
    try:
        ns = Namespace.create("old/model", LAY)
        assert t.write_blocks([DiskWrite(keys[2], keys[1], ns.id, torch.from_numpy(
            block_bytes(keys[2], LAY.block_nbytes)))]) == [keys[2]]
    finally:
        t.close()
    done = repair(res)
    assert done.ok and done.fix and all("reach it again" in f.detail for f in done.findings)
    assert {r.key for r in _records(p)} == set(keys) and _leading_run(p, keys) == 6
    _consistent(p)


# -- issue 26: a hostile segment header is a finding, never a traceback -------------------------

def test_verify_reports_a_deeply_nested_header_and_fix_repairs_its_blocks(tmp_path, capsys):
    import struct

    p = tmp_path / "store"
    keys, recs = _chain(p)
    (sid,) = {r.segment for r in recs}
    path = Path(_seg_path(p, sid))
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    depth = (n - 20) // 2  # as deep as the header's own length allows, payloads untouched
    assert depth > 1500  # deeper than Python's recursion limit
    body = (b'{"__metadata__":' + b"[" * depth + b"]" * depth + b"}").ljust(n)
    mode = path.stat().st_mode
    os.chmod(path, 0o600)
    path.write_bytes(data[:8] + body + data[8 + n:])
    os.chmod(path, mode)

    assert main(["verify", "--store", str(p), "--format", "json"]) == 1
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and "Recursion" not in cap.err
    data = json.loads(cap.out)
    assert {f["kind"] for f in data["findings"]} == {"bad_header"}
    assert {f["key"] for f in data["findings"]} == {k.hex() for k in keys}
    assert all("deep" in f["detail"] for f in data["findings"])
    assert main(["verify", "--store", str(p), "--fix", "-y"]) == 0
    capsys.readouterr()
    assert {r.key for r in _records(p)} == set(keys)
    assert main(["verify", "--store", str(p)]) == 0
