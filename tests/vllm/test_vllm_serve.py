"""``kvstore bench --section serve`` for real, at its ``--quick`` scale, reduced to the case the
section exists for: two ``vllm serve`` processes sharing one ``kvstore serve`` daemon, cold.
The second engine's first requests must hit what the first one computed, and every process
the section started must be gone afterwards. (5.4 minutes on the shared 2-core machine at load
average 8-15, the two engines starting side by side: ~100 s, each client run ~40 s.) Run with ``bash tools/ci_vllm.sh -k serve``; the machinery without vLLM is
tests/bench/test_bench_serve.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(900)


def _children_of(pid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,ppid=,pgid=,args=", "-e"], capture_output=True,
                         text=True).stdout
    return [line for line in out.splitlines() if "vllm.entrypoints.openai.api_server" in line
            or "kvstore.bench.serve_runner" in line]


def test_serve_section_two_engines_share_a_daemon(tmp_path, monkeypatch):
    from kvstore.bench import BenchOptions
    from kvstore.bench import serve as sv

    # the vLLM environment is this interpreter (tools/ci_vllm.sh runs the tests in it)
    monkeypatch.setenv("KVSTORE_VLLM_PYTHON", sys.executable)
    before = set(_children_of(os.getpid()))
    rows = sv.run(BenchOptions(quick=True, workdir=str(tmp_path)), cases=("shared",),
                  phases=("cold",))
    by = {r.name: r for r in rows}
    a = by["prefix_repetition: mean TTFT, shared cold engine A"]
    b = by["prefix_repetition: mean TTFT, shared cold engine B"]
    assert "failed 0" in a.note and "failed 0" in b.note
    hit = by["goal: prefix_repetition, second engine's external hits on what the first "
             "computed (cold daemon)"]
    assert hit.value >= sv.SHARED_HIT_GOAL, hit
    # the results were written, and nothing the section started is left running
    (work,) = tmp_path.glob("kvstore-bench-serve-*")
    assert (work / "serve_results.json").exists()
    assert set(_children_of(os.getpid())) <= before
