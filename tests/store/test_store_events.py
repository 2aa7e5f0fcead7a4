"""The store tells its event sink every block that joins or leaves a tier, in order: the
mirror built from those events is what the tiers hold (KV events, issue 19)."""

import threading

import torch
from conftest import keyed_kv

from kvstore import KVLayout, open_store

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
BN = LAY.block_nbytes


class Mirror:
    """An EventSink keeping the set of keys each tier holds, as a consumer would."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[str, set[bytes]] = {"hot": set(), "warm": set(), "disk": set()}
        self.parents: dict[bytes, bytes | None] = {}

    def stored(self, tier, keys, parents):
        with self.lock:
            assert len(keys) == len(parents)
            self.held[tier].update(keys)
            self.parents.update(zip(keys, parents, strict=True))

    def removed(self, tier, keys):
        with self.lock:
            for t in ([tier] if tier is not None else list(self.held)):
                self.held[t].difference_update(keys)

    def cleared(self, tier=None):
        with self.lock:
            for t in ([tier] if tier is not None else list(self.held)):
                self.held[t].clear()


def _truth(s) -> dict[str, set[bytes]]:
    st = s.state
    with st.lock:
        out = {"hot": set(st.hot.keys()) if st.hot is not None else set(),
               "warm": set(st.warm.keys()) if st.warm is not None else set()}
    disk = st.durable
    out["disk"] = ({r.key for r in disk.disk.records(st.namespace_id)} if disk is not None
                   else set())
    return out


def test_events_mirror_what_each_tier_holds(tmp_path):
    m = Mirror()
    with open_store(tmp_path, layout=LAY, model_id="ev/test", device="cpu", gpu_capacity=6 * BN,
                    cpu_capacity=10 * BN, disk_capacity=40 * BN, events=m) as s:
        chains = []
        for i in range(12):  # 12 x 5 blocks through 6 hot + 10 warm slots and a 40-block disk
            keys = s.block_keys(list(range(i * 1000, i * 1000 + 20)))
            s.put(keys, keyed_kv(LAY, keys)).wait()
            chains.append(keys)
            if i % 3 == 2:
                s.flush()
                assert m.held == _truth(s)
        s.flush()
        assert m.held == _truth(s)
        assert m.held["disk"] and m.held["warm"] and m.held["hot"]
        assert m.parents[chains[0][1]] == chains[0][0] and m.parents[chains[0][0]] is None
        s.evict(tier="hot")  # on-disk blocks just leave memory; the rest is demoted or goes
        s.evict(tier="warm")
        assert m.held == _truth(s)
        back = chains[-2]
        got = s.fetch(back).wait()  # back from disk into warm and hot
        s.flush()
        assert got.shape[0] == len(back) and m.held == _truth(s)
        assert set(back) <= m.held["warm"] | m.held["hot"]
        s.evict(back[2:])  # removed from the store: memory and disk
        s.flush()
        assert m.held == _truth(s) and not set(back[2:]) & m.held["disk"]
    assert not m.held["hot"] and not m.held["warm"]  # close: memory tiers cleared
    assert m.held["disk"]
