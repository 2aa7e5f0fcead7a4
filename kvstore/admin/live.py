"""Counters of a running daemon (``kvstore stats --socket S``), over its wire protocol
(a hello per namespace, then ``stats``; torch is never imported).

The daemon keeps its counters per namespace and answers a ``stats`` request only on a
connection that has said hello for one namespace, so the namespaces to ask about come from
the daemon's store directory (``--store``, default ``$KVSTORE_PATH`` or ``~/.cache/kvstore``),
optionally filtered like ``kvstore ls``. Caveat: saying hello for a namespace the daemon does
not have open makes it open it (its warm tier is allocated then).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.admin.common import AdminError
from kvstore.errors import DaemonUnavailableError as _DaemonUnavailable

if TYPE_CHECKING:
    from kvstore.stats import StoreStats
    from kvstore.wire.stats import ServerStats

__all__ = [
    "DaemonNamespaceStats",
    "DaemonStats",
    "DaemonUnavailableError",
    "daemon_remove",
    "daemon_stats",
    "serving_daemon",
]

#: keys per remove request; halved while the daemon answers LIMIT (a small --max-keys or
#: --max-frame)
_REMOVE_BATCH = 4096


class DaemonUnavailableError(AdminError, _DaemonUnavailable):
    """No daemon answering at the socket, or it refused a namespace (also a
    :class:`kvstore.errors.DaemonUnavailableError`)."""


@dataclass(frozen=True, slots=True)
class DaemonNamespaceStats:
    namespace_id: str  # as the daemon derived it (its salt policy may differ from the store's)
    model_id: str
    layout: str
    hit_rate: float  # hits / (hits + misses) of lookups
    stats: StoreStats  # the daemon's counters for the namespace
    server: ServerStats  # connections, leases, free slots, ...


@dataclass(frozen=True, slots=True)
class DaemonStats:
    socket: str
    store: str  # the store directory the namespaces were taken from
    time: float  # when the sample was taken, seconds since the epoch
    namespaces: tuple[DaemonNamespaceStats, ...]


def daemon_stats(socket: str | os.PathLike[str], store: str | os.PathLike[str] | None = None,
                 *, filters: Iterable[str] = ()) -> DaemonStats:
    """One stats sample from the daemon listening at ``socket``, for every namespace of
    ``store`` (the daemon's ``--store``) that passes ``filters`` (``kvstore ls`` filters)."""
    from kvstore.admin.explain_live import hello_namespace
    from kvstore.admin.inventory import list_namespaces
    from kvstore.admin.nsmatch import NamespaceFields
    from kvstore.wire import messages as m
    from kvstore.wire.channel import ChannelClosed

    sock = os.path.abspath(os.path.expanduser(os.fspath(socket)))
    if not os.path.exists(sock):
        raise DaemonUnavailableError(f"no daemon socket at {sock} (is 'kvstore serve' running "
                                     "with --socket pointing there?)")
    listing = list_namespaces(store, filters=filters, include_empty=True)
    if not listing.items:
        raise AdminError(
            f"no namespace in {listing.store} to ask the daemon about"
            + (" matches the filters" if listing.filters else "")
            + "; the daemon counts per namespace: pass --store (the daemon's --store) and "
            "-f model=... to choose"
        )
    out = []
    for e in listing.items:
        if not e.dtype:
            continue  # unreadable namespace record
        L, P, T, H, D = e.block_shape
        fields = NamespaceFields(e.model_id, e.model_revision, e.dtype, L, P, T, H, D,
                                 e.tp_rank, e.tp_size, e.format_version, e.extras)
        try:
            ch, hello = hello_namespace(sock, fields, client=f"kvstore stats pid {os.getpid()}")
        except AdminError as err:
            raise DaemonUnavailableError(f"namespace {e.namespace_id[:12]} ({e.model_id}): "
                                         f"{err}") from None
        try:
            r = ch.call(m.Stats())
        except (m.ServerError, ChannelClosed) as err:
            raise DaemonUnavailableError(f"the daemon at {sock} could not answer stats for "
                                         f"namespace {e.namespace_id[:12]} ({e.model_id}): "
                                         f"{err}") from None
        finally:
            ch.close()
        st = r.store
        out.append(DaemonNamespaceStats(hello.namespace_id.hex(), e.model_id, e.layout,
                                        st.hit_rate, st, r.server))
    return DaemonStats(sock, listing.store, time.time(), tuple(out))


def serving_daemon(store_path: str | os.PathLike[str] | None) -> str | None:
    """The socket of the ``kvstore serve`` daemon serving ``store_path`` (from its
    ``daemon.lock``), or ``None`` when no daemon holds that store. Never creates anything.

    Changes that must reach the daemon's memory (``rm``) go through :func:`daemon_remove`
    when this is not ``None``."""
    from kvstore.admin.common import resolve_store_path
    from kvstore.errors import ConfigError
    from kvstore.lockfile import read_daemon_lock

    try:
        record = read_daemon_lock(resolve_store_path(store_path))
    except ConfigError as e:
        raise AdminError(str(e)) from None
    return None if record is None else record.socket


def daemon_remove(socket: str | os.PathLike[str], namespace_id: bytes | str,
                  keys: Iterable[bytes | str] | None = None, *, timeout: float = 60.0) -> int:
    """Have the daemon at ``socket`` delete blocks of ``namespace_id`` (bytes or hex) from its
    memory (warm tier, dirty blocks not yet written included) and its disk: the named
    ``keys`` (bytes or hex; pass leaves first, descendants included, like
    ``RemovalPlan.keys``) or, with ``keys=None``, every block of the namespace. Returns how
    many blocks went; blocks a client holds pinned at that moment stay. Needs the daemon's
    uid or root; raises :class:`DaemonUnavailableError` when the daemon cannot be asked."""
    from kvstore.wire import messages as m
    from kvstore.wire.channel import Channel, ChannelClosed

    sock = os.path.abspath(os.path.expanduser(os.fspath(socket)))
    nsid = _id_bytes(namespace_id, "namespace_id")
    blobs: list[bytes] | None = None if keys is None else [_id_bytes(k, "key") for k in keys]
    if blobs is not None and not blobs:
        return 0
    try:
        ch = Channel.connect(sock, timeout)
    except OSError as e:
        raise DaemonUnavailableError(f"no daemon answers at {sock} ({e.strerror or e}); is "
                                     "'kvstore serve' running with --socket pointing there?") from None
    try:
        if blobs is None:
            return _remove_call(ch, sock, m.Remove(nsid, None))
        removed, i, batch = 0, 0, _REMOVE_BATCH
        while i < len(blobs):
            chunk = blobs[i : i + batch]
            try:
                removed += _remove_call(ch, sock, m.Remove(nsid, b"".join(chunk)))
            except m.ServerError as e:
                if e.code != m.ErrorCode.LIMIT or batch == 1 or ch.broken:
                    raise
                batch //= 2  # the daemon's --max-keys / --max-frame is smaller
                continue
            i += len(chunk)
        return removed
    except ChannelClosed as e:
        raise DaemonUnavailableError(f"the daemon at {sock} went away during the removal "
                                     f"({e}); blocks removed so far stay removed") from None
    finally:
        ch.close()


def _remove_call(ch, sock: str, req) -> int:
    from kvstore.wire import messages as m

    try:
        return ch.call(req).n
    except m.PermissionDeniedError as e:
        raise DaemonUnavailableError(f"the daemon at {sock} refused: {e}") from None
    except m.ServerError as e:
        if e.code == m.ErrorCode.HELLO_REQUIRED:
            raise DaemonUnavailableError(f"the daemon at {sock} does not support removals "
                                         "(it is older than this kvstore); upgrade it, or "
                                         "stop it and remove offline") from None
        if e.code == m.ErrorCode.LIMIT:
            raise
        raise DaemonUnavailableError(f"the daemon at {sock} could not remove: {e}") from None


def _id_bytes(v: bytes | str, what: str) -> bytes:
    b = bytes.fromhex(v) if isinstance(v, str) else bytes(v)
    if len(b) != 32:
        raise AdminError(f"{what} must be 32 bytes (64 hex digits), got {len(b)} bytes")
    return b
