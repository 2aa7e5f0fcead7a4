"""``kvstore bench --section serve``: ``vllm serve`` driven by vLLM's own serving client.

The section starts ``kvstore serve`` and ``vllm serve`` itself (vLLM's OpenAI server,
``python -m vllm.entrypoints.openai.api_server``, from the vLLM environment ``.venv-vllm`` or
``$KVSTORE_VLLM_PYTHON``) and drives each engine with vLLM's benchmark client
(``vllm.benchmarks.serve``, through :mod:`kvstore.bench.serve_runner`) on two workloads:

- ``prefix_repetition`` (vLLM's dataset: a few long prefixes, each with short suffixes);
- the Mooncake conversation trace (``../shared/traces/mooncake_conversation.jsonl`` or
  ``$KVSTORE_TRACE``) through vLLM's ``timed_trace`` dataset: a window of the trace, its
  512-token hash blocks scaled to ``trace_chunk`` tokens, its timestamps stretched to what
  this machine serves (:func:`~kvstore.bench.serve_workloads.convert_trace`).

Cases (:func:`plan`): vLLM alone; vLLM + ExampleConnector; vLLM + kvstore embedded; two
``vllm serve`` processes sharing one ``kvstore serve`` daemon. Each connector case runs cold
(empty cache) and after a restart of the engines (the cache kept); the two sharing engines
run one after the other, so the second one's first requests find what the first computed.

Figures per (case, phase, engine, workload): TTFT mean/p50/p99, TPOT p99 and throughput from
the client's ``--save-result`` JSON; the external hit rate from vLLM's ``/metrics``
(``vllm:external_prefix_cache_hits / queries``, before/after deltas) and the same hits over
the tokens an external cache could serve at most (whole blocks, the last token excluded).

Goals (issue 29): after a restart, mean TTFT on ``prefix_repetition`` <= 0.15x vLLM alone and
<= 0.8x ExampleConnector's after its restart; the second engine sharing the daemon hits >= 0.9
of what the first computed. Rows compare times as ``reference / ours`` (higher is better).

Every process runs in its own process group and every group is killed at the end, whatever
happened. Without a vLLM environment the section is skipped (``ImportError`` with the reason).

This module is the section's plan, its run and its rows; the pieces are beside it: the sizes
(:mod:`~kvstore.bench.serve_scale`), the command lines (:mod:`~kvstore.bench.serve_commands`),
the Mooncake window (:mod:`~kvstore.bench.serve_workloads`), the processes
(:mod:`~kvstore.bench.serve_processes`) and the parsed results
(:mod:`~kvstore.bench.serve_results`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvstore.bench import BenchOptions, BenchRow
from kvstore.bench.serve_commands import (
    check_vllm,
    client_command,
    client_env,
    daemon_socket,
    server_command,
    server_env,
    transfer_config,
    vllm_python,
)
from kvstore.bench.serve_processes import Group, Procs, free_port, metrics, wait_ready, warm_up
from kvstore.bench.serve_results import (
    RunResult,
    counter_delta,
    find,
    hit_rates,
    parse_result,
    ttfts_ms,
)
from kvstore.bench.serve_scale import FULL, QUICK, Scale
from kvstore.bench.serve_workloads import convert_trace, trace_reuse, trace_source

SECTION = "serve"
TTFT_GOAL_ALONE = 0.15  # restart mean TTFT / vLLM alone
TTFT_GOAL_EXAMPLE = 0.8  # restart mean TTFT / ExampleConnector after its restart
SHARED_HIT_GOAL = 0.9  # second engine's external hits on what the first computed


# -- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Case:
    key: str  # alone | example | embedded | shared
    label: str
    engines: int  # vllm serve processes
    phases: tuple[str, ...]  # cold, restart


def plan(quick: bool = False) -> list[Case]:
    """The cases, in the order they run. vLLM alone has no restart (nothing outlives it: a
    restart is the cold run again)."""
    return [
        Case("alone", "vLLM alone", 1, ("cold",)),
        Case("example", "vLLM + ExampleConnector", 1, ("cold", "restart")),
        Case("embedded", "vLLM + kvstore embedded", 1, ("cold", "restart")),
        Case("shared", "2 x vLLM + one kvstore daemon", 2, ("cold", "restart")),
    ]


WORKLOADS = ("prefix_repetition", "mooncake")
#: workloads a case leaves out, and why
SKIP: dict[tuple[str, str], str] = {}


# -- rows -----------------------------------------------------------------------------------------
def _fmt_note(f: Mapping[str, float]) -> str:
    def g(k: str, spec: str = ".0f") -> str:
        v = f.get(k, float("nan"))
        return "-" if v != v else format(v, spec)
    return (f"p50 {g('p50_ttft_ms')} / p99 {g('p99_ttft_ms')} ms TTFT, TPOT p99 "
            f"{g('p99_tpot_ms')} ms, {g('total_token_throughput')} tok/s, ext hit "
            f"{g('external_hit_rate', '.2f')} (of servable {g('servable_hit_rate', '.2f')}), "
            f"failed {g('failed')}")


def rows_from(results: Sequence[RunResult]) -> list[BenchRow]:
    """Every run as a row (mean TTFT against vLLM alone on the same workload, the other
    figures in its note), then the goals' rows."""
    rows: list[BenchRow] = []
    for r in results:
        base = find(results, "alone", "cold", r.workload)
        ref = base.figures["mean_ttft_ms"] if base else float("nan")
        v = r.figures.get("mean_ttft_ms", float("nan"))
        rows.append(BenchRow(SECTION, f"{r.workload}: mean TTFT, {r.tag}", v, "ms",
                             "vLLM alone", ref, ref / v if v > 0 else float("nan"),
                             note=_fmt_note(r.figures)))
    wl = "prefix_repetition"
    alone = find(results, "alone", "cold", wl)
    example = find(results, "example", "restart", wl)
    for case in ("embedded", "shared"):
        got = find(results, case, "restart", wl)
        if got is None:
            continue
        v = got.figures["mean_ttft_ms"]
        if alone is not None:
            ref = alone.figures["mean_ttft_ms"]
            rows.append(BenchRow(SECTION, f"goal: {case} after restart, mean TTFT vs vLLM alone",
                                 v, "ms", "vLLM alone", ref, ref / v, goal=1 / TTFT_GOAL_ALONE,
                                 note=f"{v / ref:.3f}x (goal <= {TTFT_GOAL_ALONE}x)"))
        if example is not None:
            ref = example.figures["mean_ttft_ms"]
            rows.append(BenchRow(SECTION, f"goal: {case} after restart, mean TTFT vs "
                                 "ExampleConnector after restart", v, "ms",
                                 "ExampleConnector after restart", ref, ref / v,
                                 goal=1 / TTFT_GOAL_EXAMPLE,
                                 note=f"{v / ref:.3f}x (goal <= {TTFT_GOAL_EXAMPLE}x)"))
    for w in WORKLOADS:
        b = find(results, "shared", "cold", w, engine=1)
        if b is None:
            continue
        rate = b.figures.get("servable_hit_rate", float("nan"))
        rows.append(BenchRow(SECTION, f"goal: {w}, second engine's external hits on what the "
                             "first computed (cold daemon)", rate, "", "all of it", 1.0, rate,
                             goal=SHARED_HIT_GOAL if w == wl else None,
                             note=f"vLLM's external hit rate {b.figures.get('external_hit_rate', 0):.3f}"))
    return rows


def markdown_table(results: Sequence[RunResult]) -> str:
    """The docs' table: one line per run."""
    head = ("| workload | run | mean TTFT | p50 TTFT | p99 TTFT | p99 TPOT | tok/s | ext hit rate "
            "(of servable) | x vLLM alone (mean TTFT) |\n"
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = [head]
    for r in results:
        f = r.figures
        base = find(results, "alone", "cold", r.workload)
        x = (f["mean_ttft_ms"] / base.figures["mean_ttft_ms"]) if base else float("nan")
        hr = f.get("external_hit_rate", float("nan"))
        sr = f.get("servable_hit_rate", float("nan"))
        hit = "-" if hr != hr else f"{hr:.2f} ({sr:.2f})"
        lines.append(f"| {r.workload} | {r.tag} | {f['mean_ttft_ms']:,.0f} ms | "
                     f"{f['p50_ttft_ms']:,.0f} ms | {f['p99_ttft_ms']:,.0f} ms | "
                     f"{f['p99_tpot_ms']:,.0f} ms | {f['total_token_throughput']:,.0f} | {hit} | "
                     f"{x:.3f} |")
    return "\n".join(lines)


# -- the run -----------------------------------------------------------------------------------------
@dataclass
class Bench:
    python: str
    work: Path
    scale: Scale
    log: TextIO
    procs: Procs = field(default_factory=Procs)
    results: list[RunResult] = field(default_factory=list)
    lengths: dict[str, list[int]] = field(default_factory=dict)
    trace: Path | None = None
    daemon: Any = None
    start_seconds: list[float] = field(default_factory=list)
    trace_reuse: float = float("nan")
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def model(self) -> str:
        return str(self.work / "model")

    def say(self, msg: str) -> None:
        print(f"  serve: {msg}", file=self.log, flush=True)

    def prepare(self) -> None:
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        (self.work / "results").mkdir(exist_ok=True)
        (self.work / "example").mkdir(exist_ok=True)
        if not (self.work / "model" / "config.json").exists():
            self.say(f"building the model {dict(self.scale.model)}")
            subprocess.run([self.python, "-m", "kvstore.bench.serve_runner", "model", self.model,
                            json.dumps(dict(self.scale.model))], check=True, env=client_env(),
                           capture_output=True, timeout=900)
        s = self.scale
        self.lengths["prefix_repetition"] = [s.prefix_len + s.suffix_len] * (
            s.num_prompts // s.num_prefixes * s.num_prefixes)
        src = trace_source()
        if src is None:
            self.say("Mooncake trace not found ($KVSTORE_TRACE, ../shared/traces): that "
                     "workload is left out")
            return
        self.trace = self.work / "mooncake_timed_trace.jsonl"
        self.lengths["mooncake"] = convert_trace(src, self.trace, s)
        rows = [json.loads(line) for line in self.trace.read_text().splitlines()]
        self.trace_reuse = trace_reuse([(r["input_length"], r["hash_ids"]) for r in rows],
                                       s.trace_chunk)
        self.say(f"Mooncake window: {len(rows)} requests over {rows[-1]['timestamp']:.0f} s, "
                 f"{sum(self.lengths['mooncake']):,} prompt tokens, block reuse within the "
                 f"window {self.trace_reuse:.3f}")

    def workloads(self) -> list[str]:
        return [w for w in WORKLOADS if w in self.lengths]

    def start_engines(self, case: str, phase: str, n: int) -> list[tuple[Group, int]]:
        out = []
        for e in range(n):
            port = free_port()
            cmd = server_command(self.python, self.model, port,
                                 transfer_config(case, self.work, e), self.scale)
            g = self.procs.start(cmd, self.work / "logs" / f"vllm-{case}-{phase}-{e}.log",
                                 server_env(self.scale))
            out.append((g, port))
        for e, (g, port) in enumerate(out):  # they start side by side
            sec = wait_ready(g, port, self.scale.start_timeout)
            self.start_seconds.append(sec)
            self.say(f"{case} {phase}: engine {e} up after {sec:.0f} s (port {port})")
            warm_up(port, self.model, int(self.scale.model["vocab"]), seed=zlib.crc32(f"{case}/{phase}/{e}".encode()))
        return out

    def drive(self, case: str, phase: str, engine: int, port: int, workload: str) -> RunResult:
        name = f"{case}-{phase}-{engine}-{workload}.json"
        before = metrics(port)
        cmd = client_command(self.python, self.model, port, workload, self.scale,
                             self.work / "results", name, self.trace)
        logp = self.work / "logs" / f"client-{name[:-5]}.log"
        g = self.procs.start(cmd, logp, client_env())
        try:
            rc = g.wait(self.scale.client_timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"vLLM's client ({workload}, {case} {phase}) ran past "
                               f"{self.scale.client_timeout:.0f} s:\n{g.tail()}") from None
        finally:
            self.procs.stop(g)
        if rc != 0 or not (self.work / "results" / name).exists():
            raise RuntimeError(f"vLLM's client ({workload}, {case} {phase}) exited with {rc}:"
                               f"\n{g.tail()}")
        time.sleep(1.0)  # the engine's stats are logged to /metrics once a step
        after = metrics(port)
        figs = parse_result(self.work / "results" / name)
        figs |= hit_rates(counter_delta(before, after), self.lengths[workload])
        r = RunResult(case, phase, engine, workload, figs,
                      ttfts_ms(self.work / "results" / name))
        self.results.append(r)
        self.say(f"{workload:<17} {r.tag:<22} {_fmt_note(figs)}")
        return r

    def cleanup(self, keep: bool) -> None:
        """Stop every process, write ``serve_results.json`` and print the table; remove the work
        directory unless ``keep``."""
        self.procs.stop_all()
        if self.daemon is not None:
            self.daemon.stop()
        summary = {"scale": asdict(self.scale) | {"model": dict(self.scale.model)},
                   "results": [asdict(r) for r in self.results],
                   "start_seconds": self.start_seconds, "trace_reuse": self.trace_reuse,
                   "failures": self.failures,
                   "skipped": [f"{c} {w}: {why}" for (c, w), why in SKIP.items()],
                   "load_average": os.getloadavg()}
        with contextlib.suppress(OSError):
            (self.work / "serve_results.json").write_text(json.dumps(summary, indent=1))
        if self.results:
            print(markdown_table(self.results), file=sys.stderr, flush=True)
        for f in self.failures:
            print(f"FAILED: {f['workload']} {f['case']} {f['phase']} engine {f['engine']}: "
                  f"{f['error'][-300:]}", file=sys.stderr, flush=True)
        if not keep:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            self.say(f"kept {self.work} (logs, client JSON, serve_results.json)")

    def failed(self, case: str, phase: str, engine: int, workload: str, why: str) -> None:
        """A run that did not finish: recorded (the JSON, the log), the next ones still run."""
        self.failures.append({"case": case, "phase": phase, "engine": engine,
                              "workload": workload, "error": why})
        self.say(f"{workload} {case} {phase} engine {engine}: FAILED: {why[-2000:]}")

    def run_case(self, case: Case) -> None:
        if case.key == "shared":
            from kvstore.daemon.process import DaemonProcess

            sock = daemon_socket(self.work)
            self.daemon = DaemonProcess(self.work / "store-daemon", sock, "--cpu-capacity", "1GiB",
                                        "--disk-capacity", "16GiB",
                                        log_path=self.work / "logs" / "kvstore-serve.log")
            self.daemon.start()
        try:
            for phase in case.phases:
                engines = self.start_engines(case.key, phase, case.engines)
                try:
                    for e, (g, port) in enumerate(engines):
                        for w in self.workloads():
                            if (case.key, w) in SKIP:
                                self.say(f"{w}: left out for {case.key}: {SKIP[case.key, w]}")
                                continue
                            if not g.alive():
                                self.failed(case.key, phase, e, w, "the engine had exited")
                                continue
                            try:
                                self.drive(case.key, phase, e, port, w)
                            except (RuntimeError, TimeoutError, OSError) as err:
                                why = f"{type(err).__name__}: {err}"
                                if not g.alive():
                                    why = f"the engine exited: {g.tail(1500)}"
                                self.failed(case.key, phase, e, w, why)
                finally:
                    for g, _ in engines:
                        self.procs.stop(g)
        finally:
            if self.daemon is not None:
                self.daemon.stop()
                self.daemon = None


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """The first SIGTERM raises ``SystemExit`` while the section runs (main thread only), so
    its ``finally`` kills every process group it started; a second one while that cleanup
    runs is ignored (the default action would end the process with engines left running)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def _raise(signum: int, frame: object) -> None:
        got.append(signum)
        if len(got) == 1:
            raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run(opts: BenchOptions, *, cases: Sequence[str] | None = None,
        phases: Sequence[str] | None = None, scale: Scale | None = None) -> list[BenchRow]:
    """The section (``cases`` / ``phases``: a subset of :func:`plan`, for the smoke test)."""
    py = vllm_python()
    version = check_vllm(py)
    assert py is not None
    scale = scale or (QUICK if opts.quick else FULL)
    keep = opts.workdir is not None
    work = Path(tempfile.mkdtemp(prefix="kvstore-bench-serve-", dir=opts.workdir))
    b = Bench(py, work, scale, sys.stderr)
    b.say(f"vLLM {version} ({py}); work dir {work}; load average {os.getloadavg()[0]:.1f}")
    todo = [Case(c.key, c.label, c.engines, tuple(p for p in c.phases
                                                  if phases is None or p in phases))
            for c in plan(scale.quick) if cases is None or c.key in cases]
    with _sigterm_unwinds():
        try:
            b.prepare()
            for case in todo:
                b.run_case(case)
        finally:
            b.cleanup(keep)
    nan = float("nan")
    return rows_from(b.results) + [
        BenchRow(SECTION, f"{f['workload']}: {f['case']} {f['phase']} engine {f['engine']}: "
                 "FAILED", nan, "ms", "", nan, nan, note=f["error"][-300:])
        for f in b.failures]
