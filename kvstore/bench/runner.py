"""Run benchmark sections, print a table, optionally write JSON.

Each section prints a progress line (to stderr) when it starts and ends. A section that fails
is reported (its error, and the traceback's last lines) and skipped: the others still run,
the table and the JSON still come out, and the run ends with exit status 1.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from kvstore.bench import BenchOptions, BenchRow


@dataclass(frozen=True, slots=True)
class Section:
    module: str
    about: str  # one line for ``kvstore bench --help``


#: section name -> module and what it measures; a module whose import fails (optional pieces)
#: is reported as not available, not as a failure
SECTIONS = {
    "hashing": Section("kvstore.bench.hashing", "block keys of a 128k-token prompt vs a "
                       "vLLM-style sha256 chain"),
    "memory": Section("kvstore.bench.memory", "hot/warm tier fetch and put vs memcpy"),
    "promotion": Section("kvstore.bench.promotion", "promoting warm blocks to the hot tier vs a "
                         "plain copy"),
    "disk": Section("kvstore.bench.disk", "disk tier reads and writes vs raw file I/O of the "
                    "same bytes"),
    "remote": Section("kvstore.bench.remote", "Redis tier vs raw redis-py (needs redis-server)"),
    "prefill": Section("kvstore.bench.prefill", "prefill with a cached prefix vs none; batch "
                       "planner vs naive (needs transformers)"),
    "daemon": Section("kvstore.bench.daemon", "the sidecar daemon: lookup round trip, "
                      "shared-memory fetch/put vs embedded and memcpy"),
    "startup": Section("kvstore.bench.startup", "kvstore --help / ls start-up vs a bare "
                       "interpreter and vs import torch"),
    "explain": Section("kvstore.bench.explain", "kvstore explain of a 128k-token prompt on a "
                       "10,000-block store vs a plain lookup"),
    "packs": Section("kvstore.bench.packs", "prefix pack export / import vs cp of the same "
                     "bytes"),
    "routing": Section("kvstore.bench.routing", "prefix routing vs round-robin / hash on the "
                       "Mooncake trace, simulated and through 4 real stores; the router's "
                       "decision time"),
    "replay": Section("kvstore.bench.replay", "the default eviction policy vs LRU and Belady on "
                      "the Mooncake trace through a real store; its bookkeeping per block"),
    "batch": Section("kvstore.bench.batch", "batched prefix sharing on a 110M Llama (0.5B with "
                     "KVSTORE_BENCH_BATCH_MODEL=0.5b; a toy under --quick) vs vLLM prefix "
                     "caching in float32 (needs transformers, .venv-vllm)"),
    "serve": Section("kvstore.bench.serve", "vllm serve driven by vLLM's own client: alone, "
                     "ExampleConnector, kvstore embedded, two engines on one daemon, cold and "
                     "after a restart (needs .venv-vllm)"),
}


@dataclass(frozen=True, slots=True)
class Failure:
    """A section that raised: what, and the end of its traceback."""

    section: str
    error: str
    traceback: str


@dataclass(frozen=True, slots=True)
class BenchRun:
    rows: tuple[BenchRow, ...]
    skipped: tuple[str, ...]  # sections not available here, with why
    failed: tuple[Failure, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failed


def sections_help() -> str:
    width = max(len(n) for n in SECTIONS)
    return "sections (--section, repeatable; default: all, in this order):\n" + "\n".join(
        f"  {n:<{width}}  {s.about}" for n, s in SECTIONS.items())


def _run_one(name: str, opts: BenchOptions) -> list[BenchRow]:
    mod = importlib.import_module(SECTIONS[name].module)
    run: Callable[[BenchOptions], list[BenchRow]] = mod.run
    return list(run(opts))


def run_sections(names: Sequence[str], opts: BenchOptions, *,
                 log: TextIO | None = None) -> BenchRun:
    """Run ``names`` in order (names must be keys of :data:`SECTIONS`), one progress line per
    section on ``log`` (default stderr); a section that raises is recorded and skipped."""
    out = sys.stderr if log is None else log
    rows: list[BenchRow] = []
    skipped: list[str] = []
    failed: list[Failure] = []
    t_all = time.perf_counter()
    for i, name in enumerate(names, 1):
        tag = f"[{i}/{len(names)}] {name}"
        print(f"{tag}: running ({SECTIONS[name].about})", file=out, flush=True)
        t0 = time.perf_counter()
        try:
            got = _run_one(name, opts)
        except ImportError as e:
            if (e.name or "").split(".")[0] == "kvstore":  # our own code broke: not optional
                tb = "".join(traceback.format_exception(e)[-6:])
                failed.append(Failure(name, f"{type(e).__name__}: {e}", tb))
                print(f"{tag}: FAILED: {type(e).__name__}: {e}\n{tb}", file=out, flush=True)
                continue
            skipped.append(f"{name}: not available ({e})")
            print(f"{tag}: skipped, not available ({e})", file=out, flush=True)
            continue
        except Exception as e:  # one section's failure must not end the run
            tb = "".join(traceback.format_exception(e)[-6:])
            failed.append(Failure(name, f"{type(e).__name__}: {e}", tb))
            print(f"{tag}: FAILED after {time.perf_counter() - t0:.1f} s: "
                  f"{type(e).__name__}: {e}\n{tb}", file=out, flush=True)
            continue
        rows.extend(got)
        print(f"{tag}: done in {time.perf_counter() - t0:.1f} s, {len(got)} figure(s)",
              file=out, flush=True)
    return BenchRun(tuple(rows), tuple(skipped), tuple(failed), time.perf_counter() - t_all)


def render(res: BenchRun) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvstore benchmarks (ratio: higher is better for kvstore)")
    for col in ("section", "figure", "value", "reference", "ref value", "ratio", "goal"):
        table.add_column(col, justify="right" if col in ("value", "ref value", "ratio", "goal")
                         else "left")
    for r in res.rows:
        goal = "" if r.goal is None else (f"≥{r.goal:g} " + ("✓" if r.meets_goal else "✗"))
        table.add_row(r.section, r.name + (f"\n[dim]{r.note}[/dim]" if r.note else ""),
                      f"{r.value:.3g} {r.unit}", r.ref_name, f"{r.ref_value:.3g} {r.unit}",
                      f"{r.ratio:.2f}×", goal)
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for p in res.skipped:
        console.print(f"[yellow]skipped[/yellow] {p}")
    for f in res.failed:
        console.print(f"[red]FAILED[/red] {f.section}: {f.error} (traceback above, on stderr)")
    console.print(f"{len(res.rows)} figure(s) in {res.seconds:.0f} s"
                  + (f"; {len(res.failed)} section(s) failed" if res.failed else ""))


def to_json(res: BenchRun) -> str:
    import torch

    return json.dumps(
        {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "torch": torch.__version__, "cuda": torch.cuda.is_available()},
            "rows": [dataclasses.asdict(r) | {"meets_goal": r.meets_goal} for r in res.rows],
            "skipped": list(res.skipped),
            "failed": [dataclasses.asdict(f) for f in res.failed],
            "seconds": res.seconds,
        },
        indent=2,
    )
