"""One client connection: peer check, ``hello``, then requests answered in order.

A connection's requests are handled one at a time, in arrival order, so a request sees the
effects of every earlier one on the same connection (a ``release`` sent without waiting for
its reply has taken effect before the next ``fetch``). Connections run concurrently.
Whatever the connection holds is given back when it ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

from kvstore.daemon.handlers import ADMIN_HANDLERS, HANDLERS
from kvstore.daemon.leases import Holdings
from kvstore.daemon.security import PeerCredentials, is_disconnect
from kvstore.errors import KVStoreError, StoreClosedError
from kvstore.ratelog import Every
from kvstore.wire import messages as m
from kvstore.wire.codec import CodecError, CodecLimits, pack, unpack
from kvstore.wire.errors import BadRequest, ErrorCode
from kvstore.wire.framing import FrameError, FrameTooLarge, encode_frame, read_frame
from kvstore.wire.protocol import PROTOCOL_VERSION, check_version, derive_namespace

if TYPE_CHECKING:
    from kvstore.daemon.daemon import Daemon
    from kvstore.daemon.namespaces import NamespaceEntry

log = logging.getLogger("kvstore.daemon")

#: how long a refused connection is kept open for the peer's hello to arrive
_LINGER_S = 1.0
#: unexpected failures of requests: a fault that hits every request (a disk answering EIO)
#: would write a traceback per request, thousands a second, until the log filled its disk
_FAILURES = Every(60.0)


def log_failure(what: str, op: str, e: BaseException) -> None:
    """Log an unexpected failure of ``what`` ``op`` with its traceback: the first of each
    kind (``what``, ``op``, exception type), then at most one line a minute per kind, which
    says how many there were (the replies and ``kvstore_errors{code="internal"}`` count each)."""
    n = _FAILURES.tally(key=(what, op, type(e).__name__))
    if n:
        log.error("%s %s failed (%d such failure(s) since the last such line)", what, op, n,
                  exc_info=e)


class _Close(Exception):
    """End this connection after the error reply has been sent."""


class Connection:
    def __init__(self, daemon: Daemon, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, cred: PeerCredentials) -> None:
        self.daemon = daemon
        self.reader = reader
        self.writer = writer
        self.cred = cred
        self.limits = daemon.config.limits
        self.metrics = daemon.metrics
        self.run = daemon.run_blocking
        self.codec = CodecLimits.for_frames(self.limits.max_frame, self.limits.max_keys)
        self.holdings = Holdings(self.limits.max_leases, self.limits.max_pins)
        self.entry: NamespaceEntry | None = None
        self.idle = True  # waiting for a frame: shutdown may cancel us right away
        self.task: asyncio.Task | None = None

    # -- accessors used by the handlers ---------------------------------------------------------
    @property
    def store(self):
        assert self.entry is not None
        return self.entry.store

    @property
    def block_nbytes(self) -> int:
        assert self.entry is not None
        return self.entry.namespace.layout.block_nbytes

    def server_stats(self, free_slots: int) -> m.ServerStats:
        assert self.entry is not None
        conns = [c for c in self.entry.connections if isinstance(c, Connection)]
        return m.ServerStats(
            connections=len(self.daemon.connections), namespaces=len(self.daemon.registry),
            requests=self.metrics.total_requests, errors=self.metrics.total_errors,
            leases=sum(len(c.holdings.leases) for c in conns),
            leased_blocks=sum(c.holdings.leased_blocks for c in conns),
            grants=sum(len(c.holdings.grants) for c in conns),
            granted_blocks=sum(c.holdings.granted_blocks for c in conns),
            pinned_blocks=sum(c.holdings.pinned for c in conns),
            warm_slots=self.entry.slots, free_warm_slots=free_slots,
        )

    # -- I/O ---------------------------------------------------------------------------------
    async def _send(self, obj: list) -> None:
        self.writer.write(encode_frame(pack(obj)))
        await self.writer.drain()

    async def _send_error(self, rid: int, code: int, message: str) -> None:
        self.metrics.error(code)
        try:
            await self._send(m.encode_error(rid, code, message))
        except Exception as e:  # the peer is gone; nothing to tell it
            log.debug("could not send error reply: %s", e)

    async def _read(self, timeout: float | None = None) -> bytes | None:
        self.idle = True
        try:
            coro = read_frame(self.reader, self.limits.max_frame, self.limits.frame_timeout)
            return await (asyncio.wait_for(coro, timeout) if timeout else coro)
        finally:
            self.idle = False

    # -- lifecycle ---------------------------------------------------------------------------
    async def serve(self) -> None:
        try:
            if not self.daemon.policy.allows(self.cred):
                self.metrics.refused.labels("uid").inc()
                line = self.daemon.policy.refusal_to_log(self.cred)
                if line is not None:
                    log.warning("%s", line)
                await self._refuse(ErrorCode.NOT_ALLOWED, self.daemon.policy.refusal(self.cred))
                return
            if len(self.daemon.connections) > self.limits.max_connections:
                self.metrics.refused.labels("connections").inc()
                await self._refuse(ErrorCode.LIMIT, "the daemon has too many connections "
                                   "(--max-connections); try again later")
                return
            if not await self._hello():
                return
            while not self.daemon.stopping:
                body = await self._read()
                if body is None:
                    return
                await self._answer(body)
        except FrameTooLarge as e:
            self.metrics.refused.labels("frame").inc()
            await self._send_error(0, ErrorCode.FRAME_TOO_LARGE,
                                   f"{e}; the connection is closed (--max-frame)")
        except (_Close, FrameError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:
            pass  # shutdown while idle
        except Exception as e:
            if not is_disconnect(e):
                log.exception("connection from pid %d failed", self.cred.pid)
        finally:
            await self._cleanup()

    async def _refuse(self, code: int, message: str) -> None:
        """Send a refusal (request id 0), then read what the peer sends until it hangs up (at
        most its hello and one second) before closing: closing first would fail the client's
        hello with EPIPE, and it would never read why it was refused."""
        await self._send_error(0, code, message)
        with contextlib.suppress(Exception):  # the peer is gone or slow: close anyway
            async with asyncio.timeout(_LINGER_S):
                await read_frame(self.reader, self.limits.max_frame, _LINGER_S)

    async def _hello(self) -> bool:
        body = await self._read(self.limits.hello_timeout)
        if body is None:
            return False
        t0 = time.perf_counter()
        rid, op, args = 0, "", None
        try:
            rid, op, args = m.decode_envelope(unpack(body, self.codec))
            if op in m.ADMIN_OPS:
                pass  # served below, outside this hello's error handling
            elif op != m.Hello.OP:
                raise BadRequest(f"the first request must be hello, got {op[:40]!r}",
                                 ErrorCode.HELLO_REQUIRED)
            else:
                check_version(args)
                hello = m.Hello.from_wire(args)
                ns = derive_namespace(hello, self.cred.uid,
                                      force_per_uid=self.daemon.config.salt_policy == "per-uid")
                if self.daemon.stopping:
                    raise BadRequest("the daemon is shutting down", ErrorCode.SHUTTING_DOWN)
                self.entry = await self.daemon.registry.acquire(ns, hello.warm_capacity, self)
        except CodecError as e:
            await self._send_error(0, ErrorCode.BAD_FRAME, str(e))
            return False
        except BadRequest as e:
            if e.code == ErrorCode.VERSION_MISMATCH:
                self.metrics.refused.labels("version").inc()
            await self._send_error(rid, e.code, e.message)
            return False
        except Exception as e:
            log.exception("hello from pid %d failed", self.cred.pid)
            await self._send_error(rid, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            return False
        if op in m.ADMIN_OPS:
            await self._admin(rid, op, args)
            return False
        e = self.entry
        log.info("hello from pid %d uid %d (%s): namespace %s", self.cred.pid, self.cred.uid,
                 hello.client or "-", e.label)
        await self._send(m.encode_reply(rid, m.HelloReply(
            PROTOCOL_VERSION, ns.id, str(e.shm_path), e.slots, ns.layout.block_nbytes,
            self.limits.max_frame, self.limits.max_keys, self.limits.max_leases,
            self.daemon.server_name, self.daemon.instance, self.daemon.flushed_instances,
            e.new_note)))
        e.new_note = ""  # the first client is told; later ones find what it stored
        self.metrics.observe("hello", time.perf_counter() - t0)
        return True

    async def _admin(self, rid: int, op: str, args: object) -> None:
        """An admin connection: admin ops (and ``ping``) until the peer hangs up. They reach
        every namespace, so only the daemon's own uid and root may send them."""
        if self.cred.uid not in (os.getuid(), 0):
            self.metrics.refused.labels("uid").inc()
            log.warning("refused %s from pid %d uid %d: admin ops are for uid %d or root",
                        op[:40], self.cred.pid, self.cred.uid, os.getuid())
            await self._send_error(rid, ErrorCode.NOT_ALLOWED, (
                f"{op} is an admin operation: only uid {os.getuid()} (the daemon's) or root "
                f"may send it, not uid {self.cred.uid}; run the admin command as that user"))
            return
        while True:
            t0 = time.perf_counter()
            try:
                if op not in m.ADMIN_OPS and op != m.Ping.OP:
                    raise BadRequest(f"an admin connection takes {', '.join(sorted(m.ADMIN_OPS))} "
                                     "and ping only; open another connection and say hello",
                                     ErrorCode.HELLO_REQUIRED)
                req = m.parse_request(op, args)
                reply = await ADMIN_HANDLERS[type(req)](self, req)
            except BadRequest as e:
                await self._send_error(rid, e.code, e.message)
                if e.code in (*m.FATAL_CODES, ErrorCode.HELLO_REQUIRED):
                    return
            except KVStoreError as e:
                await self._send_error(rid, ErrorCode.BAD_REQUEST, str(e))
            except Exception as e:
                log_failure("admin request", op[:40], e)
                await self._send_error(rid, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            else:
                await self._send(m.encode_reply(rid, reply))
                self.metrics.observe(op, time.perf_counter() - t0)
            if self.daemon.stopping:
                return
            body = await self._read()
            if body is None:
                return
            try:
                rid, op, args = m.decode_envelope(unpack(body, self.codec))
            except CodecError as e:
                await self._send_error(0, ErrorCode.BAD_FRAME, str(e))
                return
            except BadRequest as e:
                await self._send_error(0, e.code, e.message)
                return

    async def _answer(self, body: bytes) -> None:
        t0 = time.perf_counter()
        rid, op = 0, "?"
        try:
            rid, op, args = m.decode_envelope(unpack(body, self.codec))
            if op in m.ADMIN_OPS:
                raise BadRequest(f"{op} is an admin operation: send it on a connection of its "
                                 "own, instead of hello")
            req = m.parse_request(op, args)
            reply = await HANDLERS[type(req)](self, req)
        except CodecError as e:
            await self._send_error(0, ErrorCode.BAD_FRAME, str(e))
            return
        except BadRequest as e:
            await self._send_error(rid, e.code, e.message)
            if e.code in m.FATAL_CODES:
                raise _Close from None
            return
        except StoreClosedError:
            await self._send_error(rid, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
            raise _Close from None
        except KVStoreError as e:  # the store refused the arguments
            await self._send_error(rid, ErrorCode.BAD_REQUEST, str(e))
            return
        except Exception as e:
            log_failure("request", op[:40], e)
            await self._send_error(rid, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
            return
        if op not in m.SILENT_OPS:
            await self._send(m.encode_reply(rid, reply))
        self.metrics.observe(op, time.perf_counter() - t0)

    async def _cleanup(self) -> None:
        entry, self.entry = self.entry, None
        if entry is not None:
            h = self.holdings
            if h.leases or h.grants or h.pins:
                aborted = h.granted_blocks
                try:
                    await self.run(h.release_all, entry.store)
                except Exception:
                    log.exception("giving back a connection's leases failed")
                self.metrics.aborted_blocks.inc(aborted)
            await self.daemon.registry.release(entry, self)
        self.writer.close()
        with contextlib.suppress(Exception):  # already gone
            await self.writer.wait_closed()
