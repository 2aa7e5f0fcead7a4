"""File modes of a store (issue 26, item 3): private whatever the umask (directories 0700,
files 0600), shared with one group on request (``group=`` / ``serve --group``: 2750/0640),
a store other users can write refused with the path and the fix, one others can read
tightened with a WARNING when opened for writing, and ``kvstore verify`` reporting loose
modes (docs/operations.md, "File modes")."""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
from support.admin import build_store, kv_for, open_test_store, prompt_tokens, small_layout

from kvstore.errors import ConfigError

LAY = small_layout()
MODEL = "perm/test"


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def tree(root: Path) -> dict[Path, os.stat_result]:
    """Every directory and file under ``root`` (``root`` included), lstat'ed."""
    out = {root: root.lstat()}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            out[p] = p.lstat()
    return out


def assert_modes(root: Path, dir_mode: int, file_mode: int, gid: int | None = None) -> None:
    """Every path under ``root`` as promised; LMDB's lock.mdb is group-writable when shared
    (group readers record themselves in it)."""
    bad = []
    for p, st in tree(root).items():
        want = dir_mode if stat.S_ISDIR(st.st_mode) else file_mode
        if p.name == "lock.mdb" and gid is not None:
            want = 0o660
        if stat.S_IMODE(st.st_mode) != want or (gid is not None and st.st_gid != gid):
            bad.append(f"{p}: {stat.S_IMODE(st.st_mode):04o} gid {st.st_gid}")
    assert not bad, f"expected {dir_mode:04o}/{file_mode:04o}: " + "; ".join(bad)


def fill(path: Path, *, prompts: int = 4, **kw) -> list[list[bytes]]:
    """Put ``prompts`` prompts of 4 blocks, a segment each (flushed one by one)."""
    return build_store(path, MODEL, prompts=prompts, blocks=4, flush_each=True, **kw)


def churn(path: Path, chains: list[list[bytes]], **kw) -> None:
    """Evict half the chains from disk, compact every segment with a dead byte, recover."""
    from kvstore.admin.compaction import compact
    from kvstore.tiers.disk.recover import recover

    with open_test_store(path, MODEL, **kw) as s:
        for ks in chains[::2]:
            s.evict(ks[1:], tier="disk")
        s.flush()
    res = compact(path, threshold=1.0)
    assert res.segments_rewritten
    recover(path, force=True)
    # and the store still serves after all that
    with open_test_store(path, MODEL, **kw) as s:
        keys = s.block_keys(prompt_tokens(1, 4, LAY.block_tokens))
        got = s.fetch(keys).wait()
        want = kv_for(keys, LAY)
        assert got.shape[0] == 4 and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("mask", [0o022, 0o000])
def test_a_new_store_is_private_whatever_the_umask(tmp_path, mask):
    root = tmp_path / "a" / "store"  # its parent is created too
    with umask(mask):
        chains = fill(root)
        assert_modes(root, 0o700, 0o600)
        churn(root, chains)
    assert any(p.name.startswith("index.damaged-") for p in root.iterdir())  # recover's
    assert_modes(root, 0o700, 0o600)
    # a directory created above the store is never writable by others
    assert not (root.parent.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def test_group_sharing_gives_2750_and_0640(tmp_path):
    gid = os.getgid()
    root = tmp_path / "store"
    with umask(0o077):  # a umask that would take the group's bits away
        chains = fill(root, group=grp.getgrgid(gid).gr_name)
        assert_modes(root, 0o2750, 0o640, gid)
        churn(root, chains, group=gid)
    assert_modes(root, 0o2750, 0o640, gid)
    # a store shared with a group stays shared when opened without group=
    with open_test_store(root, MODEL):
        pass
    assert_modes(root, 0o2750, 0o640, gid)


def test_an_unknown_group_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no-such-group-kv"):
        open_test_store(tmp_path / "s", MODEL, group="no-such-group-kv")


@pytest.mark.parametrize("where", ["", "segments", "index", "index/data.mdb"])
def test_a_store_others_can_write_is_refused(tmp_path, where):
    root = tmp_path / "store"
    fill(root, prompts=1)
    target = root / where if where else root
    os.chmod(target, 0o777 if target.is_dir() else 0o666)
    with pytest.raises(ConfigError) as ei:
        open_test_store(root, MODEL)
    msg = str(ei.value)
    assert type(ei.value).__name__ == "StorePermissionError"
    assert str(target) in msg and "chmod" in msg and str(root) in msg
    # read-only openers refuse too (an export would ship what others may have written)
    from kvstore.admin import list_namespaces

    with pytest.raises(ConfigError, match="chmod"):
        list_namespaces(root)


def test_group_writable_is_refused_unless_shared_with_that_group(tmp_path):
    root = tmp_path / "store"
    fill(root, prompts=1)
    os.chmod(root / "segments", 0o770)
    with pytest.raises(ConfigError, match="group"):
        open_test_store(root, MODEL)
    os.chmod(root / "segments", 0o700)
    with open_test_store(root, MODEL, group=os.getgid()):
        pass
    os.chmod(root / "segments", 0o2770)  # the group it is shared with may write
    with open_test_store(root, MODEL):
        pass


def test_an_old_store_readable_by_others_is_tightened_with_a_warning(tmp_path, caplog):
    root = tmp_path / "store"
    fill(root, prompts=2)
    for p, st in tree(root).items():  # as older versions left it under umask 022
        os.chmod(p, 0o755 if stat.S_ISDIR(st.st_mode) else 0o644)
    from kvstore.admin import list_namespaces

    list_namespaces(root)  # read-only: changes nothing
    assert stat.S_IMODE((root / "segments").stat().st_mode) == 0o755
    with caplog.at_level(logging.WARNING, logger="kvstore"), open_test_store(root, MODEL):
        pass
    assert_modes(root, 0o700, 0o600)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(root / "segments") in m and "0755" in m and "0700" in m for m in warned), warned


def test_verify_reports_a_0644_segment(tmp_path):
    from kvstore.admin import verify

    root = tmp_path / "store"
    fill(root, prompts=2)
    seg = sorted((root / "segments").glob("*.safetensors"))[0]
    os.chmod(seg, 0o644)
    res = verify(root)
    found = [f for f in res.findings if f.kind == "loose_mode"]
    assert [f.path for f in found] == [str(seg)], res.findings
    assert "0644" in found[0].detail and "0600" in found[0].detail
    assert not res.ok  # exit status 1
    fixed = verify(root, fix=True)
    assert fixed.ok and stat.S_IMODE(seg.stat().st_mode) == 0o600
    assert verify(root).findings == ()


def test_verify_reports_group_readable_without_sharing(tmp_path):
    from kvstore.admin import verify

    root = tmp_path / "store"
    fill(root, prompts=1)
    os.chmod(root / "index" / "data.mdb", 0o640)
    found = [f for f in verify(root).findings if f.kind == "loose_mode"]
    assert [f.path for f in found] == [str(root / "index" / "data.mdb")]


def test_verify_cli_exits_1_on_loose_modes(tmp_path, capsys):
    from kvstore.cli import main

    root = tmp_path / "store"
    fill(root, prompts=1)
    os.chmod(root / "segments", 0o755)
    rc = main(["verify", "--store", str(root)])
    out = capsys.readouterr().out
    assert rc == 1 and "loose_mode" in out


def test_daemon_lock_is_private(tmp_path):
    from kvstore.lockfile import DaemonLock

    root = tmp_path / "store"
    with umask(0o000):
        lock = DaemonLock.acquire(root, str(tmp_path / "s.sock"), "00" * 16)
    try:
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert stat.S_IMODE(lock.path.stat().st_mode) == 0o600
    finally:
        lock.release(clean=True)


def test_serve_group_shares_the_store(tmp_path):
    from support.daemon import DaemonProcess

    from kvstore.client import connect

    gid = os.getgid()
    root = tmp_path / "store"
    d = DaemonProcess(root, tmp_path / "run" / "kvstore.sock", "--cpu-capacity", "1MiB",
                      "--disk-capacity", "16MiB", "--group", grp.getgrgid(gid).gr_name).start()
    try:
        with connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu") as c:
            keys = c.block_keys(prompt_tokens(0, 2, LAY.block_tokens))
            c.put(keys, kv_for(keys, LAY)).wait()
            c.flush()
    finally:
        assert d.stop() == 0, d.log()
    assert_modes(root, 0o2750, 0o640, gid)


def test_serve_refuses_a_world_writable_store(tmp_path):
    import subprocess
    import sys

    root = tmp_path / "store"
    root.mkdir()
    os.chmod(root, 0o777)
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--store", str(root),
                        "--socket", str(tmp_path / "run" / "s.sock")],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 2 and str(root) in p.stderr and "chmod" in p.stderr, p.stderr


def test_an_exported_pack_is_private(tmp_path):
    from kvstore.packs.export import export_pack

    root = tmp_path / "store"
    fill(root, prompts=1)
    out = tmp_path / "p.kvpack"
    with umask(0o022):
        export_pack(root, MODEL, out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
