"""The daemon's metrics in Prometheus text format (``prometheus_client``, own registry).

Request counts and latencies, errors by code, lookup hits and misses, blocks and bytes moved
through shared memory are counted as they happen; per-namespace tier occupancy, evictions
and store counters are read from ``Store.stats()`` at scrape time. Exposed on an HTTP port
bound to 127.0.0.1, or written to a file periodically (atomically: temp file + rename), and
summarised in every ``stats`` reply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.stats import StoreStats

if TYPE_CHECKING:  # the publisher (and zmq) only where --kv-events asks for it
    from kvstore.events.publisher import PublisherStats

log = logging.getLogger("kvstore.daemon.metrics")
_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                    50e-3, 100e-3, 250e-3, 1.0, 5.0)

#: (namespace label, model id, stats) for every open namespace
Snapshot = Callable[[], Iterable[tuple[str, str, StoreStats]]]
#: the KV event publisher's counters (``kvstore serve --kv-events``)
EventsStats = Callable[[], "PublisherStats"]


class _EventsCollector(Collector):
    """The KV event publisher's counters, read at scrape time."""

    _COUNTERS = (("batches", "KV event batches published"), ("events", "KV events published"),
                 ("replays", "Replay requests answered"),
                 ("snapshots", "Snapshot requests answered"),
                 ("bad_requests", "Malformed replay/snapshot requests"),
                 ("abandoned_replies", "Replies cut off because the client did not read them"))
    _GAUGES = (("last_seq", "Sequence number of the last batch published"),
               ("blocks", "Blocks the published events say are held (per namespace, summed)"),
               ("queued", "Tier changes not yet turned into events"))

    def __init__(self, stats: EventsStats) -> None:
        self._stats = stats

    def collect(self):  # prometheus_client's protocol
        try:
            st = self._stats()
        except Exception:  # a scrape must not fail because the publisher is closing
            log.debug("events stats failed", exc_info=True)
            return
        for name, help_ in self._COUNTERS:
            fam = CounterMetricFamily(f"kvstore_events_{name}", help_)
            fam.add_metric([], getattr(st, name))
            yield fam
        for name, help_ in self._GAUGES:
            fam = GaugeMetricFamily(f"kvstore_events_{name}", help_)
            fam.add_metric([], getattr(st, name))
            yield fam


class _StoreCollector(Collector):
    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self):  # prometheus_client's protocol
        labels = ["namespace", "model"]
        tier_labels = [*labels, "tier"]
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes held by a tier", labels=tier_labels)
        cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity of a tier", labels=tier_labels)
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks held by a tier", labels=tier_labels)
        evict = CounterMetricFamily("kvstore_tier_evictions", "Blocks evicted from a tier",
                                    labels=tier_labels)
        hits = CounterMetricFamily("kvstore_hits", "Blocks served from a tier (fetch or lease)",
                                   labels=tier_labels)
        hit_bytes = CounterMetricFamily("kvstore_hit_bytes", "Bytes served from a tier",
                                        labels=tier_labels)
        counters = {
            name: CounterMetricFamily(f"kvstore_store_{name}", help_, labels=labels)
            for name, help_ in (
                ("hits", "Blocks lookup found"), ("misses", "Blocks lookup did not find"),
                ("fetched_blocks", "Blocks fetched"), ("put_blocks", "Blocks stored by put"),
                ("put_dropped", "Blocks a put could not store"),
                ("damaged", "Blocks whose bytes were corrupt or gone (served as misses)"),
                ("read_misses", "Blocks a lower tier held at lookup but could not read then, "
                 "not damage (removed since, or out of descriptors)"),
                ("dirty_dropped", "Blocks evicted before they reached disk"),
                ("disk_write_dropped", "Disk writes that failed or were dropped"),
            )
        }
        pinned = GaugeMetricFamily("kvstore_store_pinned_blocks", "Pinned blocks", labels=labels)
        try:
            snap = list(self._snapshot())
        except Exception:  # a scrape must not fail because a store is closing
            log.debug("metrics snapshot failed", exc_info=True)
            snap = []
        for ns, model, st in snap:
            for t in st.tiers:
                lv = [ns, model, t.name]
                used.add_metric(lv, t.used_bytes)
                cap.add_metric(lv, t.capacity_bytes)
                blocks.add_metric(lv, t.blocks)
                evict.add_metric(lv, t.evictions)
                hits.add_metric(lv, t.hits)
                hit_bytes.add_metric(lv, t.hit_bytes)
            for name, fam in counters.items():
                fam.add_metric([ns, model], getattr(st, name))
            pinned.add_metric([ns, model], st.pinned_blocks)
        yield from (used, cap, blocks, evict, hits, hit_bytes, pinned, *counters.values())


class DaemonMetrics:
    """Every metric of one daemon, in its own registry."""

    def __init__(self, snapshot: Snapshot | None = None,
                 events: EventsStats | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvstore_requests", "Requests answered", ["op"], registry=r)
        self.latency = Histogram("kvstore_request_seconds",
                                 "Time from a request's arrival to its reply being queued",
                                 ["op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.errors = Counter("kvstore_errors", "Error replies sent", ["code"], registry=r)
        self.lookup_blocks = Counter("kvstore_lookup_blocks", "Blocks asked for by lookups",
                                     ["result"], registry=r)
        self.leased_blocks = Counter("kvstore_fetch_blocks", "Blocks leased to clients by fetch",
                                     registry=r)
        self.leased_bytes = Counter("kvstore_fetch_bytes",
                                    "Bytes leased to clients through shared memory", registry=r)
        self.put_blocks = Counter("kvstore_put_blocks", "Blocks committed by clients' puts",
                                  registry=r)
        self.put_bytes = Counter("kvstore_put_bytes",
                                 "Bytes committed through shared memory", registry=r)
        self.aborted_blocks = Counter("kvstore_put_aborted_blocks",
                                      "Granted blocks given back (abort or client gone)",
                                      registry=r)
        self.connections = Gauge("kvstore_connections", "Open client connections", registry=r)
        self.refused = Counter("kvstore_connections_refused",
                               "Connections refused (uid, version, limits)", ["reason"], registry=r)
        self.namespaces = Gauge("kvstore_namespaces", "Open namespaces (stores)", registry=r)
        self._by_op: dict[str, tuple] = {}
        self.lookup_hit = self.lookup_blocks.labels("hit")
        self.lookup_miss = self.lookup_blocks.labels("miss")
        self.total_requests = 0
        self.total_errors = 0
        if snapshot is not None:
            r.register(_StoreCollector(snapshot))
        if events is not None:
            r.register(_EventsCollector(events))
        self._http = None
        self._stop = threading.Event()

    # -- recording ----------------------------------------------------------------------------
    def observe(self, op: str, seconds: float) -> None:
        self.total_requests += 1
        children = self._by_op.get(op)
        if children is None:  # ops are the known ones: the dict stays small
            children = self._by_op[op] = (self.requests.labels(op), self.latency.labels(op))
        children[0].inc()
        children[1].observe(seconds)

    def error(self, code: int) -> None:
        self.total_errors += 1
        self.errors.labels(str(int(code))).inc()

    # -- exposition ---------------------------------------------------------------------------
    def write_file(self, path: Path) -> None:
        write_to_textfile(str(path), self.registry)

    def start_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (port 0: any free one); returns the port."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = server
        return server.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
