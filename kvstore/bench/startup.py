"""CLI start-up: ``kvstore --help`` and ``kvstore ls`` on a 10,000-block store.

Each command runs as a fresh process through the installed ``kvstore`` entry point, from a
scratch working directory (never the source checkout). Its physical limit is a bare
interpreter (``python -c pass``); the peer is what the command would cost if it loaded torch
(``python -c "import torch"``). The commands and both references are interleaved, rep by rep,
and each figure is the median. ``python -X importtime`` of the same command is the evidence:
whether torch was imported, and the heaviest imports.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from kvstore.bench import BenchOptions, BenchRow, time_row

SECTION = "startup"
LS_BLOCKS = 10_000
_GOALS_S = {"--help": 0.3, "ls": 0.5}  # issue goals on a 2-core machine, absolute


def _entry() -> list[str]:
    exe = shutil.which("kvstore")
    return [exe] if exe else [sys.executable, "-c", "import sys; from kvstore.cli import main; "
                                                    "sys.exit(main())"]


def _make_store(path: str, blocks: int) -> None:
    """A disk store of ``blocks`` small blocks in 100-block chains (written once)."""
    import torch

    from kvstore import KVLayout, open_store

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
                   block_tokens=4)
    with open_store(path, layout=lay, model_id="bench/startup", device="cpu",
                    cpu_capacity="32MiB") as s:
        per = 100
        kv = torch.zeros(lay.batch_shape(per), dtype=lay.dtype)
        for c in range(blocks // per):
            keys = s.block_keys(list(range(c * 10_000, c * 10_000 + per * 4)))
            s.put(keys, kv).wait()
        s.flush()


def _wall(cmd: list[str], cwd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True, timeout=120)
    return time.perf_counter() - t0


def import_evidence(args: list[str], cwd: str) -> tuple[bool, list[tuple[str, float]]]:
    """(torch imported?, the three heaviest top-level imports in ms) of ``kvstore args``."""
    code = "import sys; from kvstore.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *args], cwd=cwd,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         timeout=120)
    torch_loaded = False
    top: list[tuple[str, float]] = []
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)", line)
        if not m:
            continue
        name = m.group(3)
        torch_loaded |= name == "torch"
        if len(m.group(2)) == 1:  # imported by the command itself, not by another module
            top.append((name, int(m.group(1)) / 1e3))
    top.sort(key=lambda x: -x[1])
    return torch_loaded, top[:3]


def run(opts: BenchOptions) -> list[BenchRow]:
    reps = 3 if opts.quick else 7
    blocks = 1_000 if opts.quick else LS_BLOCKS
    with tempfile.TemporaryDirectory(dir=opts.workdir) as tmp:
        store = os.path.join(tmp, "store")
        _make_store(store, blocks)
        kv = _entry()
        cmds = {
            "--help": [*kv, "--help"],
            "ls": [*kv, "ls", "--store", store],
            "pass": [sys.executable, "-c", "pass"],
            "torch": [sys.executable, "-c", "import torch"],
        }
        times: dict[str, list[float]] = {k: [] for k in cmds}
        names = list(cmds)
        for r in range(reps):  # interleaved, rotating order
            for k in names[r % len(names):] + names[: r % len(names)]:
                times[k].append(_wall(cmds[k], tmp))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows = []
        for what, args in (("--help", ["--help"]), ("ls", ["ls", "--store", store])):
            torch_loaded, top = import_evidence(args, tmp)
            heavy = ", ".join(f"{n} {ms:.0f} ms" for n, ms in top)
            label = (f"kvstore {what}" if what == "--help"
                     else f"kvstore ls ({blocks:,} blocks)")
            goal = _GOALS_S[what]
            note = (f"median of {reps}; goal < {goal} s ({'met' if med[what] < goal else 'missed'}); "
                    f"importtime: torch {'IMPORTED' if torch_loaded else 'not imported'}; "
                    f"heaviest: {heavy}")
            rows.append(time_row(SECTION, label, med[what], "bare interpreter (python -c pass)",
                                 med["pass"], unit="ms", note=note))
            rows.append(time_row(SECTION, f"{label} vs torch", med[what],
                                 'python -c "import torch"', med["torch"], unit="ms",
                                 note="> 1: the command costs less than loading torch alone"))
        return rows
