"""kvstore replay --engines: a trace through N real stores behind a router on their events."""

import json

import pytest

from kvstore.cli import main
from kvstore.errors import ConfigError
from kvstore.replay import StoreSpec
from kvstore.replay.driver import replay_layout, replay_namespace
from kvstore.replay.fleet import FleetSpec, replay_fleet
from kvstore.replay.fleet_report import FleetPlan, run_fleet_report
from kvstore.replay.report import parse_capacity
from kvstore.replay.trace import store_keys
from kvstore.replay.workloads import ChatWorkload, chat_trace

BN = replay_layout(512).block_nbytes


@pytest.fixture(scope="module")
def chat():
    trace = chat_trace(ChatWorkload(requests=300, seed=5, rate_per_s=0.5))
    return trace, store_keys(trace, replay_namespace(512).id, 512)


def fleet(chat, router, engines=3, blocks=120, **kw):
    trace, keys = chat
    return replay_fleet(trace, FleetSpec(engines, router, StoreSpec("reuse", blocks * BN), **kw),
                        keys)


@pytest.fixture(scope="module")
def results(chat):
    return {r: fleet(chat, r) for r in ("round-robin", "hash", "prefix")}


def test_every_request_is_served_once_and_bytes_are_right(chat, results):
    trace, keys = chat
    refs = sum(len(k) for k in keys)
    for r in results.values():
        assert sum(e.requests for e in r.per_engine) == len(trace.requests)
        assert r.references == refs and r.wrong_blocks == 0
        assert r.hits == sum(e.hit_blocks for e in r.per_engine)
        assert 0 <= r.hit_ratio <= 1 and r.max_over_mean >= 1.0


def test_the_index_tells_the_router_exactly_what_each_store_holds(results):
    # the router's cached_blocks for the chosen engine comes from the events alone
    assert results["prefix"].mispredicted == 0
    assert results["prefix"].exploit > 0


def test_round_robin_spreads_evenly_and_prefix_routing_finds_more(results):
    rr = results["round-robin"]
    counts = [e.requests for e in rr.per_engine]
    assert max(counts) - min(counts) <= 1
    # conversations come back: only a router that follows their prefix finds them
    assert results["prefix"].hit_ratio > 1.2 * rr.hit_ratio  # 1.35x here
    assert results["prefix"].max_over_mean <= 1.25


def test_deterministic(chat, results):
    again = fleet(chat, "prefix")
    assert (again.hits, [e.requests for e in again.per_engine]) == (
        results["prefix"].hits, [e.requests for e in results["prefix"].per_engine])


def test_one_engine_is_one_store(chat):
    a, b = fleet(chat, "prefix", engines=1), fleet(chat, "round-robin", engines=1)
    assert a.hits == b.hits and a.max_over_mean == 1.0


def test_fleet_with_disk_tiers(chat, tmp_path):
    trace, keys = chat
    spec = StoreSpec("reuse", 40 * BN, disk_bytes=400 * BN, path=str(tmp_path))
    r = replay_fleet(trace, FleetSpec(2, "prefix", spec), keys)
    # the disk writer reports what it wrote from its own thread, as it goes: the router may
    # decide between a write and its event, as across processes
    assert r.wrong_blocks == 0 and r.mispredicted <= 0.05 * r.requests
    assert {t.name for t in r.per_engine[0].tiers} >= {"warm", "disk"}
    assert list(tmp_path.iterdir()) == []  # the fleet's stores are removed afterwards


def test_report_rows(chat):
    trace, _ = chat
    rep = run_fleet_report(trace, FleetPlan(2, (parse_capacity("5%"), parse_capacity("10%")),
                                            routers=("round-robin", "prefix")))
    assert [(r.capacity, r.eviction) for r in rep.rows] == [("5%", "adaptive"), ("10%", "adaptive")]
    assert rep.rows[1].of("prefix").hits >= rep.rows[0].of("prefix").hits
    assert rep.rows[0].of("hash") is None


@pytest.mark.parametrize("kw, match", [
    ({"engines": 0, "router": "prefix"}, "at least one engine"),
    ({"engines": 2, "router": "best"}, "unknown router"),
])
def test_bad_specs(kw, match):
    with pytest.raises(ConfigError, match=match):
        FleetSpec(store=StoreSpec("reuse", BN), **kw)


def test_cli_json(capsys):
    assert main(["replay", "--chat", "120", "--engines", "2", "--capacity", "10%",
                 "--router", "round-robin,prefix", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "kvstore.replay-fleet/1"
    assert out["engines"] == 2 and out["routers"] == ["round-robin", "prefix"]
    res = {r["router"]: r for r in out["rows"][0]["results"]}
    assert res["prefix"]["wrong_blocks"] == 0 and len(res["prefix"]["per_engine"]) == 2


def test_cli_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "fleet.png"
    assert main(["replay", "--chat", "80", "--engines", "2", "--capacity", "10%",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "VS ROUND-ROBIN" in out and "prefix" in out and "hash" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, msg", [
    (["--engines", "2", "--simulate-only"], "--simulate-only does not apply"),
    (["--engines", "2", "--router", "nearest"], "unknown router"),
    (["--engines", "0"], "--engines"),
    (["--engines", "2", "--imbalance", "-1"], "--imbalance"),
])
def test_usage_errors_exit_2(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        rc = main(["replay", "--chat", "20", *argv])
        raise SystemExit(rc)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
