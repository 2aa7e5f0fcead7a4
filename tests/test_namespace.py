import pytest
import torch

from kvstore import ConfigError, KVLayout
from kvstore.namespace import Namespace

LAY = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_tokens=16)


def test_golden_namespace():
    ns = Namespace.create("meta-llama/Llama-3.1-8B", LAY)
    assert ns.canonical_bytes().hex() == (
        "98b36b7673746f72652d6e616d6573706163652f3101b76d6574612d6c6c616d612f4c6c616d612d332e"
        "312d3842a0a862666c6f617431369520021008cc8092000190"
    )
    assert ns.id.hex() == "cdfcb2be56b7fe97d36c7985d3a487c0e4ff0c3b9a8b0a5b1109894e9dc7bb53"
    ns2 = Namespace.create("meta-llama/Llama-3.1-8B", LAY, model_revision="abc123", tp_rank=1,
                           tp_size=2, extras={"lora": "x", "b": b"\x01"})
    assert ns2.id.hex() == "880a40ecdca616371d42ea291202becfe4bc17bc1da61174931171ab3ed953d6"


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"layout": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.float16)},
        {"layout": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=32)},
        {"layout": KVLayout(num_layers=31, num_kv_heads=8, head_dim=128)},
        {"model_revision": "r2"},
        {"tp_rank": 1, "tp_size": 2},
        {"extras": {"lora": "adapter-1"}},
    ],
)
def test_anything_that_changes_bytes_changes_namespace(change):
    base = dict(model_id="m", layout=LAY)
    other = dict(base, **change)
    mid = other.pop("model_id")
    lay = other.pop("layout")
    assert Namespace.create(mid, lay, **other).id != Namespace.create("m", LAY).id


def test_extras_order_does_not_matter():
    a = Namespace.create("m", LAY, extras={"a": 1, "b": "x"})
    b = Namespace.create("m", LAY, extras={"b": "x", "a": 1})
    assert a.id == b.id


@pytest.mark.parametrize(
    "kw",
    [{"model_id": ""}, {"tp_rank": 2, "tp_size": 2}, {"tp_size": 0}, {"extras": {1: "x"}},
     {"extras": {"a": [1]}}],
)
def test_invalid_namespace(kw):
    args = dict(model_id="m")
    args.update(kw)
    mid = args.pop("model_id")
    with pytest.raises(ConfigError):
        Namespace.create(mid, LAY, **args)
