"""Counters of a running daemon (``kvstore stats --socket S``), through ``kvstore.client``.

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

if TYPE_CHECKING:
    from kvstore.server.messages import ServerStats
    from kvstore.stats import StoreStats

__all__ = [
    "DaemonNamespaceStats",
    "DaemonStats",
    "DaemonUnavailableError",
    "daemon_stats",
]


class DaemonUnavailableError(AdminError):
    """No daemon answering at the socket, or it refused a namespace."""


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
    ``store`` (the daemon's ``--path``) that passes ``filters`` (``kvstore ls`` filters)."""
    from kvstore import client
    from kvstore.admin.inventory import list_namespaces
    from kvstore.errors import KVStoreError
    from kvstore.layout import KVLayout, dtype_from_name
    sock = os.path.abspath(os.path.expanduser(os.fspath(socket)))
    if not os.path.exists(sock):
        raise DaemonUnavailableError(f"no daemon socket at {sock} (is 'kvstore serve' running "
                                     "with --socket pointing there?)")
    listing = list_namespaces(store, filters=filters, include_empty=True)
    if not listing.items:
        raise AdminError(
            f"no namespace in {listing.store} to ask the daemon about"
            + (" matches the filters" if listing.filters else "")
            + "; the daemon counts per namespace: pass --store (the daemon's --path) and "
            "-f model=... to choose"
        )
    out = []
    for e in listing.items:
        if not e.dtype:
            continue  # unreadable namespace record
        L, P, T, H, D = e.block_shape
        layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D,
                          dtype=dtype_from_name(e.dtype), block_tokens=T, kv_planes=P)
        try:
            c = client.connect(sock, layout=layout, model_id=e.model_id,
                               model_revision=e.model_revision or None, device="cpu",
                               tp_rank=e.tp_rank, tp_size=e.tp_size,
                               namespace_extras=dict(e.extras) or None, timeout=10.0)
        except (KVStoreError, OSError) as err:
            raise DaemonUnavailableError(f"the daemon at {sock} refused namespace "
                                         f"{e.namespace_id[:12]} ({e.model_id}): {err}") from err
        try:
            if not c.connected:
                raise DaemonUnavailableError(f"no daemon answers at {sock}")
            st = c.stats()
            srv = c.server_stats()
            nid = c.namespace_id.hex()
        finally:
            c.close()
        out.append(DaemonNamespaceStats(nid, e.model_id, e.layout, st.hit_rate, st, srv))
    return DaemonStats(sock, listing.store, time.time(), tuple(out))
