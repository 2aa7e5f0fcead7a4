"""A bare request/reply server over a Unix socket: the round-trip floor the daemon's lookup
is measured against. Same framing (4-byte length, body) and the same event loop as
``kvstore serve``, but no decoding and no work: it answers each frame with 8 bytes.

Run as ``python -m kvstore.bench.echo SOCKET``; it serves until killed.
"""

from __future__ import annotations

import asyncio
import sys

from kvstore.daemon.daemon import _loop_factory
from kvstore.wire.framing import encode_frame, read_frame

_REPLY = encode_frame(b"\x93\x01\x00\x91\x00\x00\x00\x00")


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await read_frame(reader, 64 << 20) is not None:
            writer.write(_REPLY)
            await writer.drain()
    finally:
        writer.close()


async def _serve(path: str) -> None:
    server = await asyncio.start_unix_server(_handle, path, limit=64 << 10)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
