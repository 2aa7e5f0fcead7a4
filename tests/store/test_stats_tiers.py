"""Per-tier hit attribution across the wire and in Prometheus."""

from kvstore.daemon.metrics import DaemonMetrics
from kvstore.stats import StoreStats, TierStats
from kvstore.wire.stats import store_stats_from_wire, store_stats_to_wire


def _stats(*tiers: TierStats) -> StoreStats:
    zero = dict.fromkeys(("lookups", "hits", "misses", "fetches", "fetched_blocks",
                          "fetch_short", "puts", "put_blocks", "put_duplicates", "put_dropped",
                          "damaged", "dirty_dropped", "disk_write_dropped", "pinned_blocks",
                          "blocks", "dirty_blocks"), 0)
    return StoreStats(**zero, block_nbytes=1024, tiers=tiers)


def test_tier_hits_cross_the_wire_and_old_replies_read_as_zero():
    st = _stats(TierStats("warm", "cpu", 10, 5, 3, 0, hits=7, hit_bytes=7168),
                TierStats("disk", "/p", 100, 50, 30, 1, hits=2, hit_bytes=2048))
    back = store_stats_from_wire(store_stats_to_wire(st))
    assert back == st
    old = store_stats_to_wire(st)
    old["tiers"] = [t[:8] for t in old["tiers"]]  # a daemon from before per-tier hits
    assert [t.hits for t in store_stats_from_wire(old).tiers] == [0, 0]


def test_prometheus_has_hits_per_tier():
    st = _stats(TierStats("warm", "cpu", 10, 5, 3, 0, hits=7, hit_bytes=7168))
    m = DaemonMetrics(lambda: [("ns", "model", st)])
    from prometheus_client import generate_latest

    text = generate_latest(m.registry).decode()
    assert 'kvstore_hits_total{model="model",namespace="ns",tier="warm"} 7.0' in text
    assert 'kvstore_hit_bytes_total{model="model",namespace="ns",tier="warm"} 7168.0' in text


def test_read_misses_cross_the_wire_and_reach_prometheus_apart_from_damage():
    from dataclasses import replace

    st = replace(_stats(TierStats("disk", "/p", 100, 50, 30, 1)), damaged=2, read_misses=5)
    assert store_stats_from_wire(store_stats_to_wire(st)) == st
    old = store_stats_to_wire(st)
    del old["read_misses"]  # a daemon from before the split
    assert store_stats_from_wire(old).read_misses == 0
    from prometheus_client import generate_latest

    text = generate_latest(DaemonMetrics(lambda: [("ns", "model", st)]).registry).decode()
    assert 'kvstore_store_damaged_total{model="model",namespace="ns"} 2.0' in text
    assert 'kvstore_store_read_misses_total{model="model",namespace="ns"} 5.0' in text
