"""``kvstore batch run``: a JSONL batch job with each shared prefix computed once."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvstore.commands.args import Formatter, add_format, examples, integer
from kvstore.commands.output import (
    EXIT_ERROR,
    EXIT_OK,
    emit_json,
    err_console,
    error,
    guard,
    kv_grid,
    out_console,
    progress,
    table,
)

_MAX_ERRORS_SHOWN = 20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _model_info(model_dir: str) -> tuple[Any, Any]:
    """The model's config and its tokenizer (None when the directory has none)."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(model_dir)
    tok = None
    if any((Path(model_dir) / f).exists() for f in _TOKENIZER_FILES):
        tok = AutoTokenizer.from_pretrained(model_dir)
    return cfg, tok


def _job_key(args: argparse.Namespace) -> str:
    """What else decides a result: engine, model (files, sizes, times), dtype, salt."""
    d = Path(args.model).resolve()
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in d.iterdir()
                   if p.is_file())
    doc = [args.engine, str(d), files, args.dtype, args.salt]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]


def _dtype(name: str) -> Any:
    import torch

    return {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def _open_engine(args: argparse.Namespace, tokenizer: Any) -> Any:
    if args.engine == "vllm":
        from kvstore.integrations.batch.engines.vllm import VLLMEngine

        return VLLMEngine.open(args.model, store_path=args.store, salt=args.salt,
                               dtype=args.dtype, max_batch_tokens=args.max_batch_tokens)
    from transformers import AutoModelForCausalLM

    from kvstore.integrations.batch.engines.transformers import TransformersEngine

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=_dtype(args.dtype))
    model = model.to(args.device).eval()
    store = None
    if args.store:
        from kvstore.integrations.transformers import open_store_for

        store = open_store_for(model, args.store)
    return TransformersEngine(model, tokenizer=tokenizer, store=store, salt=args.salt,
                              max_batch_tokens=args.max_batch_tokens,
                              max_batch_rows=args.max_batch_rows)


def _report_errors(job: Any) -> None:
    errs = job.errors
    if len(errs) > 1 and not job.requests and len({e.message for e in errs}) == 1:
        # every line fails for one reason: said once, not once a line
        print(f"kvstore batch: all {len(errs)} lines: {errs[0].message}; nothing ran",
              file=sys.stderr)
        return
    for e in errs[:_MAX_ERRORS_SHOWN]:
        who = f" (custom_id {e.custom_id!r})" if e.custom_id else ""
        print(f"kvstore batch: line {e.line}{who}: {e.message}", file=sys.stderr)
    if len(errs) > _MAX_ERRORS_SHOWN:
        print(f"kvstore batch: ... and {len(errs) - _MAX_ERRORS_SHOWN} more bad lines",
              file=sys.stderr)
    if errs and not job.requests:
        print("kvstore batch: no line can run: nothing ran", file=sys.stderr)


def _plan_only(args: argparse.Namespace, job: Any) -> int:
    from kvstore.integrations.batch import plan_batch

    reqs = job.requests
    plan = plan_batch([r.token_ids for r in reqs], budget_blocks=None) if reqs else None
    if args.format == "json":
        emit_json("batch.plan", {"requests": len(reqs), "errors": job.errors, "plan": plan})
    elif plan is not None:
        rows = [(str(g.group), str(g.parent), f"{g.shared_tokens:,}", str(len(g.prompts)),
                 ", ".join(reqs[i].custom_id for i in g.prompts[:4])
                 + (", ..." if len(g.prompts) > 4 else "")) for g in plan.groups]
        out = out_console()
        out.print(table([("group", "right"), ("parent", "right"), ("shared tokens", "right"),
                         ("requests", "right"), ("custom_ids", "left")], rows,
                        wrap=("custom_ids",), title="shared prefixes"))
        out.print(kv_grid([("requests", f"{len(reqs):,}"),
                           ("prompt tokens (naive)", f"{plan.naive_tokens:,}"),
                           ("lower bound (unique tokens)", f"{plan.lower_bound_tokens:,}"),
                           ("shared prefixes", f"{len(plan.groups):,}")]))
    return EXIT_ERROR if job.errors else EXIT_OK


def _print_summary(s: Any, out_path: str) -> None:
    bound = s.computed_tokens / s.lower_bound_tokens if s.lower_bound_tokens else 0.0
    rows = [
        ("engine", s.engine), ("output", out_path),
        ("requests", f"{s.requests:,} ({s.resumed:,} kept from an interrupted run)"
         if s.resumed else f"{s.requests:,}"),
        ("bad lines", f"{len(s.errors):,}"),
        ("prompt tokens computed", f"{s.computed_tokens:,}"
         + (f" (from {s.token_source})" if s.token_source else "")),
        ("  naive (every prompt in full)", f"{s.naive_tokens:,}"),
        ("  lower bound (unique tokens)", f"{s.lower_bound_tokens:,} ({bound:.2f}x)"),
    ]
    if s.stored_tokens:
        rows.append(("  loaded from the store", f"{s.stored_tokens:,}"))
    rows += [("generated tokens", f"{s.generated_tokens:,}"),
             ("wall time", f"{s.seconds:.2f} s"),
             ("throughput", f"{s.tokens_per_s:,.0f} tokens/s ({s.generated_per_s:,.0f} generated)")]
    out_console().print(kv_grid(rows, right=False))


def run(args: argparse.Namespace) -> int:
    from kvstore.integrations.batch.engines.threads import prefer_passive_waits
    from kvstore.integrations.batch.jobs import read_requests

    if args.engine == "transformers":  # before torch loads OpenMP (engines/threads.py)
        prefer_passive_waits()

    if not Path(args.model).is_dir():
        return error("batch", f"--model {args.model}: not a model directory")
    if args.output is None and not args.plan_only:
        return error("batch", "OUT is required (or give --plan-only)")
    cfg, tok = _model_info(args.model)
    tokenize = (lambda text: tok(text).input_ids) if tok is not None else None
    job = read_requests(args.input, tokenize=tokenize, vocab=getattr(cfg, "vocab_size", None),
                        context=getattr(cfg, "max_position_embeddings", None))
    _report_errors(job)
    if job.errors and not job.requests:  # nothing can run: no model to load, no OUT to write
        return EXIT_ERROR
    if args.plan_only:
        return _plan_only(args, job)
    if job.errors and args.on_error == "fail":
        print(f"kvstore batch: {len(job.errors)} bad line(s) and --on-error fail: nothing ran",
              file=sys.stderr)
        return EXIT_ERROR
    return _run_job(args, job, tok)


def _run_job(args: argparse.Namespace, job: Any, tok: Any) -> int:
    from kvstore.integrations.batch.runner import run_job

    engine = _open_engine(args, tok)
    err = err_console()
    try:
        with progress(err, f"kvstore batch ({engine.name})") as bar:
            task = bar.add_task("", total=len(job.requests), extra="")

            def tick(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            summary = run_job(job, args.output, engine, job_key=_job_key(args),
                              on_error=args.on_error, resume=not args.no_resume, progress=tick)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    if args.format == "json":
        emit_json("batch", {"output": os.fspath(args.output), "summary": summary,
                            "tokens_per_s": summary.tokens_per_s})
    else:
        _print_summary(summary, args.output)
    return EXIT_ERROR if job.errors else EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("batch", help="batch jobs with shared prefixes computed once",
                       formatter_class=Formatter,
                       description="Offline batch jobs whose requests share prefixes: each "
                       "shared prefix is computed once and the rest runs token-batched "
                       "(docs/integrations.md, \"Batched prefix sharing\").",
                       epilog="examples:\n  kvstore batch run in.jsonl out.jsonl --model DIR")
    bsub = b.add_subparsers(dest="batch_command", required=True, metavar="ACTION",
                            help="run: run a JSONL job")
    r = bsub.add_parser(
        "run", help="run a JSONL batch job", formatter_class=Formatter,
        description="Run the requests of IN (one JSON object per line: custom_id, prompt or "
                    "token_ids, max_tokens, temperature, top_p, top_k, seed, stop, "
                    "stop_token_ids, ignore_eos) and write one result per line to OUT, in "
                    "input order. Bad lines are reported with their line number; with "
                    "--on-error skip (default) the rest runs and the exit status is 2. A job "
                    "interrupted half way resumes from OUT.partial.",
        epilog=examples("kvstore batch run questions.jsonl answers.jsonl --model ./my-model",
                        "kvstore batch run in.jsonl out.jsonl --model DIR --store ~/.cache/kvstore",
                        "kvstore batch run in.jsonl --model DIR --plan-only",
                        "kvstore batch run in.jsonl out.jsonl --model DIR --engine vllm"))
    r.add_argument("input", metavar="IN", help="requests, one JSON object per line")
    r.add_argument("output", metavar="OUT", nargs="?", help="results, one JSON object per line")
    r.add_argument("--model", required=True, metavar="DIR", help="a transformers model directory")
    r.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="transformers (token batching, default) or vllm (needs vLLM installed)")
    r.add_argument("--store", metavar="PATH",
                   help="a kvstore store for shared prefixes (loaded from and saved to it)")
    r.add_argument("--salt", help="cache salt of the store's blocks (isolates tenants)")
    r.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights' dtype when loading the model (default: as saved)")
    r.add_argument("--device", default="cpu", help="torch device of the transformers engine")
    r.add_argument("--on-error", choices=["skip", "fail"], default="skip",
                   help="skip bad lines (an error line in OUT, exit 2) or run nothing")
    r.add_argument("--no-resume", action="store_true",
                   help="recompute everything even if OUT.partial holds finished requests")
    r.add_argument("--plan-only", action="store_true", help="print the plan, run nothing")
    r.add_argument("--max-batch-tokens", type=integer(minimum=1), default=8192, metavar="N",
                   help="suffix tokens per packed forward (default 8192)")
    r.add_argument("--max-batch-rows", type=integer(minimum=1), default=256, metavar="N",
                   help="sequences decoding together (default 256)")
    add_format(r)
    r.set_defaults(func=guard("batch", run))
