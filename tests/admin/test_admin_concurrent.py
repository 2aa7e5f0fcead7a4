"""``rm`` / ``prune`` / ``compact`` / ``verify`` on a store that another process is reading and
writing at the same time (``python -m support.admin worker``: put/fetch in a loop
through ``open_store``, every fetched byte checked against the key-derived contents)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import conftest
from support.admin import build_store, check_disk_bytes

from kvstore.admin import list_blocks, list_namespaces
from kvstore.cli import main
from kvstore.tiers.disk import segments as seg

#: tests/: the worker runs as ``python -m support.admin`` from here
TESTS = str(conftest.TESTS)


def _run(capsys, *args: str) -> tuple[int, dict]:
    rc = main(list(args))
    out = capsys.readouterr().out
    return rc, (json.loads(out) if out.strip() else {})


def _wait_for(path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("worker did not get ready in time")
        time.sleep(0.05)


def test_admin_commands_while_another_process_reads_and_writes(tmp_path, capsys):
    p = tmp_path / "store"
    victim = build_store(p, "victim/model", prompts=3, blocks=3, salt=5)
    keep = build_store(p, "keep/model", prompts=4, blocks=3, salt=6, flush_each=True)
    segdir = p / "segments"
    first = sorted(segdir.iterdir())[0]
    orphan = segdir / seg.segment_name(0xFFFF)  # a crash leftover for prune to find
    shutil.copy(first, orphan)
    old = time.time() - 3600
    os.utime(orphan, (old, old))

    ready, stop, result = tmp_path / "ready", tmp_path / "stop", tmp_path / "worker.json"
    worker = subprocess.Popen(
        [sys.executable, "-m", "support.admin", "worker", "--store", str(p),
         "--ready", str(ready), "--stop", str(stop), "--out", str(result),
         "--max-seconds", "90"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=TESTS)
    removed: set[str] = set()
    s = ["--store", str(p)]
    try:
        _wait_for(ready, worker, 90)
        ids = {e.model_id: e.namespace_id for e in list_namespaces(p).items}
        rc, data = _run(capsys, "rm", ids["victim/model"], *s, "-y", "--format", "json")
        assert rc == 0 and data["removed_blocks"] == 9
        removed |= set(data["plan"]["keys"]) | set(data["late_keys"])
        rounds = 0
        t_end = time.monotonic() + 4.0
        while rounds < 4 or time.monotonic() < t_end:
            roots = sorted(e.key for e in list_blocks(
                p, filters=["model=worker/model", "parent=none"]).items)
            if roots:  # the worker puts removed chains back: there is always one to remove
                rc, data = _run(capsys, "rm", roots[rounds % len(roots)], *s, "-y",
                                "--format", "json")
                assert rc in (0, 1), data  # 1: gone meanwhile (not found)
                if data:
                    removed |= set(data["plan"]["keys"]) | set(data["late_keys"])
            rc, data = _run(capsys, "compact", *s, "--threshold", "1.0", "--format", "json")
            assert rc == 0
            rc, data = _run(capsys, "prune", *s, "-y", "--format", "json")
            assert rc == 0
            assert not [f for f in data["findings"] if f["kind"] not in
                        ("orphan_segment",)], data["findings"]
            rc, data = _run(capsys, "verify", *s, "--format", "json")
            assert rc == 0, data["findings"]
            rounds += 1
        assert not orphan.exists()
        stop.write_text("stop")
        assert worker.wait(timeout=90) == 0, worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    res = json.loads(result.read_text())
    # every block the worker looked up and fetched had exactly the bytes of its key
    assert res["mismatches"] == 0 and res["fetched"] > 0 and res["iterations"] > 8

    # nothing on disk is damaged, nothing removed is back unless the worker put it back, and
    # nothing that was not removed is lost
    ok, bad = check_disk_bytes(p)
    assert bad == [] and ok > 0
    on_disk = {e.key for e in list_blocks(p).items}
    assert not on_disk & {k.hex() for c in victim for k in c}
    assert {k.hex() for c in keep for k in c} <= on_disk
    assert set(res["put_keys"]) - removed <= on_disk
    assert removed & set(res["put_keys"])  # the worker's blocks were really removed at times
    rc, data = _run(capsys, "verify", *s, "--format", "json")
    assert rc == 0 and data["blocks_checked"] == len(on_disk)
