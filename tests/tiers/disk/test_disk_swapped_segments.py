"""Two segment files swapped (each one's bytes under the other's name): every read of their
blocks fails its checksum (bound to key and namespace), so nothing wrong is served, and the
damage path drops those entries; but the files, which hold the other segment's intact
blocks, are kept (``<id>.quarantined``) so that ``kvstore recover --force`` restores them.

Regression: the damage drop unlinked each file once its last record was dropped, deleting
the other segment's intact blocks with it; recover had nothing left to restore.
"""

from __future__ import annotations

import os

import torch
from conftest import bit_equal, keyed_kv

from kvstore import KVLayout, open_store
from kvstore.cli import main
from kvstore.tiers.disk.recover import recover

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
BN = LAY.block_nbytes


def opened(path):
    return open_store(path, layout=LAY, model_id="swapped/segments", device="cpu",
                      gpu_capacity=0, cpu_capacity=64 * BN, disk_capacity="64MiB")


def two_chains(s):
    return [s.block_keys([c * 1000 + t for t in range(4 * LAY.block_tokens)]) for c in (1, 2)]


def test_swapped_segment_files_are_kept_for_recover_and_never_served(tmp_path, capsys):
    with opened(tmp_path) as s:
        for ks in two_chains(s):
            assert s.put(ks, keyed_kv(LAY, ks)).wait() == 4
            s.flush()  # a segment each
    segdir = tmp_path / "segments"
    a, b = sorted(segdir.glob("*.safetensors"))
    tmp = segdir / "swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    with opened(tmp_path) as s:
        for ks in two_chains(s):
            for k in ks:  # every block read once: none serves the other segment's bytes
                assert s.fetch([k]).wait().shape[0] == 0
        assert s.stats().damaged == 8
        assert s.lookup(two_chains(s)[0]) == 0
    kept = sorted(p.name for p in segdir.iterdir())
    assert kept == sorted(p.name.replace(".safetensors", ".quarantined") for p in (a, b))
    assert main(["verify", "--store", str(tmp_path), "--format", "json"]) == 1  # reported
    assert "quarantined_segment" in capsys.readouterr().out
    res = recover(tmp_path, force=True)
    assert res.blocks_recovered == 8, res.findings
    with opened(tmp_path) as s:
        for ks in two_chains(s):
            got = s.fetch(ks).wait()
            assert got.shape[0] == 4 and bit_equal(got, keyed_kv(LAY, ks))
    assert sorted(p.name for p in segdir.iterdir()) == sorted([a.name, b.name])
    assert main(["verify", "--store", str(tmp_path)]) == 0
