"""``kvstore.connect``: the embedded store's API, served by a ``kvstore serve`` daemon.

The control plane is the daemon's Unix socket (:mod:`kvstore.wire`, served by
:mod:`kvstore.daemon`); the data plane is the namespace's warm tier, a shared-memory slab this
process maps. A fetch leases the blocks' slots, copies them into the caller's tensor (on its
device; the mapping is registered as pinned memory where CUDA exists, so those copies are DMA)
and releases the lease without waiting; a put asks for slots, writes them, then commits. Keys
are computed here, with the daemon's namespace id.

If the daemon goes away, nothing raises into the engine: lookups and fetches miss, puts are
dropped, a warning is logged once, and the client reconnects (with backoff) when the daemon
is back. A daemon that does not answer at ``connect`` raises (a mistyped socket path would
otherwise miss silently), unless ``connect(..., wait_for_daemon=True)`` waits for one that
is starting, the same way. Configuration errors raise too: a daemon that refuses this uid,
speaks another protocol version or cannot serve the namespace; and ``flush``, the durability
barrier, when it cannot vouch for puts made since the last flush (the daemon restarted
without a clean stop, or none answers).

| module | job |
| --- | --- |
| ``client`` | :class:`Client` (the store API: keys, lookup, fetch, put, paged I/O, pins, stats, flush) and :func:`connect` |
| ``link`` | the current session, reconnecting with backoff; round trips whose failures are misses |
| ``session`` | one connection: the hello handshake, the mapped warm slab and key directory |

It stands on :mod:`kvstore.wire` and the shared-memory tiers, never on the daemon's internals.
"""

from kvstore.client.client import Client, connect

__all__ = ["Client", "connect"]
