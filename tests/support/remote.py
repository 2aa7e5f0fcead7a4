"""Real Redis processes on 127.0.0.1 for the remote tier's tests.

``RedisProcess`` (one ``redis-server`` on a free loopback port, no persistence) and the port
helpers live in the package, beside the remote tier they serve
(:mod:`kvstore.tiers.remote.local_server`; the ``remote`` benchmark uses them too), and are
re-exported here. Test-only: ``make_tls_files`` (a
throwaway CA and server certificate), ``RedisClusterProcesses`` (an N-master cluster made with
``redis-cli --cluster create``) and ``SilentServer`` (a listening socket that accepts and never
answers: a hung Redis).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

from kvstore.tiers.remote.local_server import (
    HOST,
    RedisProcess,
    free_port,
    redis_cli_path,
    redis_server_path,
)

__all__ = [
    "HOST", "RedisClusterProcesses", "RedisProcess", "SilentServer", "free_port",
    "make_tls_files", "redis_cli_path", "redis_server_path",
]


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
