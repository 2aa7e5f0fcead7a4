"""Real Redis processes on 127.0.0.1 for the remote tier's tests and benchmark.

``RedisProcess`` starts ``redis-server`` on a free loopback port (no persistence, foreground,
its own working directory) and stops it; ``start_cluster`` makes an N-master cluster with
``redis-cli --cluster create``; ``SilentServer`` is a listening socket that accepts and never
answers (a hung Redis). Nothing here is used by the store itself.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
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


def make_tls_files(directory: str) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (``openssl`` CLI). Returns
    ``(ca_cert, server_cert, server_key)`` paths."""
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("openssl is not installed")
    ca_key, ca = os.path.join(directory, "ca.key"), os.path.join(directory, "ca.pem")
    key, csr = os.path.join(directory, "server.key"), os.path.join(directory, "server.csr")
    cert, ext = os.path.join(directory, "server.pem"), os.path.join(directory, "san.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run([exe, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
        "-days", "1", "-subj", "/CN=kvstore-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", cert, "-days", "1", "-extfile", ext)
    return ca, cert, key


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


class RedisClusterProcesses:
    """``n`` masters with cluster mode on, slots assigned, no replicas."""

    def __init__(self, n: int = 3) -> None:
        self.workdir = tempfile.mkdtemp(prefix="kvstore-redis-cluster-")
        self.nodes: list[RedisProcess] = []
        self.n = n

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(p.address for p in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterProcesses:
        try:
            for _ in range(self.n):
                self.nodes.append(RedisProcess(workdir=self.workdir, cluster=True).start())
            exe = redis_cli_path()
            if exe is None:
                raise RuntimeError("redis-cli is not installed")
            subprocess.run([exe, "--cluster", "create", *(p.address for p in self.nodes),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           capture_output=True, timeout=timeout, check=True)
            t_end = time.monotonic() + timeout
            while True:
                if all("cluster_state:ok" in p.cli("CLUSTER", "INFO") and
                       "cluster_slots_assigned:16384" in p.cli("CLUSTER", "INFO")
                       for p in self.nodes):
                    break
                if time.monotonic() > t_end:
                    raise RuntimeError("the redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.cleanup()
            raise
        return self

    def node_of(self, redis_key: bytes) -> RedisProcess:
        """The master holding ``redis_key`` (asked of the cluster itself)."""
        slot = int(self.nodes[0].cli("CLUSTER", "KEYSLOT", redis_key.decode()).strip())
        for line in self.nodes[0].cli("CLUSTER", "NODES").splitlines():
            parts = line.split()
            addr = parts[1].split("@")[0]
            for rng in parts[8:]:
                if rng.startswith("["):
                    continue
                lo, _, hi = rng.partition("-")
                if int(lo) <= slot <= int(hi or lo):
                    return next(p for p in self.nodes if p.address == addr)
        raise RuntimeError(f"no node holds slot {slot}")

    def cleanup(self) -> None:
        for p in self.nodes:
            p.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisClusterProcesses:
        return self.start() if not self.nodes else self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class SilentServer:
    """Listens on a free loopback port, accepts every connection and never answers — what a
    hung Redis looks like from the client. ``close()`` drops everything."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent-redis", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def _accept(self) -> None:
        self.sock.settimeout(0.05)
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(c)  # held open, never read, never answered

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
