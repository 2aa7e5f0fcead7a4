"""The disk benchmark's plumbing: fork servers to run each operation in a fresh process,
page-cache control, and medians with their range.

Cold reads need the files out of the page cache. ``/proc/sys/vm/drop_caches`` needs a
privilege that containers usually lack (this build machine's root gets EACCES), so every file
of the method under test is fsynced (its dirty pages would not be dropped) and dropped with
``posix_fadvise(POSIX_FADV_DONTNEED)``; :func:`drop_cache` says which of the two it used.
"""

from __future__ import annotations

import json
import os
import selectors
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import kvstore

_WORKER = Path(__file__).with_name("disk_worker.py")
#: where LMCache's own virtual environment is looked for (its recipe: docs/benchmarks.md)
LMCACHE_VENV_ENV = "KVSTORE_BENCH_LMCACHE_PYTHON"
_READ_CHUNK = 8 << 20


class WorkerError(RuntimeError):
    """A benchmark worker failed or answered something unusable."""


def lmcache_python() -> tuple[str | None, str]:
    """The interpreter of LMCache's virtual environment, or None and why not."""
    env = os.environ.get(LMCACHE_VENV_ENV)
    if env:
        return (env, env) if os.access(env, os.X_OK) else (None, f"{LMCACHE_VENV_ENV}={env} "
                                                                "is not executable")
    root = Path(kvstore.__file__).resolve().parent.parent
    py = root / ".venv-lmcache" / "bin" / "python"
    if py.exists():
        return str(py), str(py)
    return None, (f"no LMCache environment ({py} is missing; make it with the recipe in "
                  f"docs/benchmarks.md or point {LMCACHE_VENV_ENV} at its python)")


class Zygote:
    """One fork server (:mod:`kvstore.bench.disk_worker`) holding the blocks in memory."""

    def __init__(self, python: str, nbytes: int, n: int, seed: int, *, lmcache: bool,
                 log_path: str, timeout_s: float = 900.0) -> None:
        root = str(Path(kvstore.__file__).resolve().parent.parent)
        env = dict(os.environ)
        if lmcache:  # LMCache's environment has no kvstore: nothing of ours on its path
            env.pop("PYTHONPATH", None)
        else:  # the checkout this module came from, wherever the interpreter starts
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        args = [python, str(_WORKER), str(nbytes), str(n), str(seed)]
        if lmcache:
            args.append("--lmcache")
        self.timeout_s = timeout_s
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=env, text=True, bufsize=1)
        hello = self._line()
        if not hello.get("ready"):
            self.close()
            raise WorkerError(hello.get("error") or f"worker not ready: {hello}")

    def _line(self) -> dict:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(self.timeout_s):
            self.close()
            raise WorkerError(f"benchmark worker silent for {self.timeout_s} s; see {self.log_path}")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"benchmark worker exited ({code}): {self.tail()}")
        return json.loads(line)

    def tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def run(self, op: str, **args: object) -> dict:
        """Run ``op`` in a fresh child; its result dict (raises WorkerError when it failed)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        res = self._line()
        if not res.get("ok"):
            raise WorkerError(f"{op} failed: {res.get('error')}; log: {self.log_path}")
        return res["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def files_under(d: str) -> list[str]:
    out = []
    for root, _dirs, names in os.walk(d):
        out.extend(os.path.join(root, n) for n in names)
    return out


def drop_cache(d: str) -> str:
    """Drop every file under ``d`` from the page cache; returns how it was done.

    First ``sync`` the whole system: the peers that never fsync (LMCache) leave a GiB of
    dirty pages whose writeback would otherwise run during whichever cold read comes next.
    (It did not remove the spread of kvstore's 2 MiB cold samples in runs with LMCache:
    docs/benchmarks.md.)"""
    os.sync()
    for p in files_under(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED) per file (drop_caches needs a privilege this host lacks)"


def load_cache(d: str) -> None:
    """Read every file under ``d`` once, so that its pages are in the page cache."""
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    for p in files_under(d):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


@dataclass(frozen=True, slots=True)
class Spread:
    """Median of a figure's samples with its range (GB/s)."""

    median: float
    low: float
    high: float
    n: int

    def text(self) -> str:
        if self.n == 1:
            return f"{self.median:.2f}"
        return f"{self.median:.2f} [{self.low:.2f}-{self.high:.2f}]"


def spread_gbs(nbytes: int, seconds: Sequence[float]) -> Spread:
    rates = [nbytes / s / 1e9 for s in seconds]
    return Spread(statistics.median(rates), min(rates), max(rates), len(rates))
