"""The processes the serve section starts and how it talks to them: each child in its own
process group (:class:`Group`), every group stopped whole at the end (:class:`Procs`), and the
HTTP to a running ``vllm serve`` (ready, a warm-up request, ``/metrics``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvstore.bench.serve_results import parse_metrics
from kvstore.bench.serve_scale import BLOCK


def free_port() -> int:
    """A loopback TCP port nobody listens on now (the kernel's pick), for a ``vllm serve``.
    Not the remote tier's helper: that package needs redis-py, which the vLLM environment
    does not have."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """A child in its own process group (``start_new_session``), output to ``log``;
    :meth:`stop` ends the whole group: SIGTERM, then SIGKILL after ``grace`` seconds."""

    def __init__(self, cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.cmd = list(cmd)
        self.log_path = log
        self._log: TextIO = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=dict(env) if env else None,
                                     cwd=cwd, start_new_session=True)
        self.pgid = self.proc.pid  # start_new_session: the child leads its own group

    def alive(self) -> bool:
        return self.proc.poll() is None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def tail(self, n: int = 6000) -> str:
        """The end of the log (vLLM's route listing left out), and the first error's lines
        when they are further up (an engine core's root cause comes before the front end's
        traceback)."""
        try:
            text = self.log_path.read_bytes()[-400_000:].decode(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if "Route: " not in ln]
        end = "\n".join(lines)[-n:]
        first = next((i for i, ln in enumerate(lines) if "Error" in ln or "Traceback" in ln), None)
        if first is not None and lines[first] not in end:
            return "\n".join(lines[max(0, first - 5): first + 25])[:n] + "\n[...]\n" + end
        return end

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, grace: float = 30.0) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.group_alive():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.2)
            time.sleep(0.05)
        if self.group_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        # children that left the group's leader behind are reaped by init; wait until the
        # group is empty so the next engine gets the cores and the port
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.group_alive():
            time.sleep(0.05)
        if not self._log.closed:
            self._log.close()


class Procs:
    """Every group this section started; :meth:`stop_all` in a ``finally``."""

    def __init__(self) -> None:
        self.groups: list[Group] = []

    def start(self, cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Group:
        g = Group(cmd, log, env)
        self.groups.append(g)
        return g

    def stop(self, g: Group) -> None:
        g.stop()
        if g in self.groups:
            self.groups.remove(g)

    def stop_all(self) -> None:
        while self.groups:
            self.groups.pop().stop(grace=15.0)


def _http(url: str, body: Mapping[str, Any] | None = None, timeout: float = 10.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}
                                 if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # loopback only
        return resp.read()


def wait_ready(g: Group, port: int, timeout: float) -> float:
    """Seconds until ``vllm serve`` on ``port`` answers ``/v1/models``; raises with the end of
    its log when it exits or does not come up in ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not g.alive():
            raise RuntimeError(f"vllm serve exited with {g.proc.returncode} before answering:"
                               f"\n{g.tail()}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            _http(f"http://127.0.0.1:{port}/v1/models", timeout=2.0)
            return time.monotonic() - t0
        time.sleep(1.0)
    raise TimeoutError(f"vllm serve on port {port} did not answer in {timeout:.0f} s:\n{g.tail()}")


def warm_up(port: int, model: str, vocab: int, seed: int) -> None:
    """One short request of fresh tokens (first-request costs out of the measurement)."""
    import random

    rnd = random.Random(seed)
    ids = [rnd.randrange(2, vocab) for _ in range(2 * BLOCK + 5)]
    _http(f"http://127.0.0.1:{port}/v1/completions",
          {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0}, timeout=300.0)


def metrics(port: int) -> dict[str, float]:
    return parse_metrics(_http(f"http://127.0.0.1:{port}/metrics").decode())
