"""``kvstore bench --section batch`` on the quick sizes, without vLLM (its rows are skipped)."""

import re

import pytest

pytest.importorskip("transformers")

from kvstore.bench import BenchOptions
from kvstore.bench import batch as bench


def test_workloads_have_the_issues_shapes():
    ws = {w.name: w for w in bench.workloads()}
    assert [len(ws[n].prompts) for n in ("doc", "docs", "chat", "long")] == [32, 32, 48, 64]
    doc = ws["doc"].prompts
    assert all(p[:2000] == doc[0][:2000] for p in doc)
    assert all(p[:400] == ws["chat"].prompts[0][:400] for p in ws["chat"].prompts)
    assert all(460 <= len(p) <= 600 for p in ws["chat"].prompts)
    assert all(len(p) >= 3800 for p in ws["long"].prompts) and ws["long"].new_tokens == 64
    many = ws["many"]  # many batches, answers of different lengths (continuous batching)
    assert len(many.prompts) == 192 and len({p[:400] for p in many.prompts}) == 6
    assert len(many.new_tokens) == 192 and min(many.new_tokens) >= 4 and max(many.new_tokens) <= 48
    assert len(set(many.new_tokens)) > 20
    assert bench.workloads() == bench.workloads()  # seeded
    for shape in ("110m", "0.5b"):  # every prompt's ids valid in every model
        assert bench.MODELS[shape]["vocab_size"] >= bench.VOCAB


def test_quick_section_without_vllm(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "vllm_python", lambda: None)
    rows = bench.run(BenchOptions(quick=True, workdir=str(tmp_path)))
    names = [r.name for r in rows]
    # per workload: tokens vs the bound, wall vs HF padded batch, wall vs the compute floor
    assert len(rows) == 5 * 3
    floors = [r for r in rows if r.ref_name == "compute floor"]
    assert len(floors) == 5 and all(r.ref_value > 0 and "GFLOP/s" in r.note for r in floors)
    assert all("vLLM" not in r.ref_name for r in rows)
    tok = [r for r in rows if "prefill tokens" in r.name]
    assert all(r.ratio >= bench.TOKEN_GOAL and r.meets_goal for r in tok)
    for r in tok:  # greedy outputs of HF's padded batch equal the engine's, every prompt
        k, n = re.search(r"HF padded batch (\d+)/(\d+)", r.note).groups()
        assert k == n
    assert "doc: wall, transformers engine" in names and "long: wall, transformers engine" in names
    assert list(tmp_path.iterdir()) == []  # its temp dir is gone


def test_baseline_engine_from_another_tree(monkeypatch, tmp_path):
    """KVSTORE_BENCH_BATCH_BASELINE=DIR runs that tree's engine beside this one, interleaved
    (here the same tree: its outputs equal the engine's)."""
    from pathlib import Path

    monkeypatch.setattr(bench, "vllm_python", lambda: None)
    monkeypatch.setenv("KVSTORE_BENCH_BATCH_BASELINE", str(Path(bench.__file__).resolve().parents[2]))
    rows = bench.run(BenchOptions(quick=True, workdir=str(tmp_path)))
    base = [r for r in rows if r.ref_name == bench.BASELINE]
    assert len(base) == 5 and all(r.name.endswith("wall, transformers engine") for r in base)
    for r in rows:
        if "prefill tokens" in r.name:
            k, n = re.search(r"baseline transformers engine (\d+)/(\d+)", r.note).groups()
            assert k == n


def test_only_the_workloads_asked_for(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "vllm_python", lambda: None)
    monkeypatch.setenv("KVSTORE_BENCH_BATCH_WORKLOADS", "many")
    rows = bench.run(BenchOptions(quick=True, workdir=str(tmp_path)))
    assert {r.name.split(":")[0] for r in rows} == {"many"}
    k, n = re.search(r"HF padded batch (\d+)/(\d+)", rows[0].note).groups()
    assert k == n  # each prompt's own max_tokens, HF's answers cut to it
    monkeypatch.setenv("KVSTORE_BENCH_BATCH_WORKLOADS", "many,chatt")
    with pytest.raises(ValueError, match="names among doc, docs, chat, long, many"):
        bench.run(BenchOptions(quick=True, workdir=str(tmp_path)))


def test_every_method_runs_the_first_workload_once_untimed(monkeypatch, tmp_path):
    """A process's first run pays one-time costs (vLLM's first generate took 1.4x its second
    on doc); the first workload's repeats carried them alone and inflated its ratio."""
    monkeypatch.setattr(bench, "vllm_python", lambda: None)
    monkeypatch.setenv("KVSTORE_BENCH_BATCH_WORKLOADS", "chat")
    calls = []
    real = bench._methods

    def methods(model, workers):
        ms = real(model, workers)
        for m in ms:
            run = m.run

            def counted(w, salt, run=run, name=m.label):
                calls.append((name, w.name, salt.startswith("bench-warm-")))
                return run(w, salt)

            m.run = counted
        return ms

    monkeypatch.setattr(bench, "_methods", methods)
    rows = bench.run(BenchOptions(quick=True, workdir=str(tmp_path)))
    names = {c[0] for c in calls}
    assert len(names) >= 2
    for name in names:  # one warm run, then the timed repeat, per method
        assert [c for c in calls if c[0] == name] == [(name, "chat", True), (name, "chat", False)]
    wall = [r for r in rows if "wall" in r.name]
    assert wall and all(r.value > 0 for r in wall)
