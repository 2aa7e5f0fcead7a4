"""``kvstore recover`` trusts a segment header only as far as it can check it: a block whose
bytes verify is indexed only when its namespace's layout (from a namespace record that hashes
to its id) agrees with what the header says of it: raw bytes, dtype and shape. A header that
lies about them, or names another namespace (checksum recomputed for it), is skipped with a
``layout_mismatch`` finding; every other block is recovered.

Regression: recover indexed whatever such a header said (the checksum covers the bytes only).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import bit_equal, keyed_kv

from kvstore import KVLayout, open_store
from kvstore.tiers.disk import segments as seg
from kvstore.tiers.disk.recover import recover

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
OTHER = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16,
                 block_tokens=4)


def opened(path, layout=LAY, model="recover/trust"):
    return open_store(path, layout=layout, model_id=model, device="cpu", gpu_capacity=0,
                      cpu_capacity=64 * OTHER.block_nbytes, disk_capacity="64MiB")


def chain(s):
    return s.block_keys(list(range(3 * LAY.block_tokens)))


def header_of(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return data, n, json.loads(data[8:8 + n])


def rewrite(path, old: bytes, new: bytes) -> None:
    """``old`` -> ``new`` once in the header, its length kept (trailing spaces)."""
    data, n, _ = header_of(path)
    head = data[8:8 + n]
    assert old in head and len(new) <= len(old)
    head = head.replace(old, new, 1)
    path.write_bytes(data[:8] + head + b" " * (n - len(head)) + data[8 + n:])


def lie(tmp_path, how: str) -> None:
    with opened(tmp_path) as s:
        keys = chain(s)
        assert s.put(keys, keyed_kv(LAY, keys)).wait() == 3
        s.flush()
        last = keys[-1]
        ns_a = s.namespace_id
    (path,) = [p for p in (tmp_path / "segments").glob("*.safetensors")]
    if how == "dtype":
        rewrite(path, b'"dtype":"BF16"', b'"dtype":"F16"')  # the first block's entry
    elif how == "shape":
        rewrite(path, b'"shape":[2,2,4,2,8]', b'"shape":[2,2,8,2,4]')
    else:  # the last block's metadata names another namespace, checksum recomputed for it
        with opened(tmp_path, OTHER, "recover/other") as o:  # its record is in the index
            ks = o.block_keys(list(range(OTHER.block_tokens)))
            assert o.put(ks, keyed_kv(OTHER, ks)).wait() == 1
            o.flush()
            ns_b = o.namespace_id
        data, n, obj = header_of(path)
        b, e = obj[last.hex()]["data_offsets"]
        payload = data[8 + n + b:8 + n + e]
        meta = obj["__metadata__"][last.hex()]
        csum = meta.split(";")[2]
        forged = seg.block_checksum(last, ns_b, payload)
        rewrite(path, meta.encode(), meta.replace(ns_a.hex(), ns_b.hex())
                .replace(csum, f"{forged:016x}").encode())


@pytest.mark.parametrize("how,intact", [("dtype", 0), ("shape", 0), ("namespace", 2)])
def test_recover_skips_a_block_whose_header_lies_about_its_layout(tmp_path, how, intact):
    lie(tmp_path, how)
    res = recover(tmp_path, force=True)
    lied = [f for f in res.findings if f.kind == "layout_mismatch"]
    assert len(lied) == 1 and res.blocks_bad == 1 and not res.ok, res.findings
    with opened(tmp_path) as s:
        keys = chain(s)
        got = s.fetch(keys).wait()  # what was recovered is true; nothing after a gap
        assert got.shape[0] == intact and bit_equal(got, keyed_kv(LAY, keys[:intact]))
    if how == "namespace":
        with opened(tmp_path, OTHER, "recover/other") as o:
            assert o.lookup([bytes(keys[-1])]) == 0  # never indexed under the other namespace
            ks = o.block_keys(list(range(OTHER.block_tokens)))
            assert o.lookup(ks) == 1  # its own block is recovered
