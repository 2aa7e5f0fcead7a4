"""Connections of the remote tier: URL parsing, per-node redis-py clients with budget-derived
socket timeouts and no retries, a circuit breaker per node, and key -> node routing (one node,
or a Redis Cluster's slot table read with ``CLUSTER SLOTS``).

redis-py's ``RedisCluster`` is deliberately not used for data: its pipeline fails as a whole
when one master is down (the issue wants misses for that node's keys only) and it retries and
re-reads the topology inside the caller's call. Here every node has its own plain
``redis.Redis`` clients and breaker, and the tier sends one pipeline per node concurrently.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from kvstore.errors import ConfigError

log = logging.getLogger("kvstore.remote")

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
CLUSTER_SLOTS = 16384
# connection settings the tier owns; not taken from the URL query or connection_kwargs
_OWNED = ("socket_timeout", "socket_connect_timeout", "retry", "retry_on_timeout",
          "retry_on_error", "host", "port")


def redact(url: str) -> str:
    """The URL without its password (for logs and reprs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = (f"{user}:***@" if ":" in userinfo else f"{user}@") + hosts if user else f":***@{hosts}"
    query = "&".join(("password=***" if q.lower().startswith("password=") else q)
                     for q in parts.query.split("&")) if parts.query else ""
    return parts._replace(netloc=netloc, query=query).geturl()


def _split_hosts(hosts: str, default_port: int) -> list[tuple[str, int]]:
    out = []
    for h in hosts.split(","):
        h = h.strip()
        if not h:
            continue
        if h.startswith("["):  # [v6]:port
            addr, _, rest = h[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else default_port
        elif h.count(":") == 1:
            addr, _, p = h.partition(":")
            port = int(p) if p else default_port
        else:
            addr, port = h, default_port
        out.append((addr or "127.0.0.1", port))
    return out


def parse_remote_url(url: str) -> tuple[bool, list[tuple[str, int]], dict[str, Any]]:
    """``(cluster, startup_nodes, connection_kwargs)`` of a remote URL.

    ``redis://[user:pass@]host:port/db``, ``rediss://`` (TLS), ``redis+cluster://h1:p1,h2:p2``
    and ``rediss+cluster://``; query arguments (``?ssl_ca_certs=...&ssl_cert_reqs=none``,
    ``socket_keepalive``, ``protocol``...) are redis-py connection arguments."""
    if not isinstance(url, str):
        raise ConfigError(f"remote url must be a str, got {type(url).__name__}")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise ConfigError(f"remote url {redact(url)!r} does not parse: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ConfigError(f"remote url {redact(url)!r}: scheme must be one of "
                          f"{', '.join(s + '://' for s in SCHEMES)}")
    cluster = scheme.endswith("+cluster")
    base = scheme.split("+")[0]
    userinfo, _, hosts = parts.netloc.rpartition("@")
    try:
        nodes = _split_hosts(hosts, 6379)
    except ValueError:
        raise ConfigError(f"remote url {redact(url)!r}: bad host:port list {hosts!r}") from None
    if not nodes:
        raise ConfigError(f"remote url {redact(url)!r} names no host")
    if not cluster and len(nodes) > 1:
        raise ConfigError(f"remote url {redact(url)!r} names several hosts; use "
                          f"redis+cluster:// for a cluster")
    h0, p0 = nodes[0]
    host = f"[{h0}]" if ":" in h0 else h0
    single = f"{base}://{userinfo + '@' if userinfo else ''}{host}:{p0}{parts.path}"
    if parts.query:
        single += "?" + parts.query
    try:
        kw = redis.connection.parse_url(single)
    except ValueError as e:
        raise ConfigError(f"remote url {redact(url)!r}: {e}") from None
    kw.pop("host", None)
    kw.pop("port", None)
    if cluster and kw.pop("db", 0) not in (0, None):
        raise ConfigError(f"remote url {redact(url)!r}: a Redis Cluster has only db 0")
    return cluster, nodes, kw


class Breaker:
    """Circuit breaker: after a failure, skip the node for ``initial_s``, doubling on each
    further failure up to ``max_s``; once the interval passed, one call goes through as a probe
    (others keep skipping); success closes it."""

    def __init__(self, initial_s: float, max_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._lock = threading.Lock()
        self.failures = 0
        self.open_until = 0.0
        self._probe_until = 0.0

    @property
    def closed(self) -> bool:
        return self.failures == 0

    @property
    def skipping(self) -> bool:
        """Open and still inside its interval (no state change; ``allow`` takes the probe)."""
        return self.failures > 0 and self._clock() < self.open_until

    def allow(self) -> bool:
        if self.failures == 0:
            return True
        with self._lock:
            if self.failures == 0:
                return True
            now = self._clock()
            if now < self.open_until or now < self._probe_until:
                return False
            # half-open: this caller probes; others skip until it reports (or a while passes)
            self._probe_until = now + self.initial_s
            return True

    def success(self) -> bool:
        """Close; True if it was open (the node came back)."""
        if self.failures == 0:
            return False
        with self._lock:
            was = self.failures > 0
            self.failures = 0
            self.open_until = self._probe_until = 0.0
            return was

    def failure(self) -> float:
        """Open (again); returns the interval the node will be skipped."""
        with self._lock:
            self.failures += 1
            interval = min(self.max_s, self.initial_s * (2 ** min(self.failures - 1, 30)))
            self.open_until = self._clock() + interval
            self._probe_until = 0.0
            return interval


class Node:
    """One Redis server: a client for reads/lookups (socket timeouts from the read budget) and
    one for writes (from the write budget), and its breaker."""

    def __init__(self, host: str, port: int, kw: Mapping[str, Any], *, read_timeout: float,
                 write_timeout: float, backoff: tuple[float, float]) -> None:
        self.host, self.port = host, port
        self.name = f"{host}:{port}"
        self.read = _client(host, port, kw, read_timeout)
        self.write = _client(host, port, kw, write_timeout)
        self.breaker = Breaker(*backoff)

    def close(self) -> None:
        for c in (self.read, self.write):
            with contextlib.suppress(Exception):  # best effort at close
                c.connection_pool.disconnect()

    def retire(self) -> None:
        """Close the idle connections; those of calls in flight close when they end (the
        node is no longer used)."""
        for c in (self.read, self.write):
            with contextlib.suppress(Exception):  # best effort
                c.connection_pool.disconnect(inuse_connections=False)

    def abort(self, write: bool) -> None:
        """Cut the sockets of a call that missed its deadline (and any other call on them):
        a server that trickles its reply stays within every socket timeout and held a worker
        thread for as long as it liked. The worker's read fails; no retry follows past the
        deadline (:class:`BudgetRetry`)."""
        with contextlib.suppress(Exception):  # best effort: the call is given up already
            (self.write if write else self.read).connection_pool.disconnect(
                inuse_connections=True)


#: the deadline of the call running on this thread (``call_deadline``), for BudgetRetry
_CALL = threading.local()


@contextlib.contextmanager
def call_deadline(deadline: float):
    """Run the block with ``deadline`` (``time.monotonic()``) as this thread's call deadline."""
    _CALL.deadline = deadline
    try:
        yield
    finally:
        _CALL.deadline = None


class PastDeadline(redis.TimeoutError):
    """A retry (or first try) the call's deadline has passed: not tried."""


class BudgetRetry(Retry):
    """redis-py's retry, never past the running call's deadline: after :meth:`Node.abort` cut
    a late call's socket, a retry would reconnect and send it again."""

    def call_with_retry(self, do, fail, *args, **kwargs):  # type: ignore[override]
        deadline = getattr(_CALL, "deadline", None)
        if deadline is None:
            return super().call_with_retry(do, fail, *args, **kwargs)

        def within():
            if time.monotonic() >= deadline:
                raise PastDeadline("the call's deadline passed")
            return do()

        return super().call_with_retry(within, fail, *args, **kwargs)


def _client(host: str, port: int, kw: Mapping[str, Any], timeout: float) -> redis.Redis:
    args = {k: v for k, v in kw.items() if k not in _OWNED}
    # one immediate retry on a connection error (a pooled socket the server closed: restart,
    # idle timeout), none on a timeout: a slow server must not cost the budget twice
    retry = BudgetRetry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
    pool = redis.ConnectionPool(host=host, port=port, socket_timeout=timeout,
                                socket_connect_timeout=timeout, retry=retry, **args)
    return redis.Redis(connection_pool=pool)


class Topology:
    """Where keys live. ``route`` maps key positions to nodes; ``None`` = not routable now."""

    cluster = False

    def route(self, rkeys: Sequence[bytes]) -> dict[Node | None, list[int]]:
        raise NotImplementedError

    def nodes(self) -> list[Node]:
        raise NotImplementedError

    def close(self) -> None:
        for n in self.nodes():
            n.close()


class SingleTopology(Topology):
    def __init__(self, node: Node) -> None:
        self.node = node

    def route(self, rkeys: Sequence[bytes]) -> dict[Node | None, list[int]]:
        return {self.node: list(range(len(rkeys)))}

    def nodes(self) -> list[Node]:
        return [self.node]


class ClusterTopology(Topology):
    """A Redis Cluster: the slot table (``CLUSTER SLOTS``) and a ``Node`` per master.

    Keys are spread over slots by the CRC16 of the whole Redis key (the key prefix must not hold
    a ``{hash tag}``), so one engine's chain lands on every master; the tier sends one pipeline
    per master, concurrently."""

    cluster = True

    def __init__(self, startup: Sequence[tuple[str, int]], make_node: Callable[[str, int], Node],
                 ) -> None:
        self.startup = list(startup)
        self._make_node = make_node
        self._lock = threading.Lock()
        self._nodes: dict[str, Node] = {}
        self.slots: list[Node | None] | None = None
        self.refreshed_at = 0.0
        self.stale = True

    def node(self, host: str, port: int) -> Node:
        name = f"{host}:{port}"
        with self._lock:
            n = self._nodes.get(name)
            if n is None:
                n = self._nodes[name] = self._make_node(host, port)
            return n

    def nodes(self) -> list[Node]:
        with self._lock:
            return list(self._nodes.values())

    def refresh(self) -> None:
        """Read the slot table from the first node that answers (known masters first, then
        the startup nodes). Raises the last error when none answers."""
        cands = [n for n in self.nodes() if n.breaker.closed]
        # a startup node the tier does not know yet is asked through a node of its own,
        # closed after: only masters the table names are ever kept (a startup address that is
        # no master was counted among the nodes while a refresh ran)
        temps: list[Node] = []
        for h, p in self.startup:
            with self._lock:
                known = self._nodes.get(f"{h}:{p}")
            if known is None:
                known = self._make_node(h, p)
                temps.append(known)
            cands.append(known)
        try:
            self._read_table(cands)
        finally:
            for t in temps:
                t.retire()

    def _read_table(self, cands: Sequence[Node]) -> None:
        seen: set[str] = set()
        err: Exception | None = None
        for n in cands:
            if n.name in seen:
                continue
            seen.add(n.name)
            try:
                rows = n.read.execute_command("CLUSTER SLOTS")
            except redis.RedisError as e:
                err = e
                continue
            table: list[Node | None] = [None] * CLUSTER_SLOTS
            for row in rows:
                lo, hi, primary = int(row[0]), int(row[1]), row[2]
                host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
                if not host or host == "?":
                    host = n.host
                owner = self.node(host, int(primary[1]))
                for s in range(lo, hi + 1):
                    table[s] = owner
            # the old masters go before the table routes to the new ones: once a write
            # reaches the new master, the nodes are the table's
            self._retire({id(x) for x in table if x is not None})
            self.slots = table
            self.refreshed_at = time.monotonic()
            self.stale = False
            return
        raise err if err is not None else redis.ConnectionError("no cluster node to ask")

    def _retire(self, masters: set[int]) -> None:
        """Forget (and close) every node the slot table just read does not name: masters
        move over months (failovers, pods rescheduled with new addresses), and each address
        the table ever named was kept with its pools and breaker, counted down forever
        (``nodes_down``, ``available=False`` on a healthy cluster). A call still running on
        a retired node keeps its connection until it ends."""
        with self._lock:
            gone = [n for n in self._nodes.values() if id(n) not in masters]
            for n in gone:
                del self._nodes[n.name]
        for n in gone:
            n.retire()

    def route(self, rkeys: Sequence[bytes]) -> dict[Node | None, list[int]]:
        table = self.slots
        if table is None:
            return {None: list(range(len(rkeys)))}
        out: dict[Node | None, list[int]] = {}
        for i, k in enumerate(rkeys):
            n = table[key_slot(k)]
            g = out.get(n)
            if g is None:
                out[n] = [i]
            else:
                g.append(i)
        return out
