"""The vLLM worker side's pieces that need no vLLM (the engine tests are in tests/vllm)."""

from __future__ import annotations

from kvstore.integrations.vllm.worker import openmp_spin_hint

_GOMP = "7f00-7f10 r-xp 00000000 00:00 1 /venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1\n"


def test_openmp_spin_hint_names_the_knob_under_libgomp_defaults():
    hint = openmp_spin_hint({}, _GOMP)
    assert hint is not None and "GOMP_SPINCOUNT=10000" in hint and "docs/vllm.md" in hint


def test_openmp_spin_hint_is_quiet_when_the_spin_is_set_or_no_libgomp():
    assert openmp_spin_hint({"GOMP_SPINCOUNT": "10000"}, _GOMP) is None
    assert openmp_spin_hint({"OMP_WAIT_POLICY": "passive"}, _GOMP) is None
    assert openmp_spin_hint({}, "7f00-7f10 r-xp 0 00:00 1 /usr/lib/libiomp5.so\n") is None


def test_daemon_mode_refuses_a_socket_nobody_serves_unless_told_to_wait(tmp_path):
    """Issue 31: a mistyped socket is an error at engine start; ``wait_for_daemon`` is for a
    daemon starting with the engine."""
    import pytest

    from kvstore import KVLayout
    from kvstore.errors import DaemonUnavailableError
    from kvstore.integrations.vllm.config import ConnectorConfig
    from kvstore.integrations.vllm.store_registry import open_connector_store, release_store

    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", block_tokens=4)
    kw = dict(layout=lay, model_id="m", model_revision="", ns_extras={}, page_kind="cpu",
              is_scheduler=True)
    sock = str(tmp_path / "typo.sock")
    with pytest.raises(DaemonUnavailableError, match="typo.sock"):
        open_connector_store(ConnectorConfig.from_extra({"socket": sock}), **kw)
    c = ConnectorConfig.from_extra({"socket": sock, "wait_for_daemon": True})
    store, key = open_connector_store(c, **kw)
    try:
        assert not store.connected and store.lookup(store.block_keys(list(range(8)))) == 0
    finally:
        release_store(key)


def test_issue29_switches_default_on_and_must_be_booleans():
    import pytest

    from kvstore.errors import ConfigError
    from kvstore.integrations.vllm.config import ConnectorConfig

    c = ConnectorConfig.from_extra({"store_path": "/x"})
    assert c.save_decode_blocks is True and c.load_async is True
    off = ConnectorConfig.from_extra({"store_path": "/x", "save_decode_blocks": False,
                                      "load_async": False})
    assert off.save_decode_blocks is False and off.load_async is False
    with pytest.raises(ConfigError, match="save_decode_blocks"):
        ConnectorConfig.from_extra({"store_path": "/x", "save_decode_blocks": "no"})


def test_tp_rank_keys_are_rank_0s_or_distinct_per_rank_and_keep_the_chain():
    """Issue 29 item 3: the scheduler's keys (rank 0's namespace) as each rank's keys."""
    from kvstore.integrations.vllm.config import rank_keys

    keys = [bytes([i]) * 32 for i in range(1, 4)]
    parent = b"\x09" * 32
    assert rank_keys(keys, parent, b"\x00" * 32, 0) == (keys, parent)
    k1, p1 = rank_keys(keys, parent, b"\x01" * 32, 1)
    k2, p2 = rank_keys(keys, parent, b"\x02" * 32, 2)
    assert len({*k1, *k2, *keys}) == 9 and all(len(k) == 32 for k in k1)
    assert rank_keys(keys, parent, b"\x01" * 32, 1) == (k1, p1)  # deterministic
    # the chain keeps its links: a run's parent maps to the previous run's last key
    assert rank_keys(keys[2:], keys[1], b"\x01" * 32, 1)[1] == k1[1]
    assert p1 != p2 and rank_keys(keys, None, b"\x01" * 32, 1)[1] is None
