"""``kvstore ls / inspect / rm / stats`` through the real entry point (in process with
``kvstore.cli.main`` and in subprocesses with ``python -m kvstore.cli``) on stores built with
``open_store``."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pty
import shutil
import subprocess
import sys
import time

import pytest
import torch
from support.admin import (
    block_bytes,
    build_store,
    check_disk_bytes,
    cli_without_torch,
    kv_for,
    open_test_store,
    prompt_tokens,
    small_layout,
)

from kvstore.admin import (
    BlockEntry,
    FindingEntry,
    NamespaceEntry,
    inspect_store,
    list_blocks,
    list_namespaces,
    store_stats,
    to_jsonable,
)
from kvstore.cli import main
from kvstore.namespace import Namespace
from kvstore.tiers.disk import DISK_FORMAT_VERSION, DiskTier, DiskWrite

LAY = small_layout()
BIG = small_layout(head_dim=64)  # 4 KiB blocks
OLD_S = 10 * 86400


def _cli(*args: str, stdin=subprocess.DEVNULL, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], stdin=stdin,
                          capture_output=True, text=True, timeout=120, env=env)


def _json(capsys) -> dict:
    out = capsys.readouterr().out
    data = json.loads(out)
    return data


@pytest.fixture(scope="module")
def base_store(tmp_path_factory):
    """Four namespaces: meta/llama-a (18 blocks in 6 segments; one prompt fetched once:
    4 hits), qwen/b (9 blocks), big/model (4 blocks of 4 KiB), old/model (3 blocks written
    10 days ago, keys aaaa00.., aaaa01.., aaaa02..)."""
    p = tmp_path_factory.mktemp("admin") / "store"
    chains = {
        "meta/llama-a": build_store(p, "meta/llama-a", prompts=6, blocks=4, flush_each=True),
        "qwen/b": build_store(p, "qwen/b", prompts=3, blocks=3, salt=2),
        "big/model": build_store(p, "big/model", prompts=2, blocks=2, layout=BIG, salt=3),
    }
    with open_test_store(p, "meta/llama-a") as s:  # a fresh process's memory: read from disk
        keys = s.block_keys(prompt_tokens(1, 4, LAY.block_tokens))
        assert s.lookup(keys) == 4
        assert s.fetch(keys).wait().shape[0] == 4
    ns = Namespace.create("old/model", LAY)
    t = DiskTier(p, capacity_bytes="1GiB", clock=lambda: time.time() - OLD_S)
    try:
        t.register_namespace(ns)
        keys = [bytes([0xAA, 0xAA, i]) + bytes([i]) * 29 for i in range(3)]
        t.write_blocks([DiskWrite(k, keys[i - 1] if i else None, ns.id,
                                  torch.from_numpy(block_bytes(k, LAY.block_nbytes)))
                        for i, k in enumerate(keys)])
    finally:
        t.close()
    chains["old/model"] = [keys]
    ids = {e.model_id: e.namespace_id for e in list_namespaces(p).items}
    return p, chains, ids


@pytest.fixture
def store(base_store, tmp_path):
    """A private copy of the base store (for tests that change it)."""
    src, chains, ids = base_store
    dst = tmp_path / "store"
    shutil.copytree(src, dst)
    return dst, chains, ids


def test_ls_table(base_store, capsys):
    p, _, _ = base_store
    assert main(["ls", "--store", str(p)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "MODEL", "REVISION", "LAYOUT", "BLOCKS", "SIZE", "TIERS",
                                "LAST", "ACCESSED", "HITS"]
    row = next(ln for ln in lines if "meta/llama-a" in ln)
    assert "18.0 KiB" in row and " disk " in row and row.split()[-1] == "4"
    assert "ago" in row
    old = next(ln for ln in lines if "old/model" in ln)
    assert "10 days ago" in old
    # aligned: every row has its SIZE column at the same place
    cols = [ln.index("KiB") for ln in lines[1:5]]
    assert len(set(cols)) == 1
    assert "Found 4 namespace(s): 34 block(s), 46.0 KiB on disk." in out


def test_ls_json_matches_library(base_store, capsys):
    p, _, _ = base_store
    assert main(["ls", "--store", str(p), "--format", "json"]) == 0
    data = _json(capsys)
    assert data.pop("schema") == "kvstore.ls/1"
    assert data == to_jsonable(list_namespaces(p))
    assert [NamespaceEntry(**{k: tuple(map(tuple, v)) if k == "extras" else
                              tuple(v) if isinstance(v, list) else v for k, v in it.items()})
            for it in data["items"]] == list(list_namespaces(p).items)
    assert main(["ls", "--blocks", "--store", str(p), "--format", "json", "--sort", "key"]) == 0
    data = _json(capsys)
    assert data.pop("schema") == "kvstore.ls/1" and data["kind"] == "blocks"
    lib = list_blocks(p, sort="key")
    assert data == to_jsonable(lib)
    assert [BlockEntry(**{k: tuple(v) if isinstance(v, list) else v for k, v in it.items()})
            for it in data["items"]] == list(lib.items)
    assert data["total"] == 34 and len({i["key"] for i in data["items"]}) == 34


def _ids(capsys, *args) -> list[str]:
    assert main(["ls", "-q", *args]) == 0
    return capsys.readouterr().out.split()


def test_ls_filters_sort_limit_quiet(base_store, capsys):
    p, chains, ids = base_store
    s = ["--store", str(p)]
    assert _ids(capsys, *s, "--sort", "size") == [ids["meta/llama-a"], ids["big/model"],
                                                  ids["qwen/b"], ids["old/model"]]
    assert _ids(capsys, *s, "--sort", "size:asc", "--limit", "2") == [ids["old/model"],
                                                                      ids["qwen/b"]]
    assert _ids(capsys, *s, "--sort", "model") == [ids[m] for m in sorted(ids)]
    assert _ids(capsys, *s, "-f", "accessed>7d") == [ids["old/model"]]
    assert set(_ids(capsys, *s, "-f", "accessed<1h")) == set(ids.values()) - {ids["old/model"]}
    assert _ids(capsys, *s, "-f", "model~LLAMA") == [ids["meta/llama-a"]]
    assert _ids(capsys, *s, "-f", "model=qwen/b") == [ids["qwen/b"]]
    assert _ids(capsys, *s, "-f", "size>10KiB", "-f", "size<18KiB") == [ids["big/model"]]
    assert _ids(capsys, *s, "-f", "size>1GB") == []
    assert len(_ids(capsys, *s, "-f", "tier=disk")) == 4
    assert _ids(capsys, *s, "-f", "tier=hot") == []
    assert _ids(capsys, *s, "-f", "hits>=1") == [ids["meta/llama-a"]]
    assert _ids(capsys, *s, "-f", "layout~D64") == [ids["big/model"]]
    assert _ids(capsys, *s, "-f", f"id={ids['qwen/b'][:6]}") == [ids["qwen/b"]]
    # blocks
    roots = _ids(capsys, *s, "--blocks", "-f", "parent=none", "-f", "model=qwen/b")
    assert sorted(roots) == sorted(c[0].hex() for c in chains["qwen/b"])
    hit = _ids(capsys, *s, "--blocks", "-f", "hits>=1")
    assert sorted(hit) == sorted(k.hex() for k in chains["meta/llama-a"][1])
    lru = _ids(capsys, *s, "--blocks", "--sort", "accessed:asc", "--limit", "3")
    assert sorted(lru) == sorted(k.hex() for k in chains["old/model"][0])
    assert len(_ids(capsys, *s, "--blocks", "-f", "size>=4KiB")) == 4
    # human table of blocks
    assert main(["ls", "--blocks", *s, "-f", "model=old/model"]) == 0
    out = capsys.readouterr().out
    assert out.count("10 days ago") == 6 and "Found 3 block(s)" in out
    assert main(["ls", *s, "-f", "model=nothing"]) == 0
    assert "No namespaces match (4 in the store)." in capsys.readouterr().out


def test_ls_bad_filter_and_sort_are_usage_errors(base_store, capsys):
    p, _, _ = base_store
    assert main(["ls", "--store", str(p), "-f", "sise>1GB"]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'sise'" in err and "size" in err and "accessed" in err
    assert main(["ls", "--store", str(p), "-f", "accessed>7x"]) == 2
    assert "not a duration" in capsys.readouterr().err
    assert main(["ls", "--store", str(p), "--sort", "bogus"]) == 2
    assert "keys for namespaces" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: the flag's own check
        main(["ls", "--store", str(p), "--limit", "-1"])
    assert e.value.code == 2 and "argument --limit: must be >= 0" in capsys.readouterr().err


def test_missing_store_is_exit_2_and_never_created(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "nope"
    for cmd in (["ls"], ["ls", "--blocks"], ["inspect"], ["stats"], ["verify"],
                ["verify", "--fix"], ["prune", "-y"], ["compact"], ["rm", "abcdef", "-y"]):
        assert main([*cmd, "--store", str(missing)]) == 2, cmd
        err = capsys.readouterr().err
        assert f"no kvstore store at {missing}" in err and "--store" in err
        assert not missing.exists()
    (tmp_path / "empty").mkdir()
    assert main(["ls", "--store", str(tmp_path / "empty")]) == 2
    assert "is not a kvstore store" in capsys.readouterr().err
    assert os.listdir(tmp_path / "empty") == []
    # the default store: $KVSTORE_PATH
    monkeypatch.setenv("KVSTORE_PATH", str(missing))
    assert main(["ls"]) == 2 and str(missing) in capsys.readouterr().err


def test_default_store_from_env(base_store, capsys, monkeypatch):
    p, _, ids = base_store
    monkeypatch.setenv("KVSTORE_PATH", str(p))
    assert sorted(_ids(capsys)) == sorted(ids.values())


def test_inspect(base_store, capsys):
    p, _, _ = base_store
    assert main(["inspect", "--store", str(p), "--format", "json"]) == 0
    data = _json(capsys)
    assert data.pop("schema") == "kvstore.inspect/1"
    lib = to_jsonable(inspect_store(p))
    for d in (data, lib):  # free space moves with everyone else's writes
        for t in d["tiers"]:
            t.pop("filesystem_free_bytes")
    assert data == lib
    assert data["format_version"] == DISK_FORMAT_VERSION and data["tiers"][0]["blocks"] == 34
    assert data["tiers"][0]["capacity_bytes"] is None
    assert data["counters"] == {"hits": 4, "misses": None}
    assert data["index"]["file_bytes"] > 0 and data["index"]["namespaces"] == 4
    f = data["fragmentation"]
    assert f["segments"] >= 7 and f["live_bytes"] == 46 * 1024
    assert main(["inspect", "--store", str(p)]) == 0
    out = capsys.readouterr().out
    for word in (f"disk format version {DISK_FORMAT_VERSION}", "34 blocks", "fragmentation", "index", "hits",
                 "meta/llama-a", "old/model", "kvstore stats --socket"):
        assert word in out


def test_stats_path(base_store, capsys):
    p, _, ids = base_store
    assert main(["stats", "--store", str(p), "--format", "json"]) == 0
    data = _json(capsys)
    assert data.pop("schema") == "kvstore.stats/1"
    lib = to_jsonable(store_stats(p))
    data.pop("time"), lib.pop("time")
    assert data == lib
    assert data["blocks"] == 34 and data["hits"] == 4
    assert {n["model_id"]: n["blocks"] for n in data["namespaces"]} == {
        "meta/llama-a": 18, "qwen/b": 9, "big/model": 4, "old/model": 3}
    assert main(["stats", "--store", str(p), "--watch", "0.05", "--count", "3",
                 "--format", "json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(json.loads(ln)["blocks"] == 34 for ln in lines)
    assert main(["stats", "--store", str(p)]) == 0
    out = capsys.readouterr().out
    assert "meta/llama-a" in out and "34" in out


def test_stats_socket_live_daemon(tmp_path, capsys):
    from support.daemon import DaemonProcess

    from kvstore.client import connect

    store, sock = tmp_path / "store", tmp_path / "run" / "kvstore.sock"
    d = DaemonProcess(store, sock, "--cpu-capacity", "64KiB").start()
    try:
        with connect(sock, layout=LAY, model_id="live/model", device="cpu") as c:
            keys = c.block_keys(prompt_tokens(0, 3, LAY.block_tokens))
            assert c.lookup(keys) == 0
            assert c.put(keys, kv_for(keys, LAY)).wait() == 3
            assert c.lookup(keys) == 3
            c.flush()
        assert main(["stats", "--socket", str(sock), "--store", str(store), "--format",
                     "json"]) == 0
        data = _json(capsys)
        assert data["schema"] == "kvstore.stats/1" and data["socket"] == str(sock)
        (ns,) = data["namespaces"]
        assert ns["model_id"] == "live/model"
        st = ns["stats"]
        assert st["put_blocks"] == 3 and st["hits"] == 3 and st["misses"] == 3
        assert ns["hit_rate"] == 0.5 and {t["name"] for t in st["tiers"]} >= {"warm", "disk"}
        assert ns["server"]["warm_slots"] == 64
        assert main(["stats", "--socket", str(sock), "--store", str(store)]) == 0
        out = capsys.readouterr().out
        assert "live/model" in out and "hit rate" in out and "50.0%" in out
        assert main(["stats", "--socket", str(sock), "--store", str(store), "-f",
                     "model=other"]) == 2
        assert "no namespace" in capsys.readouterr().err
    finally:
        d.stop()
    assert main(["stats", "--socket", str(tmp_path / "none.sock"), "--store", str(store)]) == 2
    assert "no daemon socket" in capsys.readouterr().err


def test_stats_socket_never_imports_torch(tmp_path):
    """``kvstore stats --socket`` only talks to a daemon: no torch (issue 31: 2.3-9.6 s, 5.6 s
    of it importing torch)."""
    from support.daemon import DaemonProcess

    store, sock = tmp_path / "store", tmp_path / "run" / "kvstore.sock"
    build_store(store, "m/a", prompts=1, blocks=2)
    d = DaemonProcess(store, sock, "--cpu-capacity", "64KiB").start()
    try:
        p, took = cli_without_torch("stats", "--socket", str(sock), "--format", "json")
        assert p.returncode == 0, p.stderr  # 99: it imported torch
        data = json.loads(p.stdout)
        assert [n["model_id"] for n in data["namespaces"]] == ["m/a"]
        assert data["namespaces"][0]["server"]["warm_slots"] == 64
        print(f"kvstore stats --socket: {took:.2f} s in process")
    finally:
        d.stop()


def test_inspect_a_namespace_or_block_by_id(base_store, capsys):
    """``kvstore inspect KEY`` (issue 31: a positional target was refused): every field of
    the namespace or block it names; a model id names its namespaces."""
    p, chains, ids = base_store
    nid = ids["qwen/b"]
    assert main(["inspect", nid[:8], "--store", str(p)]) == 0
    out = capsys.readouterr().out
    assert nid in out and "qwen/b" in out and "9.0 KiB" in out
    key = chains["old/model"][0][1].hex()
    assert main(["inspect", key[:12].upper(), "--store", str(p), "--format", "json"]) == 0
    data = _json(capsys)
    assert data["schema"] == "kvstore.inspect/1" and data["namespaces"] == []
    (b,) = data["blocks"]
    assert b["key"] == key and b["parent"] == chains["old/model"][0][0].hex()
    assert b["namespace_id"] == ids["old/model"]
    assert main(["inspect", "big/model", "--store", str(p), "--format", "json"]) == 0
    assert [n["model_id"] for n in _json(capsys)["namespaces"]] == ["big/model"]
    assert main(["inspect", "0000ffff", "--store", str(p)]) == 2
    err = capsys.readouterr().err
    assert "kvstore inspect: error: nothing in" in err and "'0000ffff'" in err
    assert main(["inspect", "ab", "--store", str(p)]) == 2
    assert "at least 4 hex digits" in capsys.readouterr().err


def test_missing_default_store_names_the_demos_store(tmp_path, monkeypatch, capsys):
    """Issue 31: ``kvstore ls`` right after ``kvstore demo`` failed on the default store
    without a word about where the demo's blocks are."""
    from kvstore.commands.demo_workload import default_store_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("KVSTORE_PATH", raising=False)
    demo = default_store_path()
    assert demo == tmp_path / "home" / ".cache" / "kvstore" / "demo"
    assert main(["ls"]) == 2  # nothing anywhere: no word about a demo
    assert "kvstore demo" not in capsys.readouterr().err
    build_store(demo, "m/demo", prompts=1, blocks=2)
    for argv in (["ls"], ["inspect"], ["stats"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'home' / '.cache' / 'kvstore'} is not a kvstore store" in err
        assert f"kvstore demo's store is {demo}: kvstore ls --store {demo}" in err
        assert len(err.strip().splitlines()) == 1
    assert main(["ls", "--store", str(tmp_path / "elsewhere")]) == 2  # a path given: its error
    assert "kvstore demo" not in capsys.readouterr().err
    assert main(["ls", "--store", str(demo)]) == 0 and "m/demo" in capsys.readouterr().out


def test_quiet_ids_fed_to_rm_through_entry_point(store):
    p, chains, ids = store
    ls = _cli("ls", "-q", "-f", "model~qwen", "-f", "size<1GB", "--store", str(p))
    assert ls.returncode == 0, ls.stderr
    assert ls.stdout.split() == [ids["qwen/b"]]
    rm = _cli("rm", *ls.stdout.split(), "--store", str(p), "-y")
    assert rm.returncode == 0, rm.stderr
    assert "Removed 9 block(s)" in rm.stdout
    left = {e.model_id for e in list_namespaces(p).items}
    assert left == {"meta/llama-a", "big/model", "old/model"}
    assert {e.model_id for e in list_namespaces(p, include_empty=True).items} == set(ids)
    ok, bad = check_disk_bytes(p)
    assert ok == 25 and bad == []


def test_rm_reads_targets_from_stdin(store, capsys, monkeypatch):
    p, chains, _ = store
    keys = [k.hex() for k in chains["big/model"][0]]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(keys) + "\n"))
    assert main(["rm", "-", "--store", str(p), "--format", "json"]) == 1  # stdin: needs -y
    assert "pass -y" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(keys) + "\n"))
    assert main(["rm", "-", "--store", str(p), "-y", "--format", "json"]) == 0
    data = _json(capsys)
    assert data["schema"] == "kvstore.rm/1" and data["removed_blocks"] == 2
    assert sorted(data["plan"]["blocks"]) == sorted(keys) and data["plan"]["descendants"] == 0
    assert {e.key for e in list_blocks(p, filters=["model=big/model"]).items} == {
        k.hex() for k in chains["big/model"][1]}


def test_rm_without_tty_refuses(store):
    p, _, ids = store
    r = _cli("rm", ids["qwen/b"], "--store", str(p))
    assert r.returncode == 1
    assert "refusing" in r.stderr and "-y" in r.stderr and "not a terminal" in r.stderr
    assert "Will remove 9 block(s)" in r.stdout
    assert len(list_blocks(p, filters=["model=qwen/b"]).items) == 9


def test_rm_asks_on_a_terminal(store):
    p, _, ids = store
    master, slave = pty.openpty()
    try:
        os.write(master, b"y\n")  # typed ahead: the terminal holds it until the prompt reads
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "rm", ids["old/model"],
                                 "--store", str(p)], stdin=slave, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        os.close(slave)
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(master)
    assert proc.returncode == 0, err
    assert "Remove 3 block(s)" in err and "Removed 3 block(s)" in out
    assert list_blocks(p, filters=["model=old/model"]).items == ()


def test_rm_block_takes_its_descendants(store, capsys):
    p, chains, _ = store
    llama = chains["meta/llama-a"]
    root = llama[0][0]  # shared by prompts 0 and 3 (group 0)
    assert llama[3][0] == root
    assert main(["rm", root.hex()[:10], "--store", str(p), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Would remove 6 block(s)" in out and "5 descendant block(s)" in out
    assert "prefix-closed" in out
    assert len(list_blocks(p, filters=["model~llama"]).items) == 18  # dry run: nothing gone
    assert main(["rm", root.hex()[:10], "--store", str(p), "-y", "--format", "json"]) == 0
    data = _json(capsys)
    assert data["plan"]["descendants"] == 5 and data["removed_blocks"] == 6
    assert data["freed_bytes"] == 6 * 1024
    gone = {k.hex() for k in llama[0] + llama[3]}
    assert set(data["plan"]["keys"]) == gone
    left = list_blocks(p).items
    assert not gone & {e.key for e in left}
    present = {e.key for e in left}
    assert all(e.parent is None or e.parent in present for e in left)  # prefix-closed
    with open_test_store(p, "meta/llama-a") as s:
        assert s.lookup(s.block_keys(prompt_tokens(0, 4, LAY.block_tokens))) == 0
        keys = s.block_keys(prompt_tokens(1, 4, LAY.block_tokens))
        assert s.lookup(keys) == 4
        assert torch.equal(s.fetch(keys).wait().view(torch.uint8),
                           kv_for(keys, LAY).view(torch.uint8))


def test_rm_bad_ambiguous_and_unknown_targets(store, capsys):
    p, chains, ids = store
    s = ["--store", str(p), "-y"]
    # not hex: a model id; one no namespace has is "not found" (exit 1), naming the models
    assert main(["rm", "zz-not-hex", *s]) == 1
    err = capsys.readouterr().err
    assert "no namespace of model 'zz-not-hex'" in err and "'meta/llama-a'" in err
    assert main(["rm", "ab", *s]) == 2
    assert "too short" in capsys.readouterr().err
    assert main(["rm", "aaaa", *s]) == 2  # the three old/model keys start with aaaa
    err = capsys.readouterr().err
    assert "ambiguous" in err and "block aaaa00" in err and "block aaaa01" in err
    assert main(["rm", "0123456789abcdef" * 4, *s]) == 1  # not found: exit 1, nothing removed
    err = capsys.readouterr().err
    assert "no namespace or block matches" in err
    assert main(["rm", "0123456789abcdef" * 4, ids["old/model"], *s]) == 1  # the rest goes
    assert list_blocks(p, filters=["model=old/model"]).items == ()


def test_findings_dataclass_fields_are_the_json_fields():
    # the documented finding object is exactly the dataclass
    names = [f.name for f in dataclasses.fields(FindingEntry)]
    assert names == ["kind", "path", "key", "detail", "fixed", "nbytes", "action",
                     "namespace_id"]
