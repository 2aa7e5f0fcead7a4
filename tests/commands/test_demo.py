"""``kvstore demo`` through the real entry point, in subprocesses (each run spawns the restart)."""

import json
import os
import statistics
import subprocess
import sys

import pytest

from kvstore.commands.demo_workload import default_store_path, workload_size
from kvstore.integrations import transformers_available


def demo_cmd(store, *args):
    return [sys.executable, "-m", "kvstore.cli", "demo", "--store", str(store), "--quick",
            "--repeat", "2", *args]


def run_demo(store, *args, timeout=180):
    return subprocess.run(demo_cmd(store, *args), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def transformers_runs(tmp_path_factory):
    """The three workloads with the transformers engine, run side by side (each is two
    processes, mostly importing transformers: in parallel they take the time of about one)."""
    if not transformers_available():
        pytest.skip("transformers is not installed")
    procs = {}
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # three at once: no thread oversubscription
    for w in ("chat", "docqa", "batch"):
        store = tmp_path_factory.mktemp(f"demo-{w}") / "store"
        procs[w] = subprocess.Popen(demo_cmd(store, "--format", "json", "--workload", w),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env)
    results = {}
    for w, p in procs.items():
        out, err = p.communicate(timeout=300)
        results[w] = (p.returncode, out, err)
    return results


def check_phases(res, workload):
    first, again = res["first"], res["restarted"]
    assert res["identical"] is True and first["identical"] and again["identical"]
    for r in (first, again):
        assert r["requests"] == workload_size(workload, quick=True)
        assert r["reused_tokens"] + r["computed_tokens"] == r["prompt_tokens"]
        assert r["max_logit_diff"] <= 1e-4
        assert r["cached_seconds"] > 0 and r["uncached_seconds"] > 0
    assert first["reused_tokens"] > 0.4 * first["prompt_tokens"]  # shared prefixes hit
    # the fresh process found every block on disk: only each prompt's tail is computed
    assert again["hit_rate"] == 1.0
    assert again["reused_tokens"] > 0.9 * again["prompt_tokens"]
    assert again["blocks_on_disk"] == first["blocks_on_disk"] > 0
    for r in (first, again):  # medians of the repetitions, each one's figures kept
        assert r["runs"] == 2 and len(r["cached_runs"]) == len(r["speedups"]) == 2
        assert r["cached_seconds"] == statistics.median(r["cached_runs"])
        assert r["speedup_min"] <= r["speedup"] <= r["speedup_max"]
        assert (r["slower_reason"] is None) == (r["speedup"] >= 1.0)
    assert res["next"] == f"kvstore ls --store {res['store']}"
    return first, again


@pytest.mark.parametrize("workload", ["chat", "docqa", "batch"])
def test_demo_json_each_workload_with_transformers(transformers_runs, workload):
    rc, out, err = transformers_runs[workload]
    assert rc == 0, err[-3000:]
    res = json.loads(out)
    assert res["workload"] == workload and "LlamaForCausalLM" in res["engine"]
    first, again = check_phases(res, workload)
    if workload == "chat":
        assert first["generated_tokens"] == 6 * 4  # 2 conversations x 3 turns, 4-token answers
    if workload == "batch":
        plan = first["plan"]
        assert plan["planned_tokens"] < plan["arrival_tokens"] < plan["naive_tokens"]
        assert first["computed_tokens"] == plan["planned_tokens"]  # cold run: as simulated
        assert plan["groups"] == 4  # the system prompt, and each of 3 documents


def test_demo_table_falls_back_to_toy_engine_without_transformers(tmp_path):
    # a transformers that cannot be imported: the demo falls back to its toy decoder
    fake = tmp_path / "fake" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('transformers hidden for this test')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(
        [str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run(demo_cmd(tmp_path / "store", "--workload", "batch"), env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "first run (cold cache)" in text and "fresh process, same store" in text
    assert "outputs identical to uncached" in text and "NO" not in text
    assert "toy torch decoder" in text and "transformers not installed" in text
    assert "block hit rate" in text and "100%" in text
    assert "batch plan: tokens computed" in text and "arrival order" in text


def test_demo_rejects_unknown_workload(tmp_path):
    out = run_demo(tmp_path, "--workload", "nope")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_default_store_path(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_store_path() == tmp_path / "kvstore" / "demo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_store_path().parts[-3:] == (".cache", "kvstore", "demo")


def test_importing_kvstore_does_not_import_transformers():
    code = ("import sys, kvstore, kvstore.integrations, kvstore.batch, kvstore.cli\n"
            "import kvstore.commands.demo_workload\n"
            "import kvstore.commands.demo\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_demo_says_where_it_stored_and_that_command_works(tmp_path):
    store = tmp_path / "demo-store"
    out = subprocess.run(demo_cmd(store, "--engine", "toy", "--workload", "docqa"),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    text = " ".join(out.stdout.split())  # rich wraps long lines
    look = f"kvstore ls --store {store}"
    assert look in text
    # every column explained, the first run's reuse included
    assert "share prefixes" in text and "every block read back from disk" in text
    assert "medians of 2 runs" in text
    ls = subprocess.run([sys.executable, "-m", "kvstore.cli", *look.split()[1:]],
                        capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr
    assert "kvstore/toy-causal-tiny" in ls.stdout


def _phase(**kw):
    r = {"speedup": 2.0, "speedup_min": 1.5, "speedup_max": 2.5, "speedups": [1.5, 2.5],
         "prompt_tokens": 1000, "reused_tokens": 800, "computed_tokens": 200,
         "cached_seconds": 0.5, "uncached_seconds": 1.0, "cached_runs": [0.4, 0.6],
         "uncached_runs": [1.0, 1.0], "kv_bytes_per_token": 4096, "requests": 5,
         "hit_rate": 0.8, "blocks_on_disk": 50, "disk_bytes": 1 << 20, "identical": True}
    return r | kw


def test_slower_rows_are_flagged_with_their_reason():
    from kvstore.commands.demo import slower_reason

    assert slower_reason(_phase(), cold=True, size="tiny") is None
    # the first run: the writes; and a compute cheaper than the load
    slow = _phase(speedup=0.3, speedup_min=0.2, speedup_max=0.4, cached_seconds=3.0,
                  uncached_seconds=1.0)
    why = slower_reason(slow, cold=True, size="tiny")
    assert "pays for storing every new block" in why
    assert "this tiny model computes a token's K/V in about 1000 us" in why
    assert "4.0 KiB of K/V" in why
    why = slower_reason(slow, cold=False, size="tiny")
    assert "pays for storing" not in why and "tiny model" in why
    # runs on both sides of 1x: noise, said so
    noisy = _phase(speedup=0.9, speedup_min=0.5, speedup_max=1.4, cached_seconds=0.9,
                   uncached_seconds=0.81)
    assert "the runs disagree (0.5x-1.4x)" in slower_reason(noisy, cold=False, size="small")


def test_table_flags_a_slower_phase(capsys):
    import argparse

    from kvstore.commands.demo import _print_table, slower_reason

    args = argparse.Namespace(workload="chat", repeat=2)
    first = _phase(speedup=0.3, speedup_min=0.2, speedup_max=0.4, speedups=[0.2, 0.4],
                   cached_seconds=3.0, uncached_seconds=1.0, engine="toy torch decoder (tiny)")
    again = _phase(engine="toy torch decoder (tiny)")
    for r, cold in ((first, True), (again, False)):
        r["slower_reason"] = slower_reason(r, cold=cold, size="tiny")
    _print_table(args, "/tmp/s", first, again, 1.0)
    out = " ".join(capsys.readouterr().out.split())
    assert "0.3× [0.2-0.4] (slower, see below)" in out and "2.0× [1.5-2.5]" in out
    assert "Not faster in the first run (cold cache) column (0.3×)" in out
    assert "Not faster in the fresh process" not in out
