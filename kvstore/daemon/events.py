"""The daemon's KV events (``kvstore serve --kv-events``, options in
:mod:`kvstore.daemon.event_options`): its publisher, the disk inventory it announces at
start, and the tier changes its request handlers report.

A daemon's stream starts with ``AllBlocksCleared`` and then announces every block already on
disk (every namespace, opened or not: a lookup would find them), parents before children.
After that the handlers report what they change: committed puts and leased or prefetched
blocks (warm), evictions and admin removals, and a namespace's warm tier when it is closed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from kvstore.events.config import EventsConfig
from kvstore.events.publisher import EventPublisher, NamespaceSink
from kvstore.keys import BlockKey
from kvstore.namespace import Namespace

log = logging.getLogger("kvstore.daemon")


def _chains(parent_of: dict[bytes, bytes | None]) -> tuple[list[bytes], list[bytes | None]]:
    """``parent_of``'s keys, parents first and each chain in a row (depth-first)."""
    children: dict[bytes, list[bytes]] = {}
    roots: list[bytes] = []
    for k, p in parent_of.items():
        if p is not None and p in parent_of:
            children.setdefault(p, []).append(k)
        else:
            roots.append(k)
    keys: list[bytes] = []
    stack = list(reversed(roots))
    while stack:
        k = stack.pop()
        keys.append(k)
        stack.extend(reversed(children.get(k, ())))
    return keys, [parent_of[k] for k in keys]


class DaemonEvents:
    """The publisher and the sinks of the daemon's namespaces."""

    def __init__(self, config: EventsConfig) -> None:
        self.publisher = EventPublisher(config)
        log.info("KV events on %s (replay and snapshots on %s)", self.publisher.endpoint,
                 self.publisher.replay_endpoint)

    def sink(self, ns: Namespace) -> NamespaceSink:
        """The sink of a namespace the daemon opens; :meth:`release` it once closed."""
        return self.publisher.acquire(ns.id, ns.layout.block_tokens)

    def release(self, namespace_id: bytes) -> None:
        self.publisher.release(namespace_id)

    def announce_disk(self, path: Path, namespace_id: bytes | None = None) -> int:
        """Announce every block on the store's disk (of one namespace, or all); returns how
        many (blocking: run it on a worker, before clients can change the disk)."""
        from kvstore.admin.common import StoreNotFoundError, open_disk

        n = 0
        try:
            with open_disk(path, readonly=True) as disk:
                for info in disk.namespaces():
                    if namespace_id is not None and info.namespace_id != namespace_id:
                        continue
                    parent_of = {r.key: r.parent for r in disk.records(info.namespace_id)}
                    if not parent_of:
                        continue
                    keys, parents = _chains(parent_of)
                    sink = self.publisher.sink(info.namespace_id, info.block_tokens)
                    sink.stored("disk", [BlockKey(k) for k in keys],
                                [None if p is None else BlockKey(p) for p in parents])
                    n += len(keys)
        except StoreNotFoundError:
            return 0  # a new store: nothing on disk yet
        log.info("announced %d block(s) on disk", n)
        return n

    def sink_of(self, namespace_id: bytes) -> NamespaceSink | None:
        return self.publisher.sink_of(namespace_id)

    def close(self) -> None:
        self.publisher.flush(5.0)
        self.publisher.close()


def report_evicted(sink: NamespaceSink | None, keys: Sequence[BlockKey] | None,
                   tier: str | None) -> None:
    """``evict(keys, tier)`` ran (``tier="hot"`` is nothing here: the daemon has no hot tier)."""
    if sink is None or tier == "hot":
        return
    if keys is None:
        sink.cleared(tier)
    else:
        sink.removed(tier, keys)
