"""``kvstore verify / prune / compact`` (and the library functions behind them) on stores built
with ``open_store``, with planted damage."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import pytest
from support.admin import build_store, check_disk_bytes, small_layout

from kvstore.admin import (
    CompactReport,
    FindingEntry,
    PruneResult,
    VerifyResult,
    list_blocks,
    verify,
)
from kvstore.cli import main
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk import segments as seg

LAY = small_layout()


def _json(capsys, schema: str) -> dict:
    data = json.loads(capsys.readouterr().out)
    assert data.pop("schema") == schema
    return data


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _records(p):
    t = DiskTier(p, capacity_bytes=0, readonly=True)
    try:
        return list(t.records())
    finally:
        t.close()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """6 prompts of 4 blocks, one segment per prompt (18 blocks in 6 segments)."""
    p = tmp_path_factory.mktemp("maint") / "store"
    chains = build_store(p, "meta/llama-a", prompts=6, blocks=4, flush_each=True)
    return p, chains


@pytest.fixture
def store(base, tmp_path):
    src, chains = base
    dst = tmp_path / "store"
    shutil.copytree(src, dst)
    return dst, chains


def _descendants(p, keys: set[str]) -> set[str]:
    """Keys (hex) of the blocks below ``keys`` that are not in ``keys``."""
    recs = _records(p)
    out: set[str] = set()
    grew = True
    while grew:
        grew = False
        for r in recs:
            k = r.key.hex()
            if r.parent is not None and r.parent.hex() in (keys | out) and k not in keys | out:
                out.add(k)
                grew = True
    return out


def _by_segment(p) -> dict[int, list]:
    out: dict[int, list] = {}
    for r in _records(p):
        out.setdefault(r.segment, []).append(r)
    for v in out.values():
        v.sort(key=lambda r: r.offset)
    return out


def test_verify_clean_store(store, capsys):
    p, _ = store
    assert main(["verify", "--store", str(p)]) == 0
    assert "Verified 18 block(s) (18.0 KiB) in 6 segment(s): no problems found." in \
        capsys.readouterr().out
    assert main(["verify", "--store", str(p), "--format", "json"]) == 0
    data = _json(capsys, "kvstore.verify/1")
    assert list(data) == _fields(VerifyResult)
    assert data == {"store": str(p), "fix": False, "blocks_checked": 18,
                    "bytes_checked": 18 * 1024, "segments_checked": 6, "findings": [],
                    "unfixed": 0, "grace_s": 60.0, "plan": {
                        "drop_blocks": 0, "drop_bytes": 0, "unreachable_blocks": 0,
                        "unreachable_bytes": 0, "repair_blocks": 0, "repair_bytes": 0,
                        "repair_segments": 0, "remove_files": 0, "remove_file_bytes": 0,
                        "rebuild_index": False, "young_unreachable": 0,
                        "chmod_paths": 0}}


def test_verify_finds_planted_damage_and_fix_removes_it(store, capsys):
    p, _ = store
    segs = _by_segment(p)
    sids = sorted(segs)
    # 1. flip a byte inside a block
    flip = segs[sids[0]][1]
    path0 = os.path.join(p, "segments", seg.segment_name(sids[0]))
    with open(path0, "r+b") as f:
        f.seek(flip.offset + 100)
        b = f.read(1)
        f.seek(flip.offset + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    # 2. truncate a segment in the middle of its last block
    cut = segs[sids[1]][-1]
    os.truncate(os.path.join(p, "segments", seg.segment_name(sids[1])), cut.offset + 10)
    # 3. delete a segment
    gone = segs[sids[2]]
    os.unlink(os.path.join(p, "segments", seg.segment_name(sids[2])))
    bad_keys = {flip.key.hex(), cut.key.hex()} | {r.key.hex() for r in gone}
    # their descendants can no longer be looked up: dropped with them
    below = _descendants(p, bad_keys)
    assert below  # the flipped block is the second of its prompt

    assert main(["verify", "--store", str(p), "--format", "json"]) == 1
    data = _json(capsys, "kvstore.verify/1")
    found = {f["key"]: f for f in data["findings"]}
    assert set(found) == bad_keys | below
    assert found[flip.key.hex()]["kind"] == "checksum_mismatch"
    assert found[cut.key.hex()]["kind"] == "short_segment"
    assert {found[r.key.hex()]["kind"] for r in gone} == {"missing_segment"}
    assert {found[k]["kind"] for k in below} == {"unreachable"}
    assert {f["action"] for f in data["findings"]} == {"drop"}
    n = len(bad_keys | below)
    assert not any(f["fixed"] for f in data["findings"]) and data["unfixed"] == n
    assert all(list(f) == _fields(FindingEntry) for f in data["findings"])
    assert data["plan"]["drop_blocks"] == len(bad_keys)
    assert data["plan"]["unreachable_blocks"] == len(below)
    # the library gives the same answer (a read-only verify changed nothing)
    lib = verify(p)
    assert {f.key for f in lib.findings} == bad_keys | below and lib.unfixed == n
    # human output
    assert main(["verify", "--store", str(p)]) == 1
    out = capsys.readouterr().out
    assert "checksum_mismatch" in out and "short_segment" in out and "missing_segment" in out
    assert "unreachable" in out
    assert f"{n} problem(s), 0 fixed" in out and "verify --fix" in out

    # --fix plans and asks: without a terminal and without -y it refuses, changing nothing
    assert main(["verify", "--store", str(p), "--fix", "--format", "json"]) == 1
    assert "pass -y" in capsys.readouterr().err
    assert len(_records(p)) == 18
    assert main(["verify", "--store", str(p), "--fix", "-y", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.verify/1")
    assert {f["key"] for f in data["findings"]} == bad_keys | below
    assert all(f["fixed"] for f in data["findings"]) and data["unfixed"] == 0
    assert data["fix"] is True
    assert main(["verify", "--store", str(p)]) == 0
    left = {r.key.hex() for r in _records(p)}
    assert not left & (bad_keys | below) and len(left) == 18 - n
    ok, bad = check_disk_bytes(p)
    assert ok == len(left) and bad == []


def test_prune(store, capsys):
    p, _ = store
    segdir = os.path.join(p, "segments")
    segs = _by_segment(p)
    sids = sorted(segs)
    old = time.time() - 3600
    orphan = os.path.join(segdir, seg.segment_name(0xABC))
    shutil.copy(os.path.join(segdir, seg.segment_name(sids[0])), orphan)
    os.utime(orphan, (old, old))
    old_tmp = os.path.join(segdir, seg.temp_name(0xABD))
    with open(old_tmp, "wb") as f:
        f.write(b"x" * 1000)
    os.utime(old_tmp, (old, old))
    young_tmp = os.path.join(segdir, seg.temp_name(0xABE))  # a write in flight elsewhere
    with open(young_tmp, "wb") as f:
        f.write(b"y" * 500)
    stray = os.path.join(segdir, "notes.txt")
    with open(stray, "w") as f:
        f.write("mine")
    gone = segs[sids[3]]  # records without payload
    os.unlink(os.path.join(segdir, seg.segment_name(sids[3])))

    assert main(["prune", "--store", str(p), "--dry-run", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.prune/1")
    assert list(data) == _fields(PruneResult) and data["dry_run"] is True
    kinds = sorted((f["kind"], f["key"] or os.path.basename(f["path"])) for f in data["findings"])
    assert kinds == sorted(
        [("orphan_segment", os.path.basename(orphan)), ("temp_file", os.path.basename(old_tmp)),
         ("unknown_file", "notes.txt")] + [("missing_segment", r.key.hex()) for r in gone])
    assert data["removed"] == 0 and os.path.exists(orphan) and os.path.exists(old_tmp)
    sizes = {f["kind"]: f["nbytes"] for f in data["findings"] if f["key"] is None}
    assert sizes["orphan_segment"] == os.path.getsize(orphan) and sizes["temp_file"] == 1000
    assert {f["nbytes"] for f in data["findings"] if f["kind"] == "missing_segment"} == {1024}

    assert main(["prune", "--store", str(p)]) == 1  # no terminal, no -y: refused
    assert "pass -y" in capsys.readouterr().err
    assert os.path.exists(orphan)

    assert main(["prune", "--store", str(p), "-y"]) == 0
    out = capsys.readouterr().out
    assert "orphan_segment" in out and f"Pruned {2 + len(gone)} item(s)" in out
    assert not os.path.exists(orphan) and not os.path.exists(old_tmp)
    assert os.path.exists(young_tmp) and os.path.exists(stray)  # in flight / not ours
    assert not {r.key for r in gone} & {r.key for r in _records(p)}
    assert main(["prune", "--store", str(p), "--dry-run"]) == 0
    assert "Nothing to prune." in capsys.readouterr().out
    # --grace 0: the young temp file goes too
    assert main(["prune", "--store", str(p), "-y", "--grace", "0", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.prune/1")
    assert [f["kind"] for f in data["findings"] if f["fixed"]] == ["temp_file"]
    assert data["freed_bytes"] == 500 and not os.path.exists(young_tmp)
    os.unlink(stray)
    assert main(["verify", "--store", str(p)]) == 0


def test_compact_after_rm_reclaims_dead_bytes(store, capsys):
    p, chains = store
    # drop the last block of every prompt: every segment keeps 1..3 of its blocks
    tails = {c[-1].hex() for c in chains}
    assert main(["rm", *tails, "--store", str(p), "-y", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.rm/1")
    assert data["removed_blocks"] == 6 and data["dead_bytes"] == 6 * 1024
    before = {e.key for e in list_blocks(p).items}
    assert main(["compact", "--store", str(p), "--threshold", "0.5"]) == 0
    assert "Nothing to compact" in capsys.readouterr().out  # every segment >= 50% live
    assert main(["compact", "--store", str(p), "--threshold", "1.0", "--format", "json"]) == 0
    data = _json(capsys, "kvstore.compact/1")
    assert list(data) == _fields(CompactReport)
    assert data["segments_rewritten"] == 6 and data["blocks_moved"] == 12
    assert data["dead_bytes_before"] == 6 * 1024 and data["dead_bytes_after"] == 0
    assert data["reclaimed_bytes"] > 6 * 1024 and data["segment_bytes_after"] < \
        data["segment_bytes_before"]
    assert {e.key for e in list_blocks(p).items} == before
    ok, bad = check_disk_bytes(p)
    assert ok == 12 and bad == []
    assert main(["compact", "--store", str(p), "--threshold", "2"]) == 2
    assert "threshold" in capsys.readouterr().err
    assert main(["verify", "--store", str(p)]) == 0


def test_old_maintenance_home_is_gone():
    # rm, prune, verify/repair and compact live in modules of their own, exported by
    # kvstore.admin; the re-export shim kvstore.admin.maintenance is gone (issue 32)
    import importlib.util

    import kvstore.admin as admin

    assert importlib.util.find_spec("kvstore.admin.maintenance") is None
    for name in ("compact", "prune", "remove", "repair", "verify"):
        assert callable(getattr(admin, name)), name


def test_verify_one_namespace_checks_and_fixes_only_its_blocks(tmp_path, capsys):
    p = tmp_path / "store"
    build_store(p, "meta/llama-a", prompts=3, blocks=4, flush_each=True)
    build_store(p, "meta/llama-b", prompts=2, blocks=4, flush_each=True, salt=7)
    recs = _records(p)
    ns = {}
    for r in recs:
        ns.setdefault(r.namespace_id, []).append(r)
    assert len(ns) == 2
    t = DiskTier(p, capacity_bytes=0, readonly=True)
    try:
        infos = {i.model_id: i.namespace_id for i in t.namespaces()}
    finally:
        t.close()
    b_id = infos["meta/llama-b"]
    victim = sorted(ns[b_id], key=lambda r: (r.segment, r.offset))[0]
    with open(os.path.join(p, "segments", seg.segment_name(victim.segment)), "r+b") as f:
        f.seek(victim.offset + 5)
        byte = f.read(1)
        f.seek(victim.offset + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    a_blocks = len(ns[infos["meta/llama-a"]])
    assert main(["verify", "--store", str(p), "--namespace", "meta/llama-a",
                 "--format", "json"]) == 0
    data = _json(capsys, "kvstore.verify/1")
    assert data["blocks_checked"] == a_blocks and data["findings"] == []
    assert main(["verify", "--store", str(p), "--namespace", b_id.hex()[:8],
                 "--format", "json"]) == 1
    data = _json(capsys, "kvstore.verify/1")
    assert data["blocks_checked"] == len(ns[b_id])
    assert {f["namespace_id"] for f in data["findings"]} == {b_id.hex()}
    assert victim.key.hex() in {f["key"] for f in data["findings"]}
    assert main(["verify", "--store", str(p), "--namespace", "meta/llama-b", "--fix", "-y",
                 "--format", "json"]) == 0
    capsys.readouterr()
    after = {(r.namespace_id, r.key) for r in _records(p)}
    assert all((infos["meta/llama-a"], r.key) in after for r in ns[infos["meta/llama-a"]])
    assert (b_id, victim.key) not in after
    assert main(["verify", "--store", str(p), "--namespace", "meta/llama-typo"]) == 2
    assert "did you mean" in capsys.readouterr().err
