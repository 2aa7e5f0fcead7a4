import json
import subprocess
import sys

from kvstore.bench import BenchOptions
from kvstore.bench.memory import run as run_memory
from kvstore.cli import main


def test_demo_runs_and_outputs_match(tmp_path, capsys):
    assert main(["demo", "--store", str(tmp_path / "s"), "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["identical"] is True and res["reused_tokens"] > 0.5 * res["prompt_tokens"]


def test_demo_table_through_console_script(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "demo", "--store", str(tmp_path),
                          "--workload", "docqa"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "outputs identical to uncached" in out.stdout and "yes" in out.stdout


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
