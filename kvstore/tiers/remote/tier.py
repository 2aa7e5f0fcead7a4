"""The remote shared tier: KV blocks in Redis (one server) or a Redis Cluster, shared by many
inference hosts (``docs/architecture.md`` "Tiers", ``docs/scale-out.md``).

A lower tier like the disk tier, with the same shapes: ``leading_run(keys)``,
``read_many(keys, dsts) -> list[ReadStatus]``, ``write_blocks(items)``, ``delete(keys)``,
``stats()``, ``close()``. One Redis string per block, ``key_prefix + key.hex()``, holding the
header + payload of :mod:`kvstore.tiers.remote_format` (zstd with byte-shuffle by default: the
network is the slow link).

Guarantees:

* Nothing here raises into the engine for Redis trouble. A slow, absent, hung or dead Redis
  is a miss plus a warning on ``logging.getLogger("kvstore.remote")``. Every lookup and read
  waits at most its budget (``budget_s``; reads add transfer time at ``min_read_rate``), then
  returns misses for whatever has not arrived; socket timeouts (= ``budget_s``) bound the
  worker threads too. After a failure the node is skipped for a short, growing interval
  (circuit breaker), then one call probes it.
* A value that is damaged or not what was asked (bad magic, truncated, other key or
  namespace, size or checksum mismatch, undecodable) is ``DAMAGED``, counted as ``corrupt``
  and deleted best-effort; the destination never reports ``OK`` with wrong bytes.
* A lookup is one round trip: one pipeline of ``EXISTS`` per node holding any of the keys,
  the pipelines in flight at once (cluster: the slowest master sets the latency). Reads and
  writes are pipelined the same way.
* Eviction is Redis's (``maxmemory`` + ``allkeys-lru``); TTLs (``ttl_s``) are set on write.

Invalid arguments (keys not 32 bytes, destinations not CPU uint8 1-D contiguous tensors) raise
``KeyFormatError`` / ``TensorMismatchError`` like the disk tier; a bad configuration raises
``ConfigError`` at construction. Construction does not contact Redis.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import redis
import torch

from kvstore.errors import ConfigError, StoreClosedError, TensorMismatchError
from kvstore.ratelog import Every
from kvstore.tiers.base import ReadStatus, as_byte_tensor, check_key
from kvstore.tiers.remote import format as fmt
from kvstore.tiers.remote.config import (
    ADMISSIONS,
    RemoteConfig,
    RemoteStats,
    RemoteWrite,
    deadline_budget,
)
from kvstore.tiers.remote.conn import (
    Breaker,
    ClusterTopology,
    Node,
    SingleTopology,
    Topology,
    call_deadline,
    parse_remote_url,
    redact,
)

__all__ = ["ADMISSIONS", "RemoteConfig", "RemoteStats", "RemoteTier", "RemoteWrite", "ReadStatus"]

log = logging.getLogger("kvstore.remote")

_WBUF_KEEP = 256 << 20  # write_blocks keeps its value buffer up to this size
_WARN_EVERY_S = 10.0  # refused writes are logged at most this often
_NA = object()
# cluster replies meaning "not here (now)": a miss, and the slot table is re-read
_REDIRECTS = (redis.exceptions.AskError, redis.exceptions.TryAgainError,
              redis.exceptions.ClusterDownError)  # MovedError is an AskError  # a key whose node was skipped, failed or did not answer in time
_SSL_FIELDS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
#: a read takes at most this many bytes past a v1 value's longest (header + raw block): room
#: for a later version's longer header; anything longer is not a block of this size
_READ_SLACK = 4096


_COUNTERS = ("hits", "misses", "corrupt", "timeouts", "errors", "skipped", "lookups",
             "lookup_blocks", "blocks_written", "write_failures", "deleted", "bytes_sent",
             "bytes_received", "raw_bytes_written", "stored_bytes_written")


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.v = dict.fromkeys(_COUNTERS, 0)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, n in kw.items():
                self.v[k] += n


def _pipeline(client: redis.Redis, cmds: list[tuple], deadline: float) -> list:
    """Run ``cmds`` as one non-transactional pipeline (one write, then the replies), with no
    retry past ``deadline``."""
    pipe = client.pipeline(transaction=False)
    for args, opts in cmds:
        pipe.execute_command(*args, **opts)
    with call_deadline(deadline):
        return pipe.execute(raise_on_error=False)


def _as_array(t: torch.Tensor, what: str) -> np.ndarray:
    return as_byte_tensor(t, what).numpy()


_check_key = check_key


class RemoteTier:
    """Blocks in Redis / Redis Cluster, shared across hosts. See the module docstring."""

    def __init__(self, config: RemoteConfig, *,
                 itemsize_for: Callable[[bytes], int] | None = None) -> None:
        if not isinstance(config, RemoteConfig):
            raise ConfigError(f"RemoteTier needs a RemoteConfig, got {type(config).__name__}")
        self.config = config
        self._itemsize_for = itemsize_for
        cluster, startup, kw = parse_remote_url(config.url)
        if config.username is not None:
            kw["username"] = config.username
        if config.password is not None:
            kw["password"] = config.password
        for name in _SSL_FIELDS:
            v = getattr(config, name)
            if v is not None:
                kw[name] = v
        kw.update(config.connection_kwargs)
        if kw.get("decode_responses"):
            raise ConfigError(f"remote url {redact(config.url)!r}: decode_responses must be off "
                              "(the tier stores binary values; decoded as text every read "
                              "failed, a silent miss): drop it from the URL or connection_kwargs")
        if cluster and "{" in config.key_prefix:
            raise ConfigError("remote key_prefix must not hold a '{hash tag}' in cluster mode: "
                              "it would put every block in one slot (one master)")
        self._prefix = config.key_prefix.encode()
        self._px = None if config.ttl_s is None else max(1, int(round(config.ttl_s * 1000)))
        self._url = redact(config.url)
        backoff = (float(config.backoff_s), float(config.backoff_max_s))

        def make_node(host: str, port: int) -> Node:
            return Node(host, port, kw, read_timeout=config.budget_s,
                        write_timeout=config.write_budget_s, backoff=backoff)

        self._topo: Topology = (ClusterTopology(startup, make_node) if cluster
                                else SingleTopology(make_node(*startup[0])))
        self._topo_breaker = Breaker(*backoff)  # cluster: reading the slot table
        self._refreshing = False
        self._refresh_lock = threading.Lock()
        self._counters = _Counters()
        self._wlock = threading.Lock()
        self._wbuf: np.ndarray | None = None
        self._warn_lock = threading.Lock()
        self._warned = Every(_WARN_EVERY_S)  # writes Redis refused (a lasting fault)
        self._pid = os.getpid()
        self._pool = cf.ThreadPoolExecutor(config.workers, thread_name_prefix="kvstore-remote")
        self._closed = False

    # -- helpers --------------------------------------------------------------------------------
    def _ensure(self) -> None:
        if self._closed:
            raise StoreClosedError("the remote tier is closed")
        if self._pid != os.getpid():  # forked: threads (and locks they held) do not survive
            self._pid = os.getpid()
            self._pool = cf.ThreadPoolExecutor(self.config.workers,
                                               thread_name_prefix="kvstore-remote")
            self._wlock = threading.Lock()
            self._warn_lock = threading.Lock()
            self._refresh_lock = threading.Lock()
            self._refreshing = False
            self._counters.lock = threading.Lock()

    @property
    def url(self) -> str:
        """The tier's URL, credentials redacted."""
        return self._url

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a block key."""
        return self._prefix + key.hex().encode()

    def _fail(self, node: Node | None, what: str, why: object, *, timeout: bool) -> None:
        self._counters.add(**{"timeouts" if timeout else "errors": 1})
        if node is None:
            interval = self._topo_breaker.failure()
            where = "cluster slot table"
        else:
            interval = node.breaker.failure()
            where = node.name
            if self._topo.cluster:
                self._topo.stale = True
        log.warning("remote tier %s: %s on %s failed (%s); treating as misses, skipping it "
                    "for %.3g s", self._url, what, where, why, interval)

    def _ok(self, node: Node) -> None:
        if node.breaker.success():
            log.warning("remote tier %s: %s answers again", self._url, node.name)

    def _routes(self, rkeys: Sequence[bytes], deadline: float) -> dict[Node | None, list[int]]:
        topo = self._topo
        if isinstance(topo, ClusterTopology):
            if topo.slots is None:
                # no slot table yet: read it now, within this call's budget
                if self._topo_breaker.allow():
                    fut = self._pool.submit(topo.refresh)
                    try:
                        fut.result(timeout=max(0.0, deadline - time.monotonic()))
                        if self._topo_breaker.success():
                            log.warning("remote tier %s: cluster slot table read again", self._url)
                    except cf.TimeoutError:
                        fut.cancel()
                        self._fail(None, "reading the slot table", "no answer within the budget",
                                   timeout=True)
                    except Exception as e:  # never raise Redis trouble
                        self._fail(None, "reading the slot table", e,
                                   timeout=isinstance(e, redis.TimeoutError))
            elif topo.stale:
                self._refresh_later()
        return topo.route(rkeys)

    def _refresh_later(self) -> None:
        """Re-read the slot table in the background (after a node failure or MOVED), at most
        once per backoff interval."""
        topo = self._topo
        assert isinstance(topo, ClusterTopology)
        with self._refresh_lock:
            if self._refreshing or time.monotonic() - topo.refreshed_at < self.config.backoff_s:
                return
            self._refreshing = True
            topo.refreshed_at = time.monotonic()

        def run() -> None:
            try:
                topo.refresh()
            except Exception as e:
                log.debug("remote tier %s: slot table refresh failed: %s", self._url, e)
            finally:
                self._refreshing = False

        try:
            self._pool.submit(run)
        except RuntimeError:  # shut down
            self._refreshing = False

    def _dispatch(self, rkeys: Sequence[bytes], build: Callable[[list[int]], list[tuple]],
                  deadline: float, *, write: bool, what: str) -> tuple[list, bool]:
        """One pipeline per node holding any of ``rkeys``, all in flight at once; wait until
        ``deadline``. Returns one reply per key (``_NA`` where its node was skipped, failed or
        late, or a ``ResponseError`` the server answered for that key), and whether every
        pipeline sent has finished (none is still running in a worker)."""
        out: list = [_NA] * len(rkeys)
        futs: dict[cf.Future, tuple[Node, list[int]]] = {}
        skipped = 0
        for node, idx in self._routes(rkeys, deadline).items():
            if node is None or not node.breaker.allow():
                skipped += len(idx)
                continue
            client = node.write if write else node.read
            try:
                futs[self._pool.submit(_pipeline, client, build(idx), deadline)] = (node, idx)
            except RuntimeError:  # pool shut down by a concurrent close()
                skipped += len(idx)
        if skipped:
            self._counters.add(skipped=skipped)
        if not futs:
            return out, True
        done, late = cf.wait(futs, timeout=max(0.0, deadline - time.monotonic()))
        moved = False
        for f in done:
            node, idx = futs[f]
            try:
                replies = f.result()
            except Exception as e:  # never raise Redis trouble into the engine
                self._fail(node, what, f"{type(e).__name__}: {e}",
                           timeout=isinstance(e, (redis.TimeoutError, TimeoutError)))
                continue
            self._ok(node)
            for i, r in zip(idx, replies, strict=True):
                if isinstance(r, _REDIRECTS):
                    moved = True
                out[i] = r
        for f in late:
            node, _idx = futs[f]
            if not f.cancel():  # running: a server still trickling its reply keeps the thread
                node.abort(write)
            self._fail(node, what, f"no reply within {deadline_budget(what, self.config)}",
                       timeout=True)
        if moved and isinstance(self._topo, ClusterTopology):
            self._topo.stale = True
            self._refresh_later()
        return out, not late

    # -- lookups --------------------------------------------------------------------------------
    def leading_run(self, keys: Sequence[bytes], namespace_id: bytes | None = None) -> int:
        """Number of leading ``keys`` present, asked in one round trip (a pipeline of ``EXISTS``
        per node, all nodes at once). Unreachable nodes count as absent. ``namespace_id`` is
        accepted for the LowerTier contract: the tier's key space is its ``key_prefix``."""
        self._ensure()
        keys = [_check_key(k, "key") for k in keys]
        if not keys:
            return 0
        rkeys = [self.redis_key(k) for k in keys]
        deadline = time.monotonic() + self.config.budget_s
        replies, _ = self._dispatch(rkeys, lambda idx: [(("EXISTS", rkeys[i]), {}) for i in idx],
                                    deadline, write=False, what="lookup")
        n = 0
        for r in replies:
            if r is _NA or isinstance(r, Exception) or not r:
                break
            n += 1
        self._counters.add(lookups=1, lookup_blocks=n)
        return n

    def contains(self, key: bytes) -> bool:
        return self.leading_run([key]) == 1

    # -- reads ----------------------------------------------------------------------------------
    def read_many(self, keys: Sequence[bytes], dsts: Sequence[torch.Tensor], *,
                  namespace_id: bytes | None = None) -> list[ReadStatus]:
        """Read blocks into ``dsts`` (CPU uint8 contiguous 1-D, raw block size each); one status
        per key: ``OK`` (verified bytes in ``dst``), ``MISSING`` (absent, unreachable, late) or
        ``DAMAGED`` (corrupt value; deleted). ``namespace_id``, when given, must match the
        value's. A ``dst`` not ``OK`` may have been written."""
        self._ensure()
        if len(keys) != len(dsts):
            raise TensorMismatchError(f"read_many got {len(keys)} keys but {len(dsts)} destinations")
        keys = [_check_key(k, "key") for k in keys]
        arrs = [_as_array(d, f"dsts[{i}]") for i, d in enumerate(dsts)]
        if namespace_id is not None:
            namespace_id = _check_key(namespace_id, "namespace_id")
        n = len(keys)
        if not n:
            return []
        rkeys = [self.redis_key(k) for k in keys]
        raw_total = sum(a.size for a in arrs)
        deadline = time.monotonic() + self.config.budget_s + raw_total / self.config.min_read_rate
        # GETRANGE, not GET: a value far larger than a block (another writer's) is read only
        # as far as a block's value can go, then found corrupt, instead of keeping the whole
        # pipeline past its deadline (every block of the read a miss, the node skipped) read
        # after read. A missing key reads as b"".
        replies, _ = self._dispatch(
            rkeys, lambda idx: [(("GETRANGE", rkeys[i], 0,
                                  fmt.HEADER_NBYTES + arrs[i].size + _READ_SLACK - 1), {})
                                for i in idx], deadline, write=False, what="read")
        out = [ReadStatus.MISSING] * n
        hits = misses = received = 0
        bad: list[bytes] = []
        for i, r in enumerate(replies):
            if r is _NA or r is None or r == b"":
                misses += 1
                continue
            if isinstance(r, Exception):
                if "WRONGTYPE" in str(r):  # something else stored under our key
                    bad.append(rkeys[i])
                    out[i] = ReadStatus.DAMAGED
                    log.warning("remote tier %s: block %s is corrupt (not a string); deleting it",
                                self._url, keys[i].hex()[:16])
                else:
                    misses += 1
                    self._counters.add(errors=1)
                continue
            if not isinstance(r, bytes):  # not Redis's answer to GETRANGE: not a server of ours
                misses += 1
                self._counters.add(errors=1)
                continue
            received += len(r)
            try:
                fmt.decode_into(r, keys[i], arrs[i], namespace_id)
            except fmt.UnsupportedValue as e:
                misses += 1
                log.debug("remote tier %s: block %s: %s", self._url, keys[i].hex()[:16], e)
                continue
            except fmt.CorruptValue as e:
                bad.append(rkeys[i])
                out[i] = ReadStatus.DAMAGED
                log.warning("remote tier %s: block %s is corrupt (%s); deleting it", self._url,
                            keys[i].hex()[:16], e)
                continue
            out[i] = ReadStatus.OK
            hits += 1
        self._counters.add(hits=hits, misses=misses, corrupt=len(bad), bytes_received=received)
        if bad:
            self._delete_later(bad)
        return out

    def read_into(self, key: bytes, dst: torch.Tensor, *,
                  namespace_id: bytes | None = None) -> ReadStatus:
        return self.read_many([key], [dst], namespace_id=namespace_id)[0]

    def _delete_later(self, rkeys: list[bytes]) -> None:
        """Best-effort DEL of corrupt values, not waited for (one worker, node after node)."""
        topo = self._topo

        def run() -> None:
            for node, idx in topo.route(rkeys).items():
                if node is None or not node.breaker.allow():
                    continue
                try:
                    _pipeline(node.write, [(("DEL", rkeys[i]), {}) for i in idx],
                              time.monotonic() + self.config.write_budget_s)
                except Exception as e:  # best effort
                    log.debug("remote tier %s: deleting corrupt values on %s failed: %s",
                              self._url, node.name, e)

        with contextlib.suppress(RuntimeError):  # closed meanwhile
            self._pool.submit(run)

    # -- writes ---------------------------------------------------------------------------------
    def _itemsize(self, w: RemoteWrite) -> int:
        if w.itemsize:
            return int(w.itemsize)
        if self._itemsize_for is not None:
            try:
                return int(self._itemsize_for(w.namespace_id))
            except Exception:  # unknown namespace: no shuffle
                return 1
        return 1

    def write_blocks(self, items: Sequence[RemoteWrite]) -> int:
        """Store blocks (``SET`` with ``PX`` when ``ttl_s``), one pipeline per node. Returns how
        many Redis acknowledged; failures are counted and logged, never raised. Duplicates are
        overwritten (same content: content-addressed keys)."""
        self._ensure()
        todo = []
        for i, w in enumerate(items):
            if not isinstance(w, RemoteWrite):
                raise TypeError(f"items[{i}] must be a RemoteWrite, got {type(w).__name__}")
            todo.append((_check_key(w.key, "key"), _check_key(w.namespace_id, "namespace_id"),
                         _as_array(w.data, f"items[{i}].data"), self._itemsize(w)))
        if not todo:
            return 0
        topo = self._topo
        if isinstance(topo, SingleTopology) and topo.node.breaker.skipping:
            # the only node is being skipped: do not compress for nothing
            self._counters.add(skipped=len(todo), write_failures=len(todo))
            return 0
        cfg = self.config

        def enc(t: tuple) -> tuple[bytes, bytes | memoryview]:
            return fmt.encode_parts(t[0], t[1], t[2], codec=cfg.codec, itemsize=t[3],
                                    level=cfg.zstd_level)

        if cfg.codec == "zstd" and len(todo) > 1:
            parts = list(self._pool.map(enc, todo))  # zstd releases the GIL
        else:
            parts = [enc(t) for t in todo]
        rkeys = [self.redis_key(t[0]) for t in todo]
        ttl = () if self._px is None else ("PX", self._px)
        with self._wlock:
            # values are assembled in one reused buffer: fresh multi-MiB bytes objects cost
            # more in page faults than the copy itself
            need = sum(len(h) + len(p) for h, p in parts)
            buf = self._wbuf if self._wbuf is not None and self._wbuf.size >= need else None
            if buf is None:
                buf = np.empty(need, dtype=np.uint8)
            values: list[memoryview] = []
            off = 0
            for h, p in parts:
                end = off + len(h) + len(p)
                buf[off:off + len(h)] = np.frombuffer(h, dtype=np.uint8)
                np.copyto(buf[off + len(h):end], np.frombuffer(p, dtype=np.uint8))
                values.append(memoryview(buf[off:end]))
                off = end
            del parts

            def build(idx: list[int]) -> list[tuple]:
                return [(("SET", rkeys[i], values[i], *ttl), {}) for i in idx]

            replies, finished = self._dispatch(rkeys, build, time.monotonic() + cfg.write_budget_s,
                                               write=True, what="write")
            # a pipeline still running in a worker may still read the buffer: keep it only when
            # none is, and only up to a size worth keeping
            self._wbuf = buf if finished and buf.size <= _WBUF_KEEP else None
        ok = raw = stored = 0
        refused: list[tuple[bytes, Exception]] = []
        for i, r in enumerate(replies):
            if r is True or r == b"OK":
                ok += 1
                raw += todo[i][2].size
                stored += len(values[i])
            elif isinstance(r, _REDIRECTS):
                log.debug("remote tier %s: write of %s refused: %s", self._url,
                          todo[i][0].hex()[:16], r)
            elif isinstance(r, Exception):
                refused.append((todo[i][0], r))
        if refused:
            self._refused(refused)
        sent = sum(len(v) for v in values)
        self._counters.add(blocks_written=ok, write_failures=len(todo) - ok, bytes_sent=sent,
                           raw_bytes_written=raw, stored_bytes_written=stored)
        return ok

    def _refused(self, refused: list[tuple[bytes, Exception]]) -> None:
        """Blocks Redis refused (``OOM`` at ``maxmemory`` with ``noeviction``, ``READONLY``
        after a failover): a fault that lasts refuses every block of every write, so it is
        logged once per :data:`_WARN_EVERY_S` with how many were refused since (each block
        logged its own line before: thousands a second), never per block."""
        with self._warn_lock:
            n = self._warned.tally(len(refused))
        if not n:
            return
        key, err = refused[0]
        log.warning("remote tier %s: Redis refused %d block write(s)%s, e.g. %s: %s "
                    "(logged at most every %g s)", self._url, n,
                    "" if n == len(refused) else " since the last warning", key.hex()[:16],
                    err, _WARN_EVERY_S)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks; returns how many existed (0 for unreachable nodes)."""
        return len(self._delete(keys))

    def delete_owned(self, keys: Sequence[bytes], namespace_id: bytes) -> list[bytes]:
        """Delete blocks of this tier's key space (its ``key_prefix``: a store's namespace);
        returns the keys that existed."""
        _check_key(namespace_id, "namespace_id")
        return self._delete(keys)

    def _delete(self, keys: Sequence[bytes]) -> list[bytes]:
        self._ensure()
        keys = [_check_key(k, "key") for k in keys]
        if not keys:
            return []
        rkeys = [self.redis_key(k) for k in keys]
        replies, _ = self._dispatch(rkeys, lambda idx: [(("DEL", rkeys[i]), {}) for i in idx],
                                    time.monotonic() + self.config.write_budget_s, write=True,
                                    what="delete")
        gone = [k for k, r in zip(keys, replies, strict=True) if isinstance(r, int) and r > 0]
        self._counters.add(deleted=len(gone))
        return gone

    # -- stats, lifecycle -----------------------------------------------------------------------
    def stats(self) -> RemoteStats:
        with self._counters.lock:
            v = dict(self._counters.v)
        nodes = self._topo.nodes()
        down = sum(1 for n in nodes if not n.breaker.closed)
        known = not isinstance(self._topo, ClusterTopology) or self._topo.slots is not None
        return RemoteStats(**v, available=known and down == 0 and self._topo_breaker.closed,
                           nodes=len(nodes), nodes_down=down)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the worker threads (not waiting for calls in flight) and drop connections.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._topo.close()

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteTier({self._url!r}, codec={self.config.codec!r})"
