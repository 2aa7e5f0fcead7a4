"""A local ``redis-server`` for the remote tier (:class:`RedisProcess`): one server on a free
127.0.0.1 port, no persistence, optionally TLS or cluster-enabled, waited for until it answers
PING; and the helpers around it (:func:`free_port`, where ``redis-server`` and ``redis-cli``
are). The ``remote`` benchmark and the tests start their Redis servers with it
(``tests/support/remote.py`` re-exports it); the remote tier itself never imports this module.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence

HOST = "127.0.0.1"


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def redis_cli_path() -> str | None:
    return shutil.which("redis-cli")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(*, with_bus: bool = False) -> int:
    """A loopback port nobody listens on (and ``port + 10000`` too, for a cluster bus)."""
    rnd = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rnd.randint(20000, 55000 if with_bus else 60000)
        if _port_free(port) and (not with_bus or _port_free(port + 10000)):
            return port
    raise RuntimeError("no free loopback port found")


def _ping(port: int, timeout: float = 0.2, *, tls: bool = False) -> bytes | None:
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as raw:
            s = raw
            if tls:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                s = ctx.wrap_socket(raw)
            s.sendall(b"PING\r\n")
            return s.recv(64)
    except OSError:
        return None


class RedisProcess:
    """One ``redis-server`` on 127.0.0.1:``port``; ``start()`` waits until it answers PING."""

    def __init__(self, port: int | None = None, *, workdir: str | None = None,
                 cluster: bool = False, args: Sequence[str] = (),
                 tls: tuple[str, str, str] | None = None) -> None:
        exe = redis_server_path()
        if exe is None:
            raise RuntimeError("redis-server is not installed (tools/ci_redis.sh installs it)")
        self.exe = exe
        self.cluster = cluster
        self.port = port if port is not None else free_port(with_bus=cluster)
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvstore-redis-")
        self.args = list(args)
        self.tls = tls  # (ca, cert, key): serve TLS only, on ``port``
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.tls:
            return f"rediss://{HOST}:{self.port}/0?ssl_ca_certs={self.tls[0]}"
        return f"redis://{HOST}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def command(self) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.tls:
            ca, cert, key = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert,
                     "--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
        cmd = [self.exe, *ports, "--bind", HOST, "--save", "",
               "--appendonly", "no", "--daemonize", "no", "--dir", self.workdir,
               "--logfile", os.path.join(self.workdir, f"redis-{self.port}.log")]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{self.port}.conf",
                    "--cluster-node-timeout", "5000",
                    "--cluster-require-full-coverage", "no"]
        return cmd + self.args

    def start(self, timeout: float = 10.0) -> RedisProcess:
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            r = _ping(self.port, tls=self.tls is not None)
            if r is not None and (r.startswith(b"+PONG") or b"LOADING" not in r):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.workdir, f"redis-{self.port}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the socket stays open and connections are accepted, nothing is answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        exe = redis_cli_path() or "redis-cli"
        out = subprocess.run([exe, "-h", HOST, "-p", str(self.port), *args], capture_output=True,
                             timeout=timeout, check=True)
        return out.stdout.decode(errors="replace")

    def __enter__(self) -> RedisProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
