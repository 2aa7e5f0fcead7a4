"""The sidecar daemon (``kvstore serve``); its wire protocol is :mod:`kvstore.wire`.

| module | job |
| --- | --- |
| ``security`` | socket and shared-memory permissions, SO_PEERCRED allow-list, limits |
| ``leases`` | per-connection leases, granted puts and pins, given back on disconnect |
| ``config`` | ``DaemonConfig``: what ``kvstore serve`` resolved from its arguments |
| ``namespaces`` | one embedded ``Store`` per namespace, its warm tier in shared memory |
| ``handlers`` | one coroutine per request type |
| ``connection`` | one client connection: hello, then requests in order |
| ``daemon`` | the asyncio server, its thread pool, graceful shutdown |
| ``metrics`` | Prometheus metrics (file or 127.0.0.1 HTTP) |
| ``process`` | ``DaemonProcess``: ``kvstore serve`` as a child process (benchmarks, tests); the daemon never imports it |

The client is :mod:`kvstore.client` (``kvstore.connect``); the protocol is documented in
``docs/protocol.md``.
"""
