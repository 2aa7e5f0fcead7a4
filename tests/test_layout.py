import pytest
import torch

from kvstore import KVLayout, LayoutError
from kvstore.layout import dtype_from_name, dtype_name


def test_block_geometry():
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert lay.block_shape == (32, 2, 16, 8, 128)
    assert lay.block_nbytes == 2 * 1024 * 1024  # Llama-3-8B: 2 MiB per 16-token block
    assert lay.bytes_per_token == 128 * 1024
    assert lay.layer_nbytes * 32 == lay.block_nbytes
    assert lay.batch_shape(3) == (3, 32, 2, 16, 8, 128)


def test_mla_layout():
    lay = KVLayout(num_layers=4, num_kv_heads=1, head_dim=576, kv_planes=1, dtype=torch.float16)
    assert lay.block_shape == (4, 1, 16, 1, 576)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_layers": 0}, "num_layers must be > 0"),
        ({"num_kv_heads": -1}, "num_kv_heads must be > 0"),
        ({"head_dim": 2.5}, "head_dim must be an int"),
        ({"block_tokens": True}, "block_tokens must be an int"),
        ({"kv_planes": 3}, "kv_planes must be 2"),
        ({"dtype": "bf16"}, "must be a torch.dtype"),
        ({"dtype": torch.complex64}, "not supported"),
    ],
)
def test_invalid_layouts(kw, match):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=4)
    base.update(kw)
    with pytest.raises(LayoutError, match=match):
        KVLayout(**base)


def test_dtype_names_round_trip():
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
        assert dtype_from_name(dtype_name(dt)) is dt
    with pytest.raises(LayoutError):
        dtype_from_name("float7")


def test_layout_is_frozen_and_hashable():
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4)
    with pytest.raises(AttributeError):
        lay.num_layers = 3  # type: ignore[misc]
    assert hash(lay) == hash(KVLayout(num_layers=2, num_kv_heads=2, head_dim=4))


def test_dtype_by_name_equals_the_torch_dtype():
    """A layout may name its dtype (what a torch-free caller, the CLI's daemon commands, does):
    it is the same layout, and ``dtype`` is still the torch dtype."""
    import pickle

    by_dtype = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    by_name = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16")
    assert by_name == by_dtype and hash(by_name) == hash(by_dtype)
    assert by_name.dtype is torch.float16 and by_name.dtype_name == "float16"
    assert by_name.block_nbytes == by_dtype.block_nbytes == 2 * 2 * 16 * 2 * 4 * 2
    assert KVLayout(num_layers=1, num_kv_heads=1, head_dim=1).dtype is torch.bfloat16
    assert repr(by_name) == ("KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, "
                             "dtype=torch.float16, block_tokens=16, kv_planes=2)")
    assert pickle.loads(pickle.dumps(by_dtype)) == by_dtype
    for dt, size in ((torch.float32, 4), (torch.float64, 8), (torch.int8, 1), (torch.half, 2)):
        assert KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=dt).itemsize == size
        assert KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=dt).dtype_name == \
            dtype_name(dt)
    with pytest.raises(AttributeError):
        by_name.dtype_name = "float32"  # type: ignore[misc]
