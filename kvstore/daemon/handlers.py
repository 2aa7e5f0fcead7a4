"""One coroutine per request type: check limits, call the namespace's store, build the reply.

Store calls run on the daemon's thread pool (``run``), except the few that only take the
store's lock on a memory-only store (no disk tier, so no I/O can be behind that lock), which
run inline to save the thread hop on the latency-critical ``lookup``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from kvstore.daemon.namespaces import free_warm_slots
from kvstore.errors import NotDurableError
from kvstore.keys import KeyChain
from kvstore.wire import messages as m
from kvstore.wire.errors import BadRequest, ErrorCode

if TYPE_CHECKING:
    from kvstore.daemon.connection import Connection

log = logging.getLogger("kvstore.daemon")


def _chain(conn: Connection, blob: bytes, parent: bytes | None = None) -> KeyChain:
    n = len(blob) // m.KEY_BYTES
    if n > conn.limits.max_keys:
        raise BadRequest(f"{n} keys in one request; the daemon takes at most "
                         f"{conn.limits.max_keys} (--max-keys)", ErrorCode.LIMIT)
    return KeyChain(m.split_keys(blob), conn.entry.namespace.id, parent)


async def _call(conn: Connection, inline: bool, fn: Callable, *args: object) -> object:
    if inline and conn.entry.memory_only:
        return fn(*args)
    return await conn.run(fn, *args)


async def lookup(conn: Connection, req: m.Lookup) -> m.Count:
    keys = _chain(conn, req.keys, req.parent)
    n = await _call(conn, True, conn.store.lookup_split, keys)
    conn.metrics.lookup_hit.inc(n)
    conn.metrics.lookup_miss.inc(len(keys) - n)
    return m.Count(n)


async def fetch(conn: Connection, req: m.Fetch) -> m.Lease:
    keys = _chain(conn, req.keys, req.parent)
    conn.holdings.check_room()
    got, slots = await _call(conn, False, conn.store.lease_warm, keys)
    if not got:
        return m.Lease(0, [])
    lease_id = conn.holdings.add_lease(got)
    conn.metrics.leased_blocks.inc(len(got))
    conn.metrics.leased_bytes.inc(len(got) * conn.block_nbytes)
    return m.Lease(lease_id, slots)


async def release(conn: Connection, req: m.Release) -> m.Empty:
    keys = conn.holdings.pop_lease(req.id)
    await _call(conn, True, conn.store.release_lease, keys)
    return m.Empty()


async def put(conn: Connection, req: m.Put) -> m.Grant:
    keys = _chain(conn, req.keys, req.parent)
    conn.holdings.check_room()
    grant = await _call(conn, False, conn.store.grant_put, keys, req.hint)
    if not grant.keys:
        return m.Grant(0, [], [], grant.duplicates)
    gid = conn.holdings.add_grant(grant)
    return m.Grant(gid, list(grant.positions), list(grant.slots), grant.duplicates)


async def commit(conn: Connection, req: m.Commit) -> m.Count:
    grant = conn.holdings.pop_grant(req.id)
    n = await _call(conn, True, conn.store.commit_put, grant)
    conn.metrics.put_blocks.inc(n)
    conn.metrics.put_bytes.inc(n * conn.block_nbytes)
    return m.Count(n)


async def abort(conn: Connection, req: m.Abort) -> m.Empty:
    grant = conn.holdings.pop_grant(req.id)
    await _call(conn, True, conn.store.abort_put, grant)
    conn.metrics.aborted_blocks.inc(len(grant.keys))  # type: ignore[attr-defined]
    return m.Empty()


async def prefetch(conn: Connection, req: m.Prefetch) -> m.Count:
    keys = _chain(conn, req.keys, req.parent)
    store = conn.store
    return m.Count(await conn.run(lambda: store.prefetch(keys).wait()))


async def pin(conn: Connection, req: m.Pin) -> m.Count:
    keys = _chain(conn, req.keys, req.parent)
    conn.holdings.check_pins(len(keys))
    receipt = await _call(conn, True, conn.store.pin, keys)
    conn.holdings.add_pins(receipt.keys)
    return m.Count(len(receipt.keys))


async def unpin(conn: Connection, req: m.Unpin) -> m.Count:
    keys = conn.holdings.take_pins(_chain(conn, req.keys))
    if not keys:
        return m.Count(0)
    return m.Count(await _call(conn, True, conn.store.unpin, keys))


async def evict(conn: Connection, req: m.Evict) -> m.Count:
    keys = None if req.keys is None else _chain(conn, req.keys)
    store = conn.store
    return m.Count(await conn.run(lambda: store.evict(keys, tier=req.tier)))


async def stats(conn: Connection, req: m.Stats) -> m.StatsReply:
    st = await _call(conn, True, conn.store.stats)
    return m.StatsReply(st, conn.server_stats(free_warm_slots(conn.store)))


async def flush(conn: Connection, req: m.Flush) -> m.Empty:
    store = conn.store
    try:
        await conn.run(store.flush, req.timeout)
    except TimeoutError as e:
        raise BadRequest(str(e), ErrorCode.TIMEOUT) from None
    except NotDurableError as e:  # the message starts "flush: N block(s)" (protocol.md)
        raise BadRequest(str(e), ErrorCode.NOT_DURABLE) from None
    return m.Empty()


async def ping(conn: Connection, req: m.Ping) -> m.Empty:
    return m.Empty()


async def lookup_report(conn: Connection, req: m.LookupReport) -> m.Empty:
    conn.store.count_lookups(req.lookups, req.hits, req.misses)
    conn.metrics.lookup_hit.inc(req.hits)
    conn.metrics.lookup_miss.inc(req.misses)
    return m.Empty()


async def remove(conn: Connection, req: m.Remove) -> m.Count:
    """Admin: the named namespace's blocks out of the daemon's memory and off its disk."""
    n = req.count
    if n > conn.limits.max_keys:
        raise BadRequest(f"{n} keys in one request; the daemon takes at most "
                         f"{conn.limits.max_keys} (--max-keys)", ErrorCode.LIMIT)
    keys = None if req.keys is None else m.split_keys(req.keys)
    removed = await conn.daemon.registry.remove(req.namespace_id, keys)
    log.info("removed %d block(s) of namespace %s for pid %d uid %d (%s)", removed,
             req.namespace_id.hex()[:16], conn.cred.pid, conn.cred.uid,
             "all" if keys is None else f"{n} named")
    return m.Count(removed)


async def hello_again(conn: Connection, req: m.Hello) -> m.Empty:
    raise BadRequest("this connection already said hello; open another connection for "
                     "another namespace", ErrorCode.HELLO_REQUIRED)


HANDLERS: dict[type, Callable[[Connection, object], Awaitable[object]]] = {
    m.Lookup: lookup, m.Fetch: fetch, m.Release: release, m.Put: put, m.Commit: commit,
    m.Abort: abort, m.Prefetch: prefetch, m.Pin: pin, m.Unpin: unpin, m.Evict: evict,
    m.Stats: stats, m.Flush: flush, m.Ping: ping, m.Hello: hello_again,
    m.LookupReport: lookup_report,
}
#: what an admin connection (no hello, no namespace) may ask
ADMIN_HANDLERS: dict[type, Callable[[Connection, object], Awaitable[object]]] = {
    m.Remove: remove, m.Ping: ping,
}
