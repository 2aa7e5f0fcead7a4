"""``kvstore verify`` checks that each block's segment header gives the dtype and shape its
index record and the store's layout say (format.md, "Segment files"), not only its offset:
a header that lies about them while the bytes verify is a ``bad_header`` finding, which
``verify --fix`` repairs (the block rewritten into a fresh segment with a true header).

Regression: such a header passed verify (the checksum covers the bytes, not the header), so
any safetensors reader of the segment (and ``recover``, which trusts headers) was misled.
"""

from __future__ import annotations

import pytest
import torch
from conftest import bit_equal, keyed_kv

from kvstore import KVLayout, open_store
from kvstore.admin import verify
from kvstore.cli import main

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)


def opened(path):
    return open_store(path, layout=LAY, model_id="verify/header", device="cpu", gpu_capacity=0,
                      cpu_capacity=64 * LAY.block_nbytes, disk_capacity="64MiB")


def chain(s):
    return s.block_keys(list(range(3 * LAY.block_tokens)))


def lie_in_header(path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` in the first block entry of the only segment's header,
    keeping the header's length (JSON allows the trailing spaces)."""
    (seg,) = (path / "segments").glob("*.safetensors")
    data = bytearray(seg.read_bytes())
    n = int.from_bytes(data[:8], "little")
    head = bytes(data[8:8 + n])
    assert old in head and len(new) <= len(old)
    head = head.replace(old, new, 1)
    data[8:8 + n] = head + b" " * (n - len(head))
    seg.write_bytes(bytes(data))


@pytest.mark.parametrize("old,new,said", [
    (b'"dtype":"BF16"', b'"dtype":"F16"', "F16"),  # same size, another dtype
    (b'"shape":[2,2,4,2,8]', b'"shape":[2,2,8,2,4]', "[2, 2, 8, 2, 4]"),  # same size
])
def test_verify_reports_a_header_that_lies_about_dtype_or_shape_and_fix_repairs_it(
        tmp_path, old, new, said):
    with opened(tmp_path) as s:
        keys = chain(s)
        assert s.put(keys, keyed_kv(LAY, keys)).wait() == 3
        s.flush()
    lie_in_header(tmp_path, old, new)
    res = verify(tmp_path)
    bad = [f for f in res.findings if f.kind == "bad_header"]
    assert len(bad) == 1 and said in bad[0].detail and bad[0].action == "repair", res.findings
    assert "the block's bytes verify" in bad[0].detail
    assert main(["verify", "--store", str(tmp_path), "--fix", "-y", "--grace", "0"]) in (0, 1)
    assert verify(tmp_path).findings == ()
    with opened(tmp_path) as s:
        got = s.fetch(chain(s)).wait()
        assert got.shape[0] == 3 and bit_equal(got, keyed_kv(LAY, chain(s)))
