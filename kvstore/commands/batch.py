"""``kvstore batch run``: a JSONL batch job with each shared prefix computed once."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from kvstore.integrations.batch.memory import WarmSizing

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


def _warm_sizing(args: argparse.Namespace, layout: Any,
                 prompts: Sequence[Sequence[int]]) -> WarmSizing | None:
    """The store's warm tier: ``--cpu-capacity`` when given, else sized from the job."""
    from kvstore.integrations.batch.memory import (
        WarmSizing,
        check_capacity,
        prefix_blocks,
        warm_capacity,
    )

    if not args.store:
        return None
    if args.cpu_capacity is None:
        return warm_capacity(prompts, block_tokens=layout.block_tokens,
                             block_nbytes=layout.block_nbytes)
    check_capacity(args.cpu_capacity, layout.block_nbytes,
                   layout=f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
                          f"{layout.head_dim} x {layout.block_tokens} tokens, K and V, "
                          f"{str(layout.dtype).removeprefix('torch.')}")
    return WarmSizing(capacity=args.cpu_capacity, source="--cpu-capacity",
                      prefix_blocks=prefix_blocks(prompts, layout.block_tokens),
                      block_nbytes=layout.block_nbytes)


def _open_engine(args: argparse.Namespace, tokenizer: Any, prompts: Sequence[Sequence[int]] = ()
                 ) -> tuple[Any, WarmSizing | None]:
    """The engine, and the warm tier of its store (None without ``--store``)."""
    if args.engine == "vllm":
        from transformers import AutoConfig

        from kvstore.integrations.batch.engines.vllm import VLLMEngine
        from kvstore.integrations.transformers import layout_for

        dtype = None if args.dtype == "auto" else _dtype(args.dtype)
        layout = layout_for(AutoConfig.from_pretrained(args.model), dtype=dtype,
                            block_tokens=VLLMEngine.BLOCK_SIZE)
        sizing = _warm_sizing(args, layout, prompts)
        return VLLMEngine.open(args.model, store_path=args.store, salt=args.salt,
                               dtype=args.dtype, max_batch_tokens=args.max_batch_tokens,
                               cpu_capacity=sizing.capacity if sizing else None), sizing
    from transformers import AutoModelForCausalLM

    from kvstore.integrations.batch.engines.transformers import TransformersEngine

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=_dtype(args.dtype))
    model = model.to(args.device).eval()
    store = sizing = None
    if args.store:
        from kvstore.integrations.transformers import layout_for, open_store_for

        sizing = _warm_sizing(args, layout_for(model), prompts)
        assert sizing is not None
        store = open_store_for(model, args.store, cpu_capacity=sizing.capacity)
    return TransformersEngine(model, tokenizer=tokenizer, store=store, salt=args.salt,
                              max_batch_tokens=args.max_batch_tokens,
                              max_batch_rows=args.max_batch_rows,
                              max_prefix_tokens=args.max_prefix_tokens), sizing


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


def _warm_text(w: WarmSizing) -> str:
    from kvstore.sizes import format_size, plural

    size = f"{format_size(w.capacity)} ({plural(w.blocks, 'block')} of {format_size(w.block_nbytes)})"
    if w.source != "job":
        return f"{size}, from {w.source}"
    why = f"the job's {plural(w.prefix_blocks, 'shared-prefix block')}"
    return f"{size}, sized from {why}" + (" (capped)" if w.capped else "")


def _print_summary(s: Any, out_path: str, warm: WarmSizing | None) -> None:
    from kvstore.sizes import format_size

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
    if warm is not None:
        rows.append(("store warm tier", _warm_text(warm)))
    rows.append(("peak memory (RSS)", format_size(s.peak_rss_bytes)))
    few, most = s.threads
    if most:
        rows.append(("CPU threads", str(most) if few == most else
                     f"{few}-{most} (fewer while other processes kept cores busy)"))
    out_console().print(kv_grid(rows, right=False))


def run(args: argparse.Namespace) -> int:
    from kvstore.integrations.batch.jobs import read_requests

    if not Path(args.model).is_dir():
        return error("batch", f"--model {args.model}: not a model directory")
    if args.output is None and not args.plan_only:
        return error("batch", "OUT is required (or give --plan-only)")
    out = None if args.output is None or args.plan_only else Path(args.output)
    if out is not None and out.is_dir():  # found before the model loads, not after the job
        return error("batch", f"OUT {out} is a directory: give a file path for the results")
    if out is not None and out.exists() and Path(args.input).exists() \
            and os.path.samefile(out, args.input):  # before: the answers replaced the input
        return error("batch", f"OUT {out} is the input file IN: the answers would replace the "
                     "requests; give another OUT")
    if out is not None and not out.parent.is_dir():
        return error("batch", f"OUT {out}: the directory {out.parent} does not exist; create "
                     "it or give another path")
    if out is not None and Path(f"{out}.partial").is_dir():
        return error("batch", f"{out}.partial (where an interrupted job's results go) is a "
                     "directory: move it away or give another OUT")
    if args.cpu_capacity is not None and not args.store:
        return error("batch", "--cpu-capacity sizes the warm tier of the --store: give "
                     "--store PATH too, or leave --cpu-capacity out (without a store the "
                     "engine keeps shared prefixes in its own memory only)")
    if out is not None:  # another job writing OUT: said now, not after the model loads
        from kvstore.integrations.batch.jobs import OutputLock

        probe = OutputLock(out)
        probe.acquire()
        probe.release()
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
    import dataclasses

    from kvstore.integrations.batch.memory import peak_rss
    from kvstore.integrations.batch.runner import run_job

    engine, warm = _open_engine(args, tok, [r.token_ids for r in job.requests])
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
        # the store this command opened: before, left open until the interpreter's exit hook
        # (a flush that failed there came after exit status 0; run in a process that goes on,
        # the store stayed open, its index mapped)
        store = getattr(engine, "store", None) if args.engine != "vllm" else None
        if store is not None:
            store.close()
    summary = dataclasses.replace(summary, peak_rss_bytes=peak_rss())  # the store's flush too
    if args.format == "json":
        store = None if warm is None else {
            "path": os.fspath(args.store), "cpu_capacity_bytes": warm.capacity,
            "sized_from": warm.source, "blocks": warm.blocks, "block_bytes": warm.block_nbytes,
            "prefix_blocks": warm.prefix_blocks, "capped": warm.capped}
        emit_json("batch", {"output": os.fspath(args.output), "summary": summary,
                            "tokens_per_s": summary.tokens_per_s, "store": store})
    else:
        _print_summary(summary, args.output, warm)
    return EXIT_ERROR if job.errors else EXIT_OK


def _warm_size(text: str) -> int:
    """``--cpu-capacity``: a byte size (units as every size flag) of at least one byte."""
    from kvstore.errors import SizeError
    from kvstore.sizes import parse_size

    out = "leave --cpu-capacity out to size the tier from the job"
    fix = f"give a size like 256MiB, or {out}"
    try:
        n = parse_size(text, what="the size")
    except SizeError as e:
        why = str(e).replace("the size=", "").replace(" (0 disables the tier)", "")
        # "... is not a size; write an int or a string like ..." says what to write already
        raise argparse.ArgumentTypeError(
            f"{why}, or {out}" if "write an int" in why else f"{why}; {fix}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text} leaves the store no warm tier, which holds the blocks it loads and saves; "
            f"{fix}")
    return n


_warm_size.__name__ = "size"  # argparse names the type in "invalid size value" messages


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
                        "kvstore batch run in.jsonl out.jsonl --model DIR --store DIR2 "
                        "--cpu-capacity 1GiB",
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
                   help="tokens per packed forward: joining rows' suffixes, one per running "
                   "row (default 8192)")
    r.add_argument("--max-batch-rows", type=integer(minimum=1), default=256, metavar="N",
                   help="sequences in flight (default 256)")
    r.add_argument("--max-prefix-tokens", type=integer(minimum=1), metavar="N",
                   help="shared-prefix tokens whose K/V the engine holds at once (default 32 x "
                   "--max-batch-tokens; transformers engine): with --max-batch-tokens, what "
                   "bounds the engine's own memory")
    r.add_argument("--cpu-capacity", type=_warm_size, metavar="SIZE",
                   help="the --store's warm tier (host memory), e.g. 256MiB (default: sized "
                   "from the job, its shared-prefix blocks x 1.25, at most 4GiB)")
    add_format(r)
    r.set_defaults(func=guard("batch", run))
