import json
import subprocess
import sys

from kvstore.bench import BenchOptions
from kvstore.bench.memory import run as run_memory
from kvstore.cli import main


def test_demo_runs_and_outputs_match(tmp_path, capsys):
    assert main(["demo", "--store", str(tmp_path / "s"), "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    first, again = res["first"], res["restarted"]
    assert first["identical"] is True and again["identical"] is True
    assert first["reused_tokens"] > 0.5 * first["prompt_tokens"]
    # the fresh process found everything on disk: only the last partial blocks are computed
    assert again["reused_tokens"] > 0.95 * again["prompt_tokens"] and again["hit_rate"] == 1.0


def test_demo_table_through_console_script(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "demo", "--store", str(tmp_path),
                          "--workload", "docqa"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "outputs identical to uncached" in out.stdout and "NO" not in out.stdout
    assert "fresh process" in out.stdout


def test_bench_memory_quick_rows():
    rows = run_memory(BenchOptions(quick=True))
    assert {r.unit for r in rows} == {"GB/s"}
    for r in rows:
        assert r.value > 0 and r.ref_value > 0 and abs(r.ratio - r.value / r.ref_value) < 1e-9


def test_bench_cli_json(tmp_path):
    path = tmp_path / "b.json"
    assert main(["bench", "--quick", "--section", "memory", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["rows"] and all("ratio" in r for r in data["rows"])
