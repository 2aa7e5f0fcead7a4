"""``kvstore stats``: counters of a store path, or of a running daemon (``--socket``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.commands.output import EXIT_OK, emit_json, kv_grid, out_console, size


def daemon_store_path(sock_path: str) -> Path | None:
    """The store a ``kvstore serve`` at ``sock_path`` serves, or None when this cannot tell.

    The daemon holds ``<store>/daemon.lock`` open for its life, and the lock names its
    socket: the daemon's pid (the socket peer's credentials) leads to the lock among its open
    files. Needs the daemon's uid or root, as every admin operation does.
    """
    from kvstore.lockfile import LOCK_NAME, read_daemon_lock

    sock = os.path.abspath(os.path.expanduser(sock_path))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(sock)
            cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", cred)[0]
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (OSError, AttributeError):
        return None
    links = []
    for fd in fds:  # the daemon opens and closes files meanwhile: a vanished fd is no answer
        with contextlib.suppress(OSError):
            links.append(os.readlink(fd))
    for target in links:
        if os.path.basename(target) != LOCK_NAME:
            continue
        store = Path(target).parent
        try:
            record = read_daemon_lock(store)
        except Exception:  # an unreadable lock: not this daemon's to name
            continue
        if record is not None and os.path.abspath(record.socket) == sock:
            return store
    return None


def _store_renderable(res, stamp: str):
    from rich.console import Group
    from rich.table import Table

    kv = kv_grid((("blocks", str(res.blocks)), ("stored", size(res.stored_bytes)),
                  ("raw", size(res.raw_bytes)), ("segments", str(res.segments)),
                  ("segment files", size(res.segment_bytes)),
                  ("dead", size(res.dead_bytes)), ("hits (persisted)", str(res.hits))))
    t = Table(box=None, header_style="bold", pad_edge=False)
    for c, j in (("NAMESPACE", "left"), ("MODEL", "left"), ("BLOCKS", "right"),
                 ("SIZE", "right"), ("HITS", "right")):
        t.add_column(c, justify=j, no_wrap=True)
    for n in res.namespaces:
        t.add_row(n.namespace_id[:12], n.model_id or "?", str(n.blocks),
                  size(n.stored_bytes), str(n.hits))
    return Group(f"[bold]{res.store}[/bold] at {stamp}", kv, "", t)


def _namespace_parts(n) -> list[Any]:
    from rich.table import Table

    st = n.stats
    rows = [("lookups", str(st.lookups)), ("hits / misses (blocks)", f"{st.hits} / {st.misses}"),
            ("hit rate", f"{n.hit_rate:.1%}"), ("fetched blocks", str(st.fetched_blocks)),
            ("put blocks", str(st.put_blocks)), ("put dropped", str(st.put_dropped)),
            ("damaged", str(st.damaged)), ("read misses (not damage)", str(st.read_misses)),
            ("pinned blocks", str(st.pinned_blocks)),
            ("dirty blocks", str(st.dirty_blocks))]
    if n.server is not None:
        sv = n.server
        rows += [("connections (daemon)", str(sv.connections)), ("leases", str(sv.leases)),
                 ("free warm slots", f"{sv.free_warm_slots} of {sv.warm_slots}")]
    t = Table(box=None, header_style="bold", pad_edge=False)
    for c, j in (("TIER", "left"), ("DEVICE", "left"), ("USED", "right"),
                 ("CAPACITY", "right"), ("BLOCKS", "right"), ("EVICTIONS", "right"),
                 ("POLICY", "left")):
        t.add_column(c, justify=j, no_wrap=True)
    for tier in st.tiers:
        t.add_row(tier.name, tier.device, size(tier.used_bytes), size(tier.capacity_bytes),
                  str(tier.blocks), str(tier.evictions),
                  (f"{tier.policy} ({tier.policy_state})" if tier.policy_state else tier.policy)
                  or "-")
    return ["", f"[bold]{n.model_id}[/bold] {n.layout} (namespace {n.namespace_id[:12]})",
            kv_grid(rows), t]


def stats_renderable(res):
    from rich.console import Group

    from kvstore.admin import PathStats

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(res.time))
    if isinstance(res, PathStats):
        return _store_renderable(res, stamp)
    parts: list[Any] = [f"[bold]daemon {res.socket}[/bold] at {stamp} (store {res.store})"]
    for n in res.namespaces:
        parts += _namespace_parts(n)
    return Group(*parts)


def run_stats(args: argparse.Namespace) -> int:
    from kvstore.admin import daemon_stats, store_stats

    filters = args.filter or ()
    store = args.store
    if args.socket and store is None:  # the daemon's own store, not the default one
        store = daemon_store_path(args.socket)  # None (cannot tell): the default store

    def sample():
        if args.socket:
            return daemon_stats(args.socket, store, filters=filters)
        return store_stats(store, filters=filters)

    if args.watch is None:
        res = sample()
        if args.format == "json":
            emit_json("stats", res)
        else:
            out_console().print(stats_renderable(res))
        return EXIT_OK
    n = 0
    con = out_console()
    while True:
        res = sample()
        if args.format == "json":
            emit_json("stats", res, indent=None)
            sys.stdout.flush()
        else:
            if con.is_terminal:
                con.clear()
            else:
                con.rule()
            con.print(stats_renderable(res))
        n += 1
        if args.count is not None and n >= args.count:
            return EXIT_OK
        time.sleep(max(0.1, args.watch))
