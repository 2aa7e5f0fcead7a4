"""Benchmark section ``disk``: the disk path users call, against the physical limit and
LMCache, same bytes, same run.

For 2 MiB and 32 MiB blocks of Llama-3-8B shaped bf16 KV (1 GiB; 64 MiB with ``quick``), every
method writes and reads the same bytes, **each operation in a fresh process**
(:mod:`kvstore.bench.disk_worker`), the methods interleaved within each repetition in an order
that rotates from one repetition to the next, the same number of repetitions for every
method; figures are medians with their [min-max]:

* durable put: kvstore ``put`` in 32 MiB pieces + ``flush`` (durable when it returns; the
  writer is then SIGKILLed); raw: one sequential ``write`` + ``fsync`` of the same bytes;
* cold read: kvstore ``fetch`` of the whole chain into the caller's tensor in a fresh process
  after the files were dropped from the page cache; raw: ``readinto`` of the one file;
* page-cache read: the same with the files in the page cache (an engine's hit after a
  restart); raw: the same ``readinto``;
* survives restart: the blocks a fresh process finds after the writer was killed;
* LMCache 0.5.6 ``LocalDiskBackend`` and ``FSL2Adapter`` (:mod:`kvstore.bench.disk_lmcache`),
  run in LMCache's own virtual environment when it is there, skipped with the reason otherwise.

Plus the reopen of a store whose index holds 1,000,000 records (100,000 with ``quick``), cold
index pages, and a first ``leading_run`` (goal < 2 s). ``python -m kvstore.bench.disk`` prints
the table of docs/benchmarks.md.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.bench import BenchOptions, BenchRow, throughput_row, time_row
from kvstore.bench.disk_harness import (
    Spread,
    WorkerError,
    Zygote,
    drop_cache,
    files_under,
    lmcache_python,
    load_cache,
    spread_gbs,
)

SECTION = "disk"
_MiB = 1 << 20
KVSTORE, RAW = "kvstore", "raw single file"
LOCAL_DISK, FSL2 = "LMCache 0.5.6 LocalDiskBackend", "LMCache 0.5.6 FSL2Adapter"
PHASES = ("put", "cold", "cached")


@dataclass(frozen=True, slots=True)
class Method:
    """One way of writing and reading the blocks, and how the benchmark drives it."""

    name: str
    lmcache: bool  # runs in LMCache's environment
    write_op: str
    read_op: str | None  # a fresh-process read; None: the write's process reads too
    survive_op: str | None = None  # counts what a fresh process finds (when read_op does not)
    kill_writer: bool = False  # SIGKILL the writer once its durable put returned
    note: str = ""


METHODS = (
    Method(KVSTORE, False, "kvstore.write", "kvstore.read", kill_writer=True,
           note="put + flush, writer SIGKILLed after flush"),
    Method(RAW, False, "raw.write", "raw.read", note="write + fsync; readinto"),
    Method(LOCAL_DISK, True, "lmcache_disk.all", None, "lmcache_disk.survive",
           note="no fsync; index in memory, so its reads run in the writing process"),
    Method(FSL2, True, "lmcache_fsl2.write", "lmcache_fsl2.read", note="no fsync"),
)


@dataclass(frozen=True, slots=True)
class DiskPlan:
    """What :func:`measure` runs."""

    block_tokens: tuple[int, ...] = (16, 256)  # 2 MiB and 32 MiB blocks of this layout
    total_bytes: int = 1 << 30
    reps: int = 5
    lmcache: bool = True  # include the LMCache peers when their environment is there
    workdir: str | None = None
    seed: int = 0


@dataclass(slots=True)
class MethodResult:
    """One method's samples at one block size."""

    method: Method
    block_nbytes: int
    nblocks: int
    seconds: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    found: int | None = None  # blocks a fresh process found after the write

    def spread(self, phase: str) -> Spread | None:
        s = self.seconds[phase]
        return spread_gbs(self.block_nbytes * self.nblocks, s) if s else None

    @property
    def survives(self) -> str:
        return "-" if self.found is None else f"{self.found}/{self.nblocks}"


@dataclass(slots=True)
class SizeResults:
    block_nbytes: int
    results: list[MethodResult]
    skipped: list[str]
    cold_how: str = ""

    def get(self, name: str) -> MethodResult | None:
        return next((r for r in self.results if r.method.name == name), None)


def block_nbytes(block_tokens: int) -> int:
    return 32 * 2 * block_tokens * 8 * 128 * 2  # layers x K/V x tokens x heads x dim x bf16


# -- measuring ---------------------------------------------------------------------------------

def _start_zygotes(plan: DiskPlan, nb: int, n: int, base: str) -> tuple[dict, list[str]]:
    zygotes: dict[bool, Zygote] = {False: Zygote(sys.executable, nb, n, plan.seed, lmcache=False,
                                                 log_path=os.path.join(base, "worker.log"))}
    skipped: list[str] = []
    if plan.lmcache:
        py, why = lmcache_python()
        if py is None:
            skipped.append(f"LMCache peers: {why}")
        else:
            try:
                zygotes[True] = Zygote(py, nb, n, plan.seed, lmcache=True,
                                       log_path=os.path.join(base, "lmcache.log"))
            except WorkerError as e:
                skipped.append(f"LMCache peers: {e}")
    return zygotes, skipped


def _one_phase(phase: str, order: Sequence[MethodResult], zygotes: dict, dirs: dict,
               tokens: int) -> str:
    how = ""
    for r in order:
        m, z, d = r.method, zygotes[r.method.lmcache], dirs[r.method.name]
        if phase == "put":
            os.sync()  # the last method's unsynced writes are not this one's to wait for
            res = z.run(m.write_op, dir=d, block_tokens=tokens, die=m.kill_writer)
            r.seconds["put"].append(res["seconds"])
            if m.read_op is None:  # it read in its own process (LMCache's LocalDisk)
                _check(m, res["cold_ok"], r.nblocks, res["cold_ok"])
                _check(m, res["warm_ok"], r.nblocks, res["warm_ok"])
                r.seconds["cold"].append(res["cold_seconds"])
                r.seconds["cached"].append(res["warm_seconds"])
            continue
        if m.read_op is None:
            continue
        if phase == "cold":
            how = drop_cache(d)
        else:
            load_cache(d)
        res = z.run(m.read_op, dir=d, block_tokens=tokens)
        found = res.get("blocks_found", r.nblocks)
        _check(m, res["blocks_ok"], r.nblocks, found)
        r.seconds[phase].append(res["seconds"])
        if m.name != RAW:
            r.found = found if r.found is None else min(r.found, found)
    return how


def _check(m: Method, ok: int, n: int, found: int) -> None:
    """Bytes a method says it read must be the bytes written: anything else is a bug of the
    method (or of this benchmark), never a figure."""
    if ok < min(found, n):
        raise AssertionError(f"{m.name}: {found} blocks found but only {ok} hold the bytes "
                             "that were written")


def measure_size(plan: DiskPlan, tokens: int, base: str,
                 progress: Callable[[str], None] | None = None) -> SizeResults:
    """Every method at one block size: ``plan.reps`` interleaved repetitions."""
    nb = block_nbytes(tokens)
    n = max(1, plan.total_bytes // nb)
    zygotes, skipped = _start_zygotes(plan, nb, n, base)
    try:
        results = [MethodResult(m, nb, n) for m in METHODS if m.lmcache in zygotes]
        how = ""
        for rep in range(plan.reps):
            k = rep % len(results)
            order = results[k:] + results[:k]
            dirs = {r.method.name: os.path.join(base, f"{nb // _MiB}m-{rep}-{i}")
                    for i, r in enumerate(results)}
            for phase in PHASES:
                how = _one_phase(phase, order, zygotes, dirs, tokens) or how
                if progress is not None:
                    progress(f"{nb // _MiB} MiB blocks: repetition {rep + 1}/{plan.reps}, {phase}")
            for r in results:
                if r.method.survive_op is not None and r.found is None:
                    res = zygotes[r.method.lmcache].run(r.method.survive_op,
                                                        dir=dirs[r.method.name],
                                                        block_tokens=tokens)
                    r.found = res["blocks_found"]
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
        return SizeResults(nb, results, skipped, how)
    finally:
        for z in zygotes.values():
            z.close()


def measure(plan: DiskPlan, progress: Callable[[str], None] | None = None) -> list[SizeResults]:
    base = tempfile.mkdtemp(prefix="kvstore-bench-disk-", dir=plan.workdir)
    try:
        return [measure_size(plan, t, base, progress) for t in plan.block_tokens]
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- rows and the table ------------------------------------------------------------------------

_FIGURES = (
    # (phase, figure, reference method, goal)
    ("put", "durable put (put + flush)", RAW, 0.9),
    ("put", "durable put (put + flush)", LOCAL_DISK, 1.0),
    ("cold", "cold fetch, fresh process", RAW, 0.95),
    ("cold", "cold fetch, fresh process", LOCAL_DISK, 1.0),
    ("cached", "page-cache fetch, fresh process (after restart)", RAW, 0.8),
    ("cached", "page-cache fetch, fresh process (after restart)", LOCAL_DISK, None),
    ("put", "durable put (put + flush)", FSL2, None),
    ("cold", "cold fetch, fresh process", FSL2, None),
    ("cached", "page-cache fetch, fresh process (after restart)", FSL2, None),
)


def size_rows(sr: SizeResults) -> list[BenchRow]:
    """BenchRows of one block size: kvstore's medians against each reference's."""
    ours = sr.get(KVSTORE)
    assert ours is not None
    rows = []
    total = ours.block_nbytes * ours.nblocks
    for phase, figure, ref_name, goal in _FIGURES:
        ref = sr.get(ref_name)
        a, b = ours.spread(phase), ref.spread(phase) if ref is not None else None
        if a is None or b is None or ref is None:
            continue
        note = (f"{ours.nblocks} x {sr.block_nbytes // _MiB} MiB, median of {a.n}; kvstore "
                f"{a.text()}, {ref_name} {b.text()} GB/s; survives restart: kvstore "
                f"{ours.survives}, {ref_name} {ref.survives}; {ref.method.note}")
        if phase == "cold":
            note += f"; cold: {sr.cold_how}"
        rows.append(throughput_row(
            SECTION, f"{figure}, {sr.block_nbytes // _MiB} MiB blocks", total,
            total / (a.median * 1e9), ref_name, total / (b.median * 1e9), goal=goal, note=note))
    return rows


def markdown_table(sizes: Sequence[SizeResults]) -> str:
    """The table of docs/benchmarks.md (GB/s, medians [min-max])."""
    lines = ["| block | method | durable put | cold read | page-cache read | survives restart |",
             "| --- | --- | --- | --- | --- | --- |"]
    for sr in sizes:
        for r in sr.results:
            cells = [(r.spread(p).text() if r.spread(p) else "-") for p in PHASES]  # type: ignore[union-attr]
            lines.append(f"| {sr.block_nbytes // _MiB} MiB | {r.method.name} | "
                         + " | ".join(cells) + f" | {r.survives} |")
    skipped = sorted({s for sr in sizes for s in sr.skipped})
    return "\n".join(lines + [f"\nskipped: {s}" for s in skipped])


# -- the index reopen ---------------------------------------------------------------------------

def reopen_row(nrec: int, workdir: str | None) -> BenchRow:
    """Reopen a store whose index holds ``nrec`` records, cold index pages, plus a first
    ``leading_run``."""
    import torch

    from kvstore.layout import KVLayout
    from kvstore.namespace import Namespace
    from kvstore.tiers.disk import DiskTier, populate_fake_index

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                      block_tokens=16)
    ns = Namespace.create("bench/disk", layout)
    base = tempfile.mkdtemp(prefix="kvstore-bench-reopen-", dir=workdir)
    try:
        big = os.path.join(base, "big")
        t0 = time.perf_counter()
        populate_fake_index(big, nrec, ns)
        build_s = time.perf_counter() - t0
        probe = DiskTier(big, capacity_bytes=1 << 50)
        some = [r.key for _, r in zip(range(16), probe.records(), strict=False)]
        probe.close()
        drop_cache(os.path.join(big, "index"))
        t0 = time.perf_counter()
        t = DiskTier(big, capacity_bytes=1 << 50)
        s = t.stats()
        got = t.leading_run(some)
        reopen_s = time.perf_counter() - t0
        t.close()
        assert s.blocks == nrec and got >= 1
        mdb = os.path.join(big, "index", "data.mdb")
        return time_row(
            SECTION, f"reopen with {nrec:,} records (cold index)", reopen_s, "goal 2 s", 2.0,
            unit="ms", goal=1.0,
            note=f"open + stats + first leading_run; index built in {build_s:.1f} s "
                 f"({os.path.getsize(mdb) / _MiB:.0f} MiB, {len(files_under(big))} files)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def plan_for(opts: BenchOptions) -> DiskPlan:
    if opts.quick:
        return DiskPlan(total_bytes=64 * _MiB, reps=1, workdir=opts.workdir)
    return DiskPlan(workdir=opts.workdir)


def run(opts: BenchOptions) -> list[BenchRow]:
    rows: list[BenchRow] = []
    for sr in measure(plan_for(opts)):
        rows.extend(size_rows(sr))
    rows.append(reopen_row(100_000 if opts.quick else 1_000_000, opts.workdir))
    return rows


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - a command line
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m kvstore.bench.disk", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total", type=int, default=1024, help="MiB written per method (1024)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (5)")
    p.add_argument("--block-mib", type=int, nargs="+", default=[2, 32], choices=[2, 32])
    p.add_argument("--no-lmcache", action="store_true", help="leave the LMCache peers out")
    p.add_argument("--workdir", default=None, help="where the files go (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the samples here")
    a = p.parse_args(argv)
    if a.total < 1 or a.reps < 1:
        p.error("--total and --reps must be at least 1")
    plan = DiskPlan(block_tokens=tuple(16 * (m // 2) for m in a.block_mib),
                    total_bytes=a.total * _MiB, reps=a.reps, lmcache=not a.no_lmcache,
                    workdir=a.workdir)
    sizes = measure(plan, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(markdown_table(sizes))
    print(f"\ncold reads: {sizes[0].cold_how}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"block_nbytes": sr.block_nbytes, "skipped": sr.skipped, "methods": [
                {"method": r.method.name, "nblocks": r.nblocks, "seconds": r.seconds,
                 "found": r.found} for r in sr.results]} for sr in sizes], f, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
