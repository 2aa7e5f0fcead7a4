import json

from kvstore.bench import BenchOptions
from kvstore.bench.memory import run as run_memory
from kvstore.cli import main


def test_bench_memory_quick_rows():
    rows = run_memory(BenchOptions(quick=True))
    assert {r.unit for r in rows} == {"GB/s", "ms"}
    for r in rows:
        assert r.value > 0 and r.ref_value > 0
        # higher is better for kvstore: bandwidth over bandwidth, time under time
        want = r.value / r.ref_value if r.unit == "GB/s" else r.ref_value / r.value
        assert abs(r.ratio - want) < 1e-9


def test_bench_cli_json(tmp_path):
    path = tmp_path / "b.json"
    assert main(["bench", "--quick", "--section", "memory", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["rows"] and all("ratio" in r for r in data["rows"])
