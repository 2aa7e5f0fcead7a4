"""The sidecar daemon: an asyncio server on a Unix socket that alone owns the stores.

``Daemon.start()`` removes leftovers of a killed daemon, creates the private shared-memory
directory and the socket, and starts accepting. ``request_stop()`` (SIGTERM/SIGINT) begins a
graceful shutdown: stop accepting, let in-flight requests finish (idle connections are closed
at once), give back every connection's leases and granted puts, flush and close the stores,
remove the socket and the shared-memory files.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.connection import Connection
from kvstore.daemon.events import DaemonEvents
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.namespaces import NamespaceRegistry
from kvstore.daemon.preflight import check_config
from kvstore.daemon.security import (
    PeerPolicy,
    bind_unix_socket,
    make_shm_dir,
    peer_credentials,
    remove_path,
    remove_stale_shm,
)
from kvstore.lockfile import DaemonLock
from kvstore.sizes import format_size
from kvstore.store.lifetime import close_stores
from kvstore.wire.protocol import PROTOCOL_VERSION

log = logging.getLogger("kvstore.daemon")


#: the part of --shutdown-timeout kept for closing the stores (at most this many seconds, and at
#: most a quarter of it): requests in flight cannot use it up, so the flush that makes the
#: committed puts durable (and lets the next daemon vouch for them) always gets a chance
CLOSE_SHARE_S = 2.0


#: seconds the worker threads get to end after the stores closed, even past the deadline
WORKERS_GRACE_S = 0.5


def close_share(shutdown_timeout: float) -> float:
    """Seconds of ``shutdown_timeout`` kept for closing the stores."""
    return min(CLOSE_SHARE_S, shutdown_timeout / 4)


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        from kvstore import __version__

        self.config = config
        self.policy = PeerPolicy(config.allow_uids)
        self.server_name = f"kvstore {__version__} protocol {PROTOCOL_VERSION} pid {os.getpid()}"
        # told to every client in its hello reply: a client that reconnects to another
        # instance knows that puts it did not flush may be gone (Client.flush)
        self.instance = os.urandom(16)
        self.flushed_instances: tuple[bytes, ...] = ()
        self._lock: DaemonLock | None = None
        self.connections: set[Connection] = set()
        self.stopping = False
        self.workers_stuck = False  # set by shutdown: a worker thread never returned
        self.metrics_port: int | None = None
        self._executor = ThreadPoolExecutor(config.workers, thread_name_prefix="kvstore-serve")
        self._server: asyncio.base_events.Server | None = None
        self._stopped = asyncio.Event()
        self._shm_dir: Path | None = None
        self._metrics_task: asyncio.Task | None = None
        self.events: DaemonEvents | None = None
        self.registry: NamespaceRegistry
        self.metrics: DaemonMetrics

    async def run_blocking(self, fn, *args):
        """Run ``fn(*args)`` on the daemon's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    # -- start -------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        check_config(cfg)  # every path, before the lock and the socket: errors that name them
        # one daemon per store path: a second one would keep a warm tier of its own that
        # admin deletions and the first daemon's clients never see
        self._lock = DaemonLock.acquire(cfg.path, os.path.abspath(cfg.socket_path),
                                        self.instance.hex())
        self.flushed_instances = tuple(bytes.fromhex(x) for x in self._lock.record.flushed)
        try:
            for p in remove_stale_shm(cfg.shm_base):
                log.info("removed %s, left behind by a daemon that died", p)
            self._shm_dir = make_shm_dir(cfg.shm_base)
        except BaseException:
            self._lock.release(clean=False)
            raise
        try:
            if cfg.kv_events is not None:
                self.events = DaemonEvents(cfg.kv_events)
                if cfg.disk_capacity:  # before any client can change the disk
                    await self.run_blocking(self.events.announce_disk, cfg.path)
            self.registry = NamespaceRegistry(cfg, self._shm_dir, self.run_blocking, self.events)
            self.metrics = DaemonMetrics(
                self.registry.snapshot,
                self.events.publisher.stats if self.events is not None else None)
            # metrics first: once the socket answers, everything the daemon serves is up
            if cfg.metrics_port is not None:
                self.metrics_port = self.metrics.start_http(cfg.metrics_port)
                log.info("metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
            if cfg.metrics_path is not None:
                self._metrics_task = asyncio.create_task(self._write_metrics_forever())
            sock = bind_unix_socket(cfg.socket_path)
            self._server = await asyncio.start_unix_server(
                self._accept, sock=sock, limit=64 << 10)
        except BaseException:
            metrics = getattr(self, "metrics", None)  # unset if the registry failed
            if metrics is not None:
                metrics.stop_http()
            if self._metrics_task is not None:
                self._metrics_task.cancel()
            if self.events is not None:
                self.events.close()
            remove_path(self._shm_dir)
            self._lock.release(clean=False)
            raise
        log.info("serving %s on %s (store %s, warm tier %s per namespace, disk tier %s)",
                 self.server_name, cfg.socket_path, cfg.path, format_size(cfg.cpu_capacity),
                 format_size(cfg.disk_capacity) if cfg.disk_capacity else "off")

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            cred = peer_credentials(sock)
        except OSError:
            writer.close()
            return
        if self.stopping:
            writer.close()
            return
        conn = Connection(self, reader, writer, cred)
        conn.task = asyncio.current_task()
        self.connections.add(conn)
        self.metrics.connections.inc()
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)
            self.metrics.connections.dec()

    async def _write_metrics_forever(self) -> None:
        path = self.config.metrics_path
        assert path is not None
        while True:
            try:
                await self.run_blocking(self.metrics.write_file, path)
            except Exception:
                log.exception("writing metrics to %s failed", path)
            await asyncio.sleep(self.config.metrics_interval)

    # -- stop --------------------------------------------------------------------------------
    def request_stop(self) -> None:
        if not self.stopping:
            log.info("shutting down: no new connections; finishing in-flight requests")
        self.stopping = True
        self._stopped.set()

    async def serve_until_stopped(self) -> None:
        await self._stopped.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Stop within ``--shutdown-timeout`` in all (operators fit it to a supervisor's grace
        period, e.g. Kubernetes' terminationGracePeriodSeconds, past which SIGKILL comes):
        requests in flight get it less :func:`close_share`, closing the stores what is left."""
        deadline = time.monotonic() + self.config.shutdown_timeout
        requests_until = deadline - close_share(self.config.shutdown_timeout)
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle and conn.task is not None:
                conn.task.cancel()  # waiting for a request: nothing in flight
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=_left(requests_until))
            for t in pending:
                t.cancel()
            if pending:
                log.warning("%d connections did not finish in time; closing them", len(pending))
                # a moment for their cleanup (leases given back) even when the time is up
                await asyncio.wait(pending, timeout=max(0.1, _left(requests_until)))
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._metrics_task
        clean = await self._close_stores(deadline)
        if self.events is not None:
            await _own_thread(self.events.close)
        if self.config.metrics_path is not None:
            with contextlib.suppress(Exception):
                self.metrics.write_file(self.config.metrics_path)
        self.metrics.stop_http()
        remove_path(self.config.socket_path)
        if self._shm_dir is not None:
            remove_path(self._shm_dir)
        self.workers_stuck = not await self._stop_workers(deadline)
        if self._lock is not None:
            # every committed put is on disk only if there is a disk and every store closed
            self._lock.release(clean=clean and not self.workers_stuck
                               and bool(self.config.disk_capacity))
        log.info("stopped")

    async def _stop_workers(self, deadline: float) -> bool:
        """Wait for the worker threads to end, until ``deadline`` (at least
        :data:`WORKERS_GRACE_S` more); False where one is still in a blocking call (a read
        from a disk or mount that does not answer): waiting for it would hold the process
        past ``--shutdown-timeout`` for ever, so :func:`run_daemon` exits without it."""
        done = threading.Event()

        def stop() -> None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            done.set()

        threading.Thread(target=stop, name="kvstore-serve-stop", daemon=True).start()
        end = max(deadline, time.monotonic() + WORKERS_GRACE_S)
        while not done.is_set() and time.monotonic() < end:
            await asyncio.sleep(0.02)
        if done.is_set():
            return True
        log.error("a worker thread is still in a blocking call past --shutdown-timeout %s s "
                  "(a disk or mount that does not answer?); exiting without it",
                  self.config.shutdown_timeout)
        return False

    async def _close_stores(self, deadline: float) -> bool:
        """Flush and close every namespace's store, side by side, by ``deadline`` (what is
        left of ``--shutdown-timeout``): a store whose writer waits for another process's
        lock on the index (an engine stopped mid-commit) is logged and left, never waited
        for. False when one did not close (the next daemon then does not vouch for our
        puts)."""
        stores = [e.store for e in self.registry.entries()]
        if not await _own_thread(close_stores, stores, _left(deadline)):
            log.error("%s store(s) were not closed cleanly within --shutdown-timeout %s s; "
                      "puts not flushed before may be lost (raise --shutdown-timeout if "
                      "flushing just takes longer)", len(stores), self.config.shutdown_timeout)
            return False
        return await self.registry.close_all()  # closed already: events, bookkeeping


async def _own_thread(fn, *args):
    """``fn(*args)`` on a (daemon) thread of its own: shutdown's closing never queues behind
    pool workers stuck in a blocking call, which would hold it past every deadline."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as e:  # handed to the awaiting coroutine
            value, ok = e, False
        loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=run, name="kvstore-serve-close", daemon=True).start()
    return await fut


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0."""
    return max(0.0, deadline - time.monotonic())


async def _main(config: DaemonConfig, started: list[Daemon]) -> None:
    daemon = Daemon(config)
    started.append(daemon)
    await daemon.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    try:
        await daemon.serve_until_stopped()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run_daemon(config: DaemonConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit status (0 after a clean stop)."""
    started: list[Daemon] = []
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_main(config, started))
    if started and started[0].workers_stuck:
        # the interpreter's exit joins every worker thread: one stuck in a blocking call
        # would keep the process alive past the supervisor's grace period, to its SIGKILL
        logging.shutdown()
        os._exit(1)
    return 0


def _loop_factory():  # a loop class, or None for asyncio's default
    """uvloop's event loop where it is installed: it halves a small request's round trip
    (docs/benchmarks.md); ``KVSTORE_LOOP=asyncio`` keeps the standard one."""
    if os.environ.get("KVSTORE_LOOP", "").lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
