"""The daemon's wire protocol, used by the client and the daemon alike (``docs/protocol.md``).

| module | job |
| --- | --- |
| ``framing`` | 4-byte big-endian length prefix; frame cap checked before the body is read |
| ``codec`` | bounded msgpack (no pickle, no extension types) |
| ``messages`` | typed requests/replies and their wire arrays; error codes |
| ``protocol`` | protocol version; the hello handshake -> namespace |
| ``channel`` | the client's end of a connection (blocking, pipelined) |

It knows only core types (keys, layout, namespace, stats): never the store or the daemon.
"""
