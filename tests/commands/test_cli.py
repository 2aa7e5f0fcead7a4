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


def test_bench_reports_a_failing_section_and_runs_the_rest(tmp_path, capsys, monkeypatch):
    import kvstore.bench.memory as memory

    def boom(opts):
        raise RuntimeError("forced failure for the test")

    monkeypatch.setattr(memory, "run", boom)
    path = tmp_path / "b.json"
    rc = main(["bench", "--quick", "--section", "memory", "--section", "hashing",
               "--json", str(path)])
    assert rc == 1  # non-zero at the end, after every section ran
    cap = capsys.readouterr()
    # a progress line per section, as it starts and as it ends
    assert "[1/2] memory: running" in cap.err and "[2/2] hashing: running" in cap.err
    assert "[1/2] memory: FAILED" in cap.err and "forced failure for the test" in cap.err
    assert "[2/2] hashing: done in" in cap.err
    assert "FAILED memory: RuntimeError: forced failure for the test" in cap.out
    assert "hashing" in cap.out  # the table of the sections that ran
    data = json.loads(path.read_text())
    assert data["rows"] and {r["section"] for r in data["rows"]} == {"hashing"}
    (f,) = data["failed"]
    assert f["section"] == "memory" and "forced failure" in f["error"]
    assert "RuntimeError" in f["traceback"]


def test_bench_json_format_on_stdout_and_exit_0(capsys):
    assert main(["bench", "--quick", "--section", "hashing", "--format", "json"]) == 0
    cap = capsys.readouterr()
    data = json.loads(cap.out)
    assert data["failed"] == [] and data["rows"] and "[1/1] hashing: done" in cap.err
