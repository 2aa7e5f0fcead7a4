"""The daemon's wire protocol, used by the client and the daemon alike (``docs/protocol.md``).

| module | job |
| --- | --- |
| ``framing`` | 4-byte big-endian length prefix; frame cap checked before the body is read |
| ``codec`` | bounded msgpack (no pickle, no extension types) |
| ``messages`` | request/reply envelopes, the catalogue of ops and their reply types; every message re-exported |
| ``handshake`` | ``hello`` and its reply |
| ``data_ops`` | lookup, prefetch, pin/unpin, evict, flush, ping; the count and empty replies |
| ``zero_copy`` | leases (fetch, release) and granted puts (put, commit, abort) of warm slots |
| ``stats`` | store and daemon counters; the client's lookup reports |
| ``admin_ops`` | an admin connection's ops (remove) |
| ``fields`` | checked decoding of each wire field; the ``[keys, parent]`` and ``[id]`` shapes |
| ``errors`` | error codes and the exceptions of error replies |
| ``protocol`` | protocol version; the hello handshake -> namespace |
| ``channel`` | the client's end of a connection (blocking, pipelined) |

It knows only core types (keys, layout, namespace, stats): never the store or the daemon.
"""
