"""``kvstore explain --socket S``: what a running daemon holds of a prompt.

Speaks the daemon's wire protocol as a client does (``kvstore.wire``): a hello for the
namespace (the daemon derives the id, so a ``per-uid`` policy is honoured), then

* the namespace's **warm** tier: the daemon's shared key → slot directory, mapped read-only
  and probed per key (no round trip, nothing counted);
* everything it holds (warm, disk, remote): ``lookup`` requests for the prompt's chain,
  which the daemon answers from its tiers in order — the leading run a client gets.

Blocks of that run that are neither warm nor on the store's disk come from the **remote**
tier. The daemon has no hot tier. Side effects, documented in ``docs/cli.md``: the lookups
count in the daemon's lookup counters, and a hello for a namespace the daemon has not open
opens it (so :func:`probe_daemon` is only called for namespaces registered in the store).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.admin.common import AdminError
from kvstore.admin.nsmatch import NamespaceFields

__all__ = ["LiveView", "probe_daemon"]


@dataclass(frozen=True, slots=True)
class LiveView:
    """What the daemon at ``socket`` holds of a chain."""

    socket: str
    server: str  # the daemon's own description, e.g. "kvstore 0.1.0 pid 1234"
    namespace_id: bytes  # as the daemon derived it
    warm: tuple[bool, ...]  # per block: in the namespace's warm tier
    held: int  # leading blocks the daemon holds in any tier (what a lookup answers)
    directory: bool  # False: an older daemon without a key directory (warm not known)


def _layout(f: NamespaceFields):
    from kvstore.layout import KVLayout

    return KVLayout(num_layers=f.num_layers, num_kv_heads=f.num_kv_heads, head_dim=f.head_dim,
                    dtype=f.dtype, block_tokens=f.block_tokens,
                    kv_planes=f.kv_planes)


def hello_namespace(socket: str, fields: NamespaceFields, *, salt_policy: str = "shared",
                    timeout: float = 10.0, client: str = ""):
    """Connect and say hello (as ``client``, for the daemon's log); returns ``(channel, hello
    reply)`` (the caller closes it)."""
    from kvstore.errors import KVStoreError
    from kvstore.wire import messages as m
    from kvstore.wire.channel import Channel, ChannelClosed
    from kvstore.wire.protocol import make_hello

    sock = os.path.abspath(os.path.expanduser(socket))
    extras = dict(fields.extras)
    try:
        hello = make_hello(_layout(fields), fields.model_id,
                           model_revision=fields.model_revision or None,
                           tp_rank=fields.tp_rank, tp_size=fields.tp_size,
                           namespace_extras=extras or None, salt_policy=salt_policy,
                           client=client or f"kvstore explain pid {os.getpid()}")
    except KVStoreError as e:
        raise AdminError(f"cannot ask the daemon about this namespace: {e}") from None
    try:
        ch = Channel.connect(sock, timeout)
    except OSError as e:
        raise AdminError(f"no daemon answers at {sock} ({e.strerror or e}); is 'kvstore "
                         "serve' running with --socket pointing there?") from None
    try:
        reply = ch.call(hello)
    except (m.ServerError, ChannelClosed) as e:
        ch.close()
        raise AdminError(f"the daemon at {sock} refused the namespace: {e}") from None
    except BaseException:
        ch.close()
        raise
    ch.max_frame = reply.max_frame
    return ch, reply


def probe_daemon(socket: str, fields: NamespaceFields, keys_of, *,
                 salt_policy: str = "shared") -> LiveView:
    """Ask the daemon at ``socket`` about the chain ``keys_of(namespace_id)`` (a callable:
    the keys depend on the id the daemon derives)."""
    from kvstore.tiers.key_directory import KeyDirectory, directory_path

    ch, reply = hello_namespace(socket, fields, salt_policy=salt_policy)
    try:
        keys: Sequence[bytes] = keys_of(reply.namespace_id)
        directory = None
        with contextlib.suppress(OSError, ValueError):  # an older daemon: no directory
            directory = KeyDirectory.open_readonly(directory_path(reply.shm_path))
        try:
            warm = tuple(directory.leading_run(k) == 1 for k in keys) if directory else \
                (False,) * len(keys)
        finally:
            if directory is not None:
                directory.close()
        held = _held(ch, keys, reply.max_keys, socket)
        return LiveView(os.path.abspath(os.path.expanduser(socket)), reply.server,
                        reply.namespace_id, warm, held, directory is not None)
    finally:
        ch.close()


def _held(ch, keys: Sequence[bytes], max_keys: int, socket: str) -> int:
    """The daemon's leading run of ``keys`` (lookups of up to ``max_keys`` keys each)."""
    from kvstore.wire import messages as m
    from kvstore.wire.channel import ChannelClosed

    step = max(1, max_keys)
    found = 0
    try:
        for off in range(0, len(keys), step):
            chunk = keys[off : off + step]
            parent = keys[off - 1] if off else None
            n = ch.call(m.Lookup(b"".join(chunk), parent)).n
            found += n
            if n < len(chunk):
                break
    except (m.ServerError, ChannelClosed) as e:
        raise AdminError(f"the daemon at {socket} could not answer a lookup: {e}") from None
    return found
