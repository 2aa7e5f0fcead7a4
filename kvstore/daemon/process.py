"""``kvstore serve`` as a child process (:class:`DaemonProcess`): started with this process's
kvstore (:mod:`kvstore.child`), waited for until its socket answers, stopped with
SIGTERM (SIGKILL when it does not exit in time). The ``daemon`` benchmark and the tests start
their daemons with it (``tests/support/daemon.py`` re-exports it); the daemon itself never
imports this module.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


class DaemonProcess:
    """``kvstore serve`` on ``socket_path``; ``start()`` waits until it answers. The child runs
    this process's kvstore, whatever the working directory holds (:mod:`kvstore.child`)."""

    def __init__(self, path: str | os.PathLike[str], socket_path: str | os.PathLike[str],
                 *args: str, log_path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path)
        self.socket_path = Path(socket_path)
        self.args = list(args)
        self.log_path = Path(log_path) if log_path else self.path.parent / f"{self.path.name}.serve.log"
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        from kvstore.child import kvstore_argv

        return kvstore_argv("serve", "--store", str(self.path), "--socket",
                            str(self.socket_path), *self.args)

    def start(self, timeout: float = 60.0) -> DaemonProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        from kvstore.child import env

        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore serve exited with {self.proc.returncode}:\n{self.log()}")
            if self.answers():
                return self
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"kvstore serve did not come up in {timeout} s:\n{self.log()}")

    def answers(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(1.0)
            s.connect(str(self.socket_path))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.returncode is not None and getattr(self, "_log", None):
                self._log.close()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (graceful) and wait; SIGKILL if it does not exit in time."""
        if self.proc is None:
            return 0
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.wait(10)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
