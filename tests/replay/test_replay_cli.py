"""``kvstore replay`` on the command line: tables, JSON, the plot, usage errors."""

import builtins
import json

import pytest

from kvstore.cli import main


def test_json_report(capsys):
    assert main(["replay", "--chat", "150", "--capacity", "5%,20%", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "kvstore.replay/1"
    assert out["policies"] == ["lru", "adaptive"]
    row = out["rows"][1]
    assert row["capacity"] == "20%"
    sims = {s["policy"]: s for s in row["simulated"]}
    stores = {r["eviction"]: r for r in row["replayed"]}
    assert "arc" in sims and "s3fifo" in sims and "arc" not in stores
    for p in ("lru", "adaptive"):
        assert stores[p]["hits"] == sims[p]["hits"] and stores[p]["wrong_blocks"] == 0
    assert sims["belady"]["hits"] <= sims["unbounded"]["hits"]


def test_generate_a_family_and_save_it(tmp_path, capsys):
    out_file = tmp_path / "agentic.jsonl"
    assert main(["replay", "--generate", "agentic", "--requests", "200", "--seed", "3",
                 "--capacity", "10%", "--simulate-only", "--save-trace", str(out_file),
                 "--baselines", "s3fifo"]) == 0
    out = capsys.readouterr().out
    assert "agentic synthetic (seed 3)" in out and "S3FIFO SIM" in out and "ARC SIM" not in out
    lines = out_file.read_text().splitlines()
    assert len(lines) == 200 and '"session"' in lines[0]
    assert main(["replay", str(out_file), "--capacity", "10%", "--simulate-only"]) == 0


def test_generate_and_a_file_are_exclusive(tmp_path, capsys):
    assert main(["replay", "x.jsonl", "--generate", "rag", "--simulate-only"]) == 2


def test_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    assert main(["replay", "--chat", "120", "--capacity", "5%,10%", "--eviction", "reuse",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "REUSE SIM" in out and "BELADY" in out and "Per tier" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_admission_variants(capsys):
    assert main(["replay", "--chat", "150", "--capacity", "5%", "--eviction", "lru,reuse",
                 "--admission", "always,second-hit", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    names = ["lru", "lru+second-hit", "reuse", "reuse+second-hit"]
    assert out["policies"] == names
    row = out["rows"][0]
    assert [(s["policy"], s["admission"]) for s in row["simulated"][:4]] == [
        ("lru", "always"), ("lru", "second-hit"), ("reuse", "always"), ("reuse", "second-hit")]
    for sim, got in zip(row["simulated"], row["replayed"], strict=False):
        assert (got["eviction"], got["admission"]) == (sim["policy"], sim["admission"])
        assert got["hits"] == sim["hits"] and got["wrong_blocks"] == 0


def test_simulate_only(capsys):
    assert main(["replay", "--chat", "100", "--capacity", "10%", "--simulate-only",
                 "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["replayed"] == []


def test_trace_file_with_disk_tier(tmp_path, capsys):
    lines = [json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1,
                         "hash_ids": [0, 1 + i % 3]}) for i in range(30)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines))
    assert main(["replay", str(trace), "--capacity", "50%", "--disk", "100%", "--workdir",
                 str(tmp_path), "--speed", "1000", "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    tiers = [t["name"] for t in rep["rows"][0]["replayed"][0]["tiers"]]
    assert tiers == ["warm", "disk"]


@pytest.mark.parametrize("argv,msg", [
    (["replay"], "give a trace file, or --generate FAMILY"),
    (["replay", "/nonexistent.jsonl"], "cannot read trace"),
    (["replay", "--chat", "10", "--capacity", "0%"], "a share must be"),
    (["replay", "--chat", "10", "--eviction", "fifo"], "unknown eviction policy 'fifo'"),
    (["replay", "--chat", "10", "--admission", "third-hit"], "unknown admission 'third-hit'"),
])
def test_usage_errors_exit_2(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_admission_with_engines_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["replay", "--chat", "10", "--engines", "2", "--admission", "second-hit"])
    assert e.value.code == 2 and "--admission does not apply" in capsys.readouterr().err


def test_bad_speed_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["replay", "--chat", "10", "--speed", "0"])
    assert e.value.code == 2


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys):
    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    assert main(["replay", "--chat", "10", "--plot", "x.png"]) == 2
    assert "pip install 'kvstore[plot]'" in capsys.readouterr().err


def test_plot_keeps_the_belady_line_visible_above_the_unbounded_cache(monkeypatch, tmp_path):
    """Issue 31: from 5% up the Belady bound equals the unbounded cache, and its dotted line
    was drawn under the unbounded one: Belady is drawn on top, its label says where it meets
    the unbounded cache, and the unbounded cache is a flat line beneath."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from kvstore.replay import ReplayPlan, parse_capacity, run_report
    from kvstore.replay.plot import plot_report
    from kvstore.replay.workloads import ChatWorkload, chat_trace

    figs = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **kw: (figs.append(self),
                                                                   real(self, *a, **kw)))
    trace = chat_trace(ChatWorkload(requests=300, seed=3, rate_per_s=0.5))
    plan = ReplayPlan(capacities=tuple(parse_capacity(c) for c in ("1%", "5%", "20%", "50%")),
                      policies=("lru",), baselines=(), store=False)
    rep = run_report(trace, plan)
    assert rep.rows[-1].sim("belady").hits == rep.rows[-1].sim("unbounded").hits  # they meet
    plot_report(rep, tmp_path / "hit.png")
    (ax,) = figs[0].axes
    lines = {ln.get_label().split(" (")[0].split(",")[0]: (i, ln) for i, ln in
             enumerate(ax.get_lines())}
    (ib, belady), (iu, unb) = lines["Belady bound"], lines["unbounded cache"]
    assert (belady.get_zorder(), ib) > (unb.get_zorder(), iu)  # drawn above it
    assert belady.get_marker() not in (None, "None", "")  # its points show where it lies
    assert "= unbounded from" in belady.get_label()
    assert len(set(unb.get_ydata())) == 1  # a flat reference line


def test_simulate_only_never_imports_torch():
    """``--simulate-only`` runs no store: it does not pay torch's import (issue 31: 56 s at
    load 6 where the docs said "seconds"; torch was 1.2-4 s of it)."""
    from support.admin import cli_without_torch

    p, took = cli_without_torch("replay", "--chat", "60", "--capacity", "5%",
                                "--simulate-only", "--format", "json")
    assert p.returncode == 0, p.stderr  # 99: it imported torch
    assert json.loads(p.stdout)["rows"][0]["replayed"] == []
    print(f"kvstore replay --chat 60 --simulate-only: {took:.2f} s in process")
