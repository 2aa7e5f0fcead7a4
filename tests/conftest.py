import pytest
import torch

from kvstore import KVLayout, open_store


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def small_layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_tokens=4)


@pytest.fixture
def make_store(small_layout):
    """Open in-memory stores with capacities in blocks; closes them at teardown."""
    opened = []

    def _make(hot_blocks=4, warm_blocks=8, layout=None, **kw):
        lay = layout or small_layout
        s = open_store(
            kw.pop("path", None), layout=lay, model_id=kw.pop("model_id", "test/model"),
            device="cpu", gpu_capacity=hot_blocks * lay.block_nbytes,
            cpu_capacity=warm_blocks * lay.block_nbytes, **kw,
        )
        opened.append(s)
        return s

    yield _make
    for s in opened:
        s.close()


def random_kv(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.batch_shape(n), generator=g).to(layout.dtype)
