"""``kvstore bench --section serve`` without vLLM: the plan, the commands, the trace conversion,
result and metrics parsing, the rows and goals, process-group cleanup, and the skip when no
vLLM environment is there. (The real run: tests/vllm/test_vllm_serve.py.)"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

import pytest

from kvstore.bench import BenchOptions
from kvstore.bench import serve as sv
from kvstore.bench.chat_turns import (
    ChatWorkload,
    chat_expected_hits,
    chat_workload,
    trace_chat_turns,
)
from kvstore.bench.runner import SECTIONS, run_sections
from kvstore.bench.serve_commands import (
    check_vllm,
    client_command,
    client_env,
    daemon_socket,
    server_command,
    transfer_config,
    vllm_python,
)
from kvstore.bench.serve_processes import Group, Procs, wait_ready
from kvstore.bench.serve_results import (
    RunResult,
    counter_delta,
    hit_rates,
    parse_metrics,
    parse_result,
    ttfts_ms,
    unservable_tail,
)
from kvstore.bench.serve_scale import BLOCK, FULL, MODEL_QUICK, QUICK, Scale
from kvstore.bench.serve_workloads import convert_trace, trace_reuse

# what vLLM 0.32's client writes with --save-result (lists shortened)
SAVED = {
    "date": "20261202-072340", "backend": "vllm", "model_id": "/m", "num_prompts": 8,
    "request_rate": 2.0, "duration": 9.96, "completed": 8, "failed": 0,
    "total_input_tokens": 8704, "total_output_tokens": 128, "request_throughput": 0.80,
    "output_throughput": 12.8, "total_token_throughput": 886.3, "latencies": [1.0] * 8,
    "mean_ttft_ms": 4721.6, "median_ttft_ms": 5560.4, "std_ttft_ms": 1744.9,
    "p50_ttft_ms": 5560.4, "p99_ttft_ms": 6515.8, "mean_tpot_ms": 201.4,
    "median_tpot_ms": 78.3, "p50_tpot_ms": 78.3, "p99_tpot_ms": 517.2,
}

METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="/m"} 8704.0
vllm:prefix_cache_queries_created{engine="0",model_name="/m"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="/m"} 4096.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="/m"} 4608.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="/m"} 4096.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="/m",source="local_compute"} 512.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="/m",source="external_kv_transfer"} 4096.0
vllm:num_requests_running{engine="0",model_name="/m"} 0.0
"""


def test_section_is_registered():
    assert SECTIONS["serve"].module == "kvstore.bench.serve"


def test_plan_covers_every_case_cold_and_restart():
    cases = {c.key: c for c in sv.plan()}
    assert list(cases) == ["alone", "example", "embedded", "shared"]
    assert cases["alone"].phases == ("cold",)
    for k in ("example", "embedded", "shared"):
        assert cases[k].phases == ("cold", "restart")
    assert cases["shared"].engines == 2 and cases["embedded"].engines == 1


def test_server_commands_name_the_connectors(tmp_path):
    scale = FULL
    assert transfer_config("alone", tmp_path) is None
    cmd = server_command("/py", "/m", 8001, None, scale)
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--kv-transfer-config" not in cmd and "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--block-size") + 1] == str(BLOCK)

    def cfg(case: str, engine: int = 0) -> dict:
        c = server_command("/py", "/m", 8001, transfer_config(case, tmp_path, engine),
                           scale)
        return json.loads(c[c.index("--kv-transfer-config") + 1])

    ex = cfg("example")
    assert ex["kv_connector"] == "ExampleConnector"
    # ExampleConnector saves only a request's first scheduled chunk: its engines prefill whole
    c = server_command("/py", "/m", 1, transfer_config("example", tmp_path), scale)
    assert "--no-enable-chunked-prefill" in c
    emb = server_command("/py", "/m", 1, transfer_config("embedded", tmp_path), scale)
    assert "--no-enable-chunked-prefill" not in emb
    emb = cfg("embedded")
    assert emb["kv_connector"] == "KVStoreConnector"
    assert emb["kv_connector_module_path"] == "kvstore.integrations.vllm"
    assert emb["kv_load_failure_policy"] == "recompute"
    assert emb["kv_connector_extra_config"]["store_path"].endswith("store-embedded")
    a, b = cfg("shared", 0), cfg("shared", 1)
    assert a["kv_connector_extra_config"]["socket"] == b["kv_connector_extra_config"]["socket"]
    assert "store_path" not in a["kv_connector_extra_config"]
    assert a["kv_connector_extra_config"]["stats_path"] != b["kv_connector_extra_config"]["stats_path"]
    with pytest.raises(ValueError):
        transfer_config("nope", tmp_path)


def test_client_commands(tmp_path):
    s = FULL
    pr = client_command("/py", "/m", 8001, "prefix_repetition", s, tmp_path, "r.json")
    assert pr[:5] == ["/py", "-m", "kvstore.bench.serve_runner", "client", "--"]
    assert pr[pr.index("--dataset-name") + 1] == "prefix_repetition"
    assert pr[pr.index("--prefix-repetition-prefix-len") + 1] == str(s.prefix_len)
    assert pr[pr.index("--base-url") + 1] == "http://127.0.0.1:8001"
    assert {"--save-result", "--save-detailed", "--ignore-eos"} <= set(pr)
    assert pr[pr.index("--result-filename") + 1] == "r.json"
    mc = client_command("/py", "/m", 8001, "mooncake", s, tmp_path, "m.json",
                        tmp_path / "t.jsonl")
    assert mc[mc.index("--dataset-name") + 1] == "timed_trace"
    assert mc[mc.index("--dataset-path") + 1] == str(tmp_path / "t.jsonl")
    assert mc[mc.index("--timed-trace-chunk-hash-size") + 1] == str(s.trace_chunk)
    with pytest.raises(ValueError):
        client_command("/py", "/m", 1, "mooncake", s, tmp_path, "m.json")
    # the timed trace's tokens come from hash(str): the client runs with a fixed hash seed
    assert client_env({})["PYTHONHASHSEED"] == "0"


def test_convert_trace_scales_lengths_and_time(tmp_path):
    src = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 6758, "output_length": 500, "hash_ids": list(range(14))},
        {"timestamp": 3000, "input_length": 1000, "output_length": 3, "hash_ids": [0, 14]},
        {"timestamp": 3500, "input_length": 60000, "output_length": 40,
         "hash_ids": list(range(100, 218))},
        {"timestamp": 9000, "input_length": 10, "output_length": 1, "hash_ids": [7]},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scale = Scale(MODEL_QUICK, 256, 32, 2, 4, 4, 1.0, trace_requests=3, trace_chunk=32,
                  trace_max_chunks=48, trace_max_output=16, trace_time_scale=2.0)
    out = tmp_path / "out.jsonl"
    lengths = convert_trace(src, out, scale)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 3 and lengths == [g["input_length"] for g in got]
    assert [g["timestamp"] for g in got] == [0.0, 4.0, 5.0]  # (ms - first) / 1000 * 2
    assert got[0]["input_length"] == 423  # ceil(6758 / 16)
    assert got[0]["output_length"] == 16  # 500 / 16, capped
    assert got[1]["output_length"] == 1
    assert got[2]["hash_ids"] == list(range(100, 148))  # at most 48 blocks
    assert got[2]["input_length"] == 48 * 32
    # from a later line
    convert_trace(src, out, scale, start=3)
    assert json.loads(out.read_text().splitlines()[0])["hash_ids"] == [7]
    assert trace_reuse([(64, [0, 1]), (64, [0, 2])], 32) == 0.25  # 1 of 4 blocks


def test_trace_chat_turns_pairs_an_answer_with_the_next_message(tmp_path):
    src = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 300, "hash_ids": [0, 1, 2]},
        # continues the first: its 2 whole blocks, then 300 answered + 60 typed (1100 + 360)
        {"timestamp": 1, "input_length": 1460, "output_length": 50, "hash_ids": [0, 1, 3]},
        # shares only block 0 (a common system prompt): a new chat
        {"timestamp": 2, "input_length": 2000, "output_length": 10, "hash_ids": [0, 9, 10, 11]},
        # continues the second but is shorter than its prompt + answer: an edit, left out
        {"timestamp": 3, "input_length": 1480, "output_length": 5, "hash_ids": [0, 1, 4]},
        # continues the third (the latest with those 3 whole blocks): 10 answered, 500 typed
        {"timestamp": 4, "input_length": 2510, "output_length": 5,
         "hash_ids": [0, 9, 10, 12, 13]},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert trace_chat_turns(src) == [(300, 60), (10, 500)]


def test_chat_workload_draws_turns_and_predicts_hits():
    fixed = chat_workload(2, 3, 256, answer=128, message=64)
    assert fixed.answers == ((128,) * 3,) * 2 and fixed.messages == ((64,) * 3,) * 2
    assert fixed.prompt_lengths(0) == [256, 448, 640]
    assert fixed.max_len == 640 + 128
    # prompt only: turn t + 1 gets turn t's whole prompt blocks (8, then 14)
    assert chat_expected_hits(fixed, False) == [[0, 256, 448]] * 2
    # decode blocks: turn t's prompt and answer less its last token: (256 + 127) // 32 = 11
    # blocks, then (448 + 127) // 32 = 17
    assert chat_expected_hits(fixed, True) == [[0, 352, 544]] * 2
    # never the whole prompt: a prompt that ends on a block boundary keeps its last block
    w = ChatWorkload(64, ((33, 1),), ((31, 1),), "t")
    assert w.prompt_lengths(0) == [64, 128]
    assert chat_expected_hits(w, True) == [[0, 96]]  # 3 stored, (128 - 1) // 32 = 3
    assert chat_expected_hits(w, False) == [[0, 64]]

    pool = [(300, 20), (100, 900), (2000, 5)]
    a = chat_workload(3, 4, 100, pool=pool, seed=1, message_cap=512, answer_cap=1024)
    assert a == chat_workload(3, 4, 100, pool=pool, seed=1, message_cap=512, answer_cap=1024)
    assert {x for row in a.answers for x in row} <= {300, 1024}  # 900-token message left out
    assert {x for row in a.messages for x in row} <= {20, 5}
    with pytest.raises(ValueError):
        chat_workload(1, 1, 100, pool=[(10, 900)], message_cap=512)


def test_parse_result_and_metrics(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(SAVED))
    f = parse_result(p)
    assert f["mean_ttft_ms"] == 4721.6 and f["p50_ttft_ms"] == 5560.4
    assert f["p99_ttft_ms"] == 6515.8 and f["p99_tpot_ms"] == 517.2
    assert f["total_token_throughput"] == 886.3 and f["failed"] == 0 and f["completed"] == 8
    assert f["max_ttft_ms"] != f["max_ttft_ms"] and ttfts_ms(p) == []  # not --save-detailed
    # --save-detailed: each request's TTFT (s), a failed one's 0
    p.write_text(json.dumps(SAVED | {"ttfts": [0.25, 6.5158, 0, 0.0401]}))
    assert ttfts_ms(p) == [250.0, 6515.8, 40.1] and parse_result(p)["max_ttft_ms"] == 6515.8
    m = parse_metrics(METRICS)
    assert m["vllm:external_prefix_cache_hits_total"] == 4096
    assert m["vllm:prompt_tokens_by_source_total{local_compute}"] == 512
    assert "vllm:num_requests_running" not in m and not any("created" in k for k in m)
    # two engines' lines sum
    two = METRICS + 'vllm:external_prefix_cache_hits_total{engine="1",model_name="/m"} 4.0\n'
    assert parse_metrics(two)["vllm:external_prefix_cache_hits_total"] == 4100


def test_hit_rates():
    assert unservable_tail([1088]) == 32  # 34 whole blocks: the last one is computed
    assert unservable_tail([1090, 33]) == 2 + 1
    before = parse_metrics(METRICS)
    after = dict(before)
    # 4 requests of 1088 tokens, nothing local: 4 x 33 blocks hit
    after["vllm:external_prefix_cache_queries_total"] += 4 * 1088
    after["vllm:external_prefix_cache_hits_total"] += 4 * 1056
    r = hit_rates(counter_delta(before, after), [1088] * 4)
    assert r["external_hit_rate"] == pytest.approx(1056 / 1088)
    assert r["servable_hit_rate"] == pytest.approx(1.0)
    none = hit_rates({}, [1088])
    assert none["external_hit_rate"] != none["external_hit_rate"]  # nan: no connector


def _res(case, phase, mean, engine=0, workload="prefix_repetition", **kw):
    f = {"mean_ttft_ms": mean, "p50_ttft_ms": mean, "p99_ttft_ms": 2 * mean, "p99_tpot_ms": 50.0,
         "total_token_throughput": 900.0, "failed": 0.0, **kw}
    return RunResult(case, phase, engine, workload, f)


def test_rows_and_goals():
    results = [
        _res("alone", "cold", 1000.0),
        _res("example", "cold", 1100.0), _res("example", "restart", 200.0),
        _res("embedded", "cold", 900.0), _res("embedded", "restart", 100.0),
        _res("shared", "cold", 900.0), _res("shared", "cold", 120.0, engine=1,
                                             servable_hit_rate=0.95, external_hit_rate=0.8),
        _res("shared", "restart", 180.0), _res("shared", "restart", 110.0, engine=1),
    ]
    rows = sv.rows_from(results)
    by = {r.name: r for r in rows}
    assert by["prefix_repetition: mean TTFT, alone cold"].ratio == pytest.approx(1.0)
    assert by["prefix_repetition: mean TTFT, shared cold engine B"].ratio == pytest.approx(1000 / 120)
    g = by["goal: embedded after restart, mean TTFT vs vLLM alone"]
    assert g.meets_goal and g.ratio == pytest.approx(10.0)
    g = by["goal: embedded after restart, mean TTFT vs ExampleConnector after restart"]
    assert g.meets_goal and g.ratio == pytest.approx(2.0)
    g = by["goal: shared after restart, mean TTFT vs vLLM alone"]
    assert not g.meets_goal  # 0.18x
    g = by["goal: shared after restart, mean TTFT vs ExampleConnector after restart"]
    assert not g.meets_goal and g.ratio == pytest.approx(200 / 180)  # 0.9x, goal 0.8x
    hit = by["goal: prefix_repetition, second engine's external hits on what the first "
             "computed (cold daemon)"]
    assert hit.value == 0.95 and hit.meets_goal
    table = sv.markdown_table(results)
    assert table.count("\n") == len(results) + 1
    assert "| prefix_repetition | shared cold engine B | 120 ms |" in table


def test_process_groups_are_killed(tmp_path):
    procs = Procs()
    # a shell with a child in the same group, and one that ignores SIGTERM
    g1 = procs.start(["sh", "-c", "sleep 300 & wait"], tmp_path / "a.log")
    g2 = procs.start([sys.executable, "-c", "import signal, time; "
                      "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                      "time.sleep(300)"], tmp_path / "b.log")
    deadline = time.monotonic() + 30
    while "up" not in g2.tail() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert g1.group_alive() and g2.group_alive()
    g2_grace = time.monotonic()
    g2.stop(grace=0.5)  # SIGTERM ignored: SIGKILL after the grace
    assert time.monotonic() - g2_grace < 15
    assert not g2.group_alive()
    procs.groups.remove(g2)
    procs.stop_all()
    assert not g1.group_alive() and procs.groups == []
    with pytest.raises(ProcessLookupError):
        os.killpg(g1.pgid, signal.SIGTERM)


def test_wait_ready_reports_an_engine_that_exits(tmp_path):
    g = Group([sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
              tmp_path / "x.log")
    try:
        with pytest.raises(RuntimeError, match="boom: bad flag"):
            wait_ready(g, 1, timeout=30)
    finally:
        g.stop(grace=1)


def test_skipped_without_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert vllm_python() is None
    with pytest.raises(ImportError, match="no vLLM environment"):
        check_vllm(None)
    bad = tmp_path / "python"
    bad.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named vllm' >&2\nexit 1\n")
    bad.chmod(0o755)
    with pytest.raises(ImportError, match="No module named vllm"):
        check_vllm(str(bad))
    res = run_sections(["serve"], BenchOptions(quick=True, workdir=str(tmp_path)), log=io.StringIO())
    assert res.ok and not res.rows
    assert len(res.skipped) == 1 and "serve: not available (no vLLM environment" in res.skipped[0]


def test_a_failed_run_is_recorded_and_the_rest_still_runs(tmp_path, monkeypatch):
    b = sv.Bench("/py", tmp_path, QUICK, io.StringIO())
    b.lengths = {"prefix_repetition": [288] * 4, "mooncake": [64] * 6}
    started: list[Group] = []

    def start_engines(case, phase, n):
        out = []
        for e in range(n):
            g = b.procs.start([sys.executable, "-c", "import time; time.sleep(300)"],
                              tmp_path / f"{case}-{phase}-{e}.log")
            started.append(g)
            out.append((g, 1000 + e))
        return out

    driven = []

    def drive(case, phase, engine, port, workload):
        driven.append((case, phase, engine, workload))
        if (phase, workload) == ("cold", "prefix_repetition"):
            raise RuntimeError("client exited with 1")
        return RunResult(case, phase, engine, workload, {})

    monkeypatch.setattr(b, "start_engines", start_engines)
    monkeypatch.setattr(b, "drive", drive)
    b.run_case(sv.Case("example", "x", 1, ("cold", "restart")))
    # the failed run does not stop the next workload nor the restart
    assert driven == [("example", p, 0, w) for p in ("cold", "restart")
                      for w in ("prefix_repetition", "mooncake")]
    assert [f["error"] for f in b.failures] == ["RuntimeError: client exited with 1"]
    monkeypatch.setitem(sv.SKIP, ("embedded", "mooncake"), "not today")
    b.run_case(sv.Case("embedded", "x", 1, ("cold",)))
    assert driven[-1] == ("embedded", "cold", 0, "prefix_repetition")  # mooncake left out
    assert len(b.failures) == 2
    # every engine was stopped when its phase ended
    assert not any(g.group_alive() for g in started) and b.procs.groups == []


def test_daemon_socket_fits_af_unix(tmp_path):
    assert daemon_socket(tmp_path) == tmp_path / "kv.sock"
    deep = tmp_path / ("d" * 120)
    assert len(str(daemon_socket(deep))) < 108


def test_sigterm_stops_every_group_even_when_sent_twice(tmp_path):
    """The section's process, sent SIGTERM twice, still kills what it started."""
    script = tmp_path / "s.py"
    script.write_text(f"""
import time
from pathlib import Path
from kvstore.bench import serve as sv
from kvstore.bench.serve_processes import Procs
procs = Procs()
with sv._sigterm_unwinds():
    try:
        g = procs.start(["sh", "-c", "sleep 300 & wait"], Path({str(tmp_path / 'g.log')!r}))
        print(g.pgid, flush=True)
        while True:
            time.sleep(0.1)
    finally:
        time.sleep(1.0)  # the second SIGTERM lands in here
        procs.stop_all()
        print("cleaned", flush=True)
""")
    import subprocess

    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    pgid = int(p.stdout.readline())
    p.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert "cleaned" in out and p.returncode == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_the_serve_section_needs_no_redis_py():
    # regression: start_engines took free_port from kvstore.tiers.remote, whose package
    # imports redis-py, which the vLLM environment lacks; the two-engine case failed there
    import subprocess
    import sys

    code = ("import sys; sys.modules['redis'] = None\n"
            "from kvstore.bench import serve\n"
            "from kvstore.bench.serve_processes import free_port\n"
            "assert 1024 <= free_port() < 65536\n"
            "assert 'kvstore.tiers.remote' not in sys.modules, 'the serve bench imports the remote tier'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
