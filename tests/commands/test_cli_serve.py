"""``kvstore serve`` refuses what cannot work at start, before it takes the store's lock or
binds its socket, with one line naming the option and the path (exit 2); its log speaks in
human sizes and says when a client's hello creates a new namespace (issue 16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support.admin import build_store, small_layout
from support.daemon import DaemonProcess

from kvstore.cli import main
from kvstore.daemon.preflight import MAX_SOCKET_PATH
from kvstore.sizes import format_size

LAY = small_layout()


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def _serve_all(*argvs: list[str]) -> list[subprocess.CompletedProcess]:
    """Several refused starts at once (each pays the interpreter's start-up alone)."""
    procs = [subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", *a],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL) for a in argvs]
    out = []
    for a, p in zip(argvs, procs, strict=True):
        so, se = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(a, p.returncode, so, se))
    return out


def _refused(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore serve: error: "), p.stderr
    return lines[0]


def test_store_path_that_is_a_file_is_refused_before_binding(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    sock = tmp_path / "run" / "kvstore.sock"
    for flag in ("--store", "--path"):  # --path: the old spelling
        line = _refused(_serve(flag, str(f), "--socket", str(sock)))
        assert f"--store {f} is not a directory" in line
        assert not sock.exists() and not sock.parent.exists()


def test_paths_are_named_in_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    sock = tmp_path / "run" / "kvstore.sock"
    long = tmp_path / ("d" * (MAX_SOCKET_PATH + 1)) / "s.sock"
    store = str(tmp_path / "s")
    lines = [_refused(p) for p in _serve_all(
        ["--store", str(f / "sub"), "--socket", str(sock)],
        ["--store", store, "--socket", str(f / "s.sock")],
        ["--store", store, "--socket", str(long)],
        ["--store", store, "--socket", str(sock), "--shm-dir", str(f)],
        ["--store", store, "--socket", str(f)],
    )]
    assert f"--store {f / 'sub'} cannot be created: {f} is not a directory" in lines[0]
    assert f"--socket {f}" in lines[1] and "not a directory" in lines[1]
    assert "is at most 107" in lines[2]
    assert f"--shm-dir {f} is not a directory" in lines[3]
    assert f"--socket {f} exists and is not a socket" in lines[4]


def test_segments_without_index_refused_at_start(tmp_path):
    store = tmp_path / "store"
    build_store(store, "m/a", prompts=1, blocks=2)
    for p in (store / "index").iterdir():
        p.unlink()
    sock = tmp_path / "run" / "kvstore.sock"
    line = _refused(_serve("--store", str(store), "--socket", str(sock)))
    assert "kvstore recover" in line and not sock.exists()


def test_warm_tier_that_does_not_fit_is_refused_at_start(tmp_path):
    """A --cpu-capacity larger than /dev/shm or the host's memory: one line and exit 2 at
    start (issue 31: the daemon started, and the first client's connect got a traceback)."""
    st = os.statvfs("/dev/shm")
    too_big = 2 * max(st.f_blocks * st.f_frsize, os.sysconf("SC_PHYS_PAGES") * os.sysconf(
        "SC_PAGE_SIZE"))
    sock = tmp_path / "run" / "kvstore.sock"
    p = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--store",
                          str(tmp_path / "store"), "--socket", str(sock), "--cpu-capacity",
                          str(too_big)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, stdin=subprocess.DEVNULL)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail(f"kvstore serve --cpu-capacity {too_big} started")
    line = _refused(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    assert f"--cpu-capacity {format_size(too_big)} does not fit in shared memory" in line
    assert "lower --cpu-capacity" in line and not sock.exists()


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path / "store", tmp_path / "run" / "kvstore.sock", "--cpu-capacity",
                      "1MiB", "--disk-capacity", "16MiB").start()
    yield d
    d.stop()


def test_log_is_in_human_sizes_and_names_new_namespaces(daemon):
    from kvstore.client import connect

    kv = torch.zeros(LAY.batch_shape(2), dtype=LAY.dtype)
    notes = []
    for model in ("org/Model-8B", "org/Model-8b", "org/Model-8B"):  # the second: a typo
        with connect(daemon.socket_path, layout=LAY, model_id=model, device="cpu") as c:
            notes.append(c.new_namespace)  # the client is told too, in hello's reply
            keys = c.block_keys(list(range(2 * LAY.block_tokens)))
            c.put(keys, kv).wait()
            c.flush()
    assert notes[0].startswith("new namespace") and notes[2] == ""
    assert "differing in one field only" in notes[1] and "org/Model-8B" in notes[1]
    log = daemon.log()
    assert "warm tier 1.0 MiB per namespace, disk tier 16.0 MiB" in log
    assert "1048576" not in log and "16777216" not in log  # no raw byte counts
    assert "warm slots of 1.0 KiB (1.0 MiB)" in log
    new = [ln for ln in log.splitlines() if "new namespace" in ln]
    assert len(new) == 2, log  # the third hello reuses the first namespace
    assert "INFO" in new[0] and "model_id 'org/Model-8B'" in new[0]
    assert "layout L2 P2 T4 H2 D16" in new[0] and "dtype bfloat16" in new[0]
    typo = new[1]
    assert "model_id 'org/Model-8b'" in typo and "differing in one field only" in typo
    assert "(model_id 'org/Model-8B')" in typo


def test_stats_socket_finds_the_daemons_store(daemon, tmp_path, capsys, monkeypatch):
    from kvstore.client import connect

    with connect(daemon.socket_path, layout=LAY, model_id="live/m", device="cpu") as c:
        keys = c.block_keys(list(range(3 * LAY.block_tokens)))
        c.put(keys, torch.zeros(LAY.batch_shape(3), dtype=LAY.dtype)).wait()
        c.flush()
    monkeypatch.setenv("KVSTORE_PATH", str(tmp_path / "elsewhere"))  # not the daemon's
    assert main(["stats", "--socket", str(daemon.socket_path), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["store"] == str(daemon.path)
    assert [n["model_id"] for n in data["namespaces"]] == ["live/m"]
    warm = [t for t in data["namespaces"][0]["stats"]["tiers"] if t["name"] == "warm"][0]
    assert warm["policy"] == "adaptive" and warm["policy_state"].startswith("scale ")
    assert main(["stats", "--socket", str(daemon.socket_path)]) == 0
    out = capsys.readouterr().out
    assert f"(store {daemon.path})" in out
    assert f"adaptive ({warm['policy_state']})" in out  # the policy's choice, in the table


def test_daemon_subprocess_ignores_a_checkout_in_the_working_directory(tmp_path, monkeypatch):
    # a source tree whose kvstore/cli.py fails: `python -m kvstore.cli` from there ran it
    fake = tmp_path / "checkout" / "kvstore"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "cli.py").write_text("raise SystemExit('the checkout in the cwd ran')\n")
    monkeypatch.chdir(fake.parent)
    d = DaemonProcess(tmp_path / "store", tmp_path / "run" / "kvstore.sock", "--cpu-capacity",
                      "1MiB", "--disk-capacity", "0").start()
    try:
        assert d.answers()
    finally:
        d.stop()
    assert "the checkout in the cwd ran" not in d.log()


def test_stats_socket_finds_the_store_while_the_daemon_closes_files(daemon, monkeypatch):
    """An fd of the daemon that closes between listing /proc/PID/fd and reading its link (the
    daemon opens and closes segment files all the time) does not hide its daemon.lock."""
    from kvstore.commands import stats

    real = os.readlink
    calls = []

    def flaky(path):
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path)

    monkeypatch.setattr(stats.os, "readlink", flaky)
    assert stats.daemon_store_path(str(daemon.socket_path)) == daemon.path
