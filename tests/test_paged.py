"""load_into / save_from against a per-layer paged cache (vLLM flash-attention layout)."""

import pytest
import torch
from conftest import random_kv

from kvstore import KVLayout, TensorMismatchError, open_store

LAY = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_tokens=8)


def pages_for(num_pages, page_size, lay=LAY, fill=float("nan")):
    return [torch.full((lay.kv_planes, num_pages, page_size, lay.num_kv_heads, lay.head_dim), fill,
                       dtype=lay.dtype) for _ in range(lay.num_layers)]


def expected_page(kv_block, layer, j, page_size):
    """Page j of a block: tokens [j*ps, (j+1)*ps) of every plane."""
    return kv_block[layer][:, j * page_size : (j + 1) * page_size]


@pytest.mark.parametrize("page_size", [2, 4, 8])
def test_load_into_scatters_exactly_the_named_pages(page_size):
    with open_store(None, layout=LAY, model_id="p", device="cpu", gpu_capacity="1MiB",
                    cpu_capacity="1MiB") as s:
        keys = s.block_keys(list(range(3 * 8)))
        kv = random_kv(LAY, 3)
        s.put(keys, kv).wait()
        ppb = 8 // page_size
        pages = pages_for(20, page_size)
        ids = torch.randperm(20)[: 3 * ppb]
        t = s.load_into(keys, pages, ids.tolist())
        assert t.wait() == 3
        for layer in range(LAY.num_layers):
            t.wait_layer(layer)
            for b in range(3):
                for j in range(ppb):
                    got = pages[layer][:, ids[b * ppb + j]]
                    assert torch.equal(got, expected_page(kv[b], layer, j, page_size))
        untouched = sorted(set(range(20)) - set(ids.tolist()))
        for layer in range(LAY.num_layers):
            assert torch.isnan(pages[layer][:, untouched]).all()


def test_load_into_stops_at_miss_and_leaves_later_pages_alone():
    with open_store(None, layout=LAY, model_id="p", device="cpu", cpu_capacity="1MiB") as s:
        keys = s.block_keys(list(range(4 * 8)))
        s.put(keys[:2], random_kv(LAY, 2)).wait()
        pages = pages_for(8, 8)
        assert s.load_into(keys, pages, [0, 1, 2, 3]).wait() == 2
        assert torch.isnan(pages[0][:, 2:]).all() and not torch.isnan(pages[0][:, :2]).any()


def test_save_from_round_trip():
    with open_store(None, layout=LAY, model_id="p", device="cpu", cpu_capacity="1MiB") as s:
        keys = s.block_keys(list(range(2 * 8)))
        src = [torch.randn(2, 10, 4, 2, 4) for _ in range(3)]
        ids = [7, 2, 9, 0]
        assert s.save_from(src, ids, keys).wait() == 2
        dst = pages_for(10, 4)
        assert s.load_into(keys, dst, ids).wait() == 2
        for layer in range(3):
            assert torch.equal(dst[layer][:, ids], src[layer][:, ids])


def test_mla_pages_without_plane_axis():
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, kv_planes=1, dtype=torch.float16,
                   block_tokens=4)
    with open_store(None, layout=lay, model_id="mla", device="cpu", cpu_capacity="1MiB") as s:
        keys = s.block_keys(list(range(8)))
        kv = random_kv(lay, 2)
        s.put(keys, kv).wait()
        pages = [torch.zeros(6, 2, 1, 8, dtype=torch.float16) for _ in range(2)]
        assert s.load_into(keys, pages, [5, 1, 3, 0]).wait() == 2
        assert torch.equal(pages[1][5], kv[0, 1, 0, :2])
        assert torch.equal(pages[1][0], kv[1, 1, 0, 2:])


@pytest.mark.parametrize(
    "pages, ids, match",
    [
        (lambda: pages_for(8, 3), [0, 1], "must divide"),
        (lambda: pages_for(8, 4)[:2], [0, 1], "layers"),
        (lambda: [p.half() for p in pages_for(8, 4)], [0, 1], "dtype"),
        (lambda: pages_for(8, 4), [0], "names 1 pages, 2 are needed"),
        (lambda: pages_for(8, 4), [0, 8], r"\[0, 8\)"),
        (lambda: pages_for(8, 4)[0], [0, 1], "list"),
    ],
)
def test_load_into_validation(pages, ids, match):
    with open_store(None, layout=LAY, model_id="p", device="cpu", cpu_capacity="1MiB") as s:
        keys = s.block_keys(list(range(8)))
        with pytest.raises(TensorMismatchError, match=match):
            s.load_into(keys, pages(), ids)


# -- transformers layout: per layer (K, V), each [batch, heads, seq, head_dim] ----------------

def hf_cache(batch, seq, lay=LAY, fill=float("nan")):
    return [tuple(torch.full((batch, lay.num_kv_heads, seq, lay.head_dim), fill, dtype=lay.dtype)
                  for _ in range(2)) for _ in range(lay.num_layers)]


@pytest.mark.parametrize("page_size", [2, 4, 8])
def test_hf_layout_round_trip_with_page_size_not_block_size(page_size):
    with open_store(None, layout=LAY, model_id="hf", device="cpu", cpu_capacity="1MiB") as s:
        keys = s.block_keys(list(range(16)))  # 2 blocks of 8 tokens
        kv = random_kv(LAY, 2)
        s.put(keys, kv).wait()
        cache = hf_cache(batch=2, seq=24)
        per_row = 24 // page_size
        ppb = 8 // page_size
        # batch row 1, starting at token 8: pages (row 1, cols 8/ps ...)
        ids = [per_row + 8 // page_size + j for j in range(2 * ppb)]
        assert s.load_into(keys, cache, ids, page_size=page_size).wait() == 2
        for layer in range(LAY.num_layers):
            k, v = cache[layer]
            # tokens 8..24 of batch row 1 hold the 2 blocks in token order
            assert torch.equal(k[1, :, 8:24].transpose(0, 1), kv[:, layer, 0].reshape(16, 2, 4))
            assert torch.equal(v[1, :, 8:24].transpose(0, 1), kv[:, layer, 1].reshape(16, 2, 4))
            assert torch.isnan(k[0]).all() and torch.isnan(k[1, :, :8]).all()
        # gather back out of the hf cache
        k2 = s.block_keys(list(range(500, 516)))
        assert s.save_from(cache, ids, k2, page_size=page_size).wait() == 2
        assert torch.equal(s.fetch(k2).wait(), kv)


def test_gather_scatter_reference_round_trip_random():
    from kvstore.paged import gather_layer, paged_geometry, scatter_layer

    g = torch.Generator().manual_seed(3)
    for ps in (1, 2, 4, 8):
        pages = [torch.randn(2, 20, ps, 2, 4, generator=g) for _ in range(3)]
        geo = paged_geometry(LAY, pages)
        ids = torch.randperm(20, generator=g)[: 2 * (8 // ps)]
        out = torch.empty(2, 2, 8, 2, 4)
        gather_layer(LAY, geo, pages[1], ids, out)
        fresh = torch.zeros_like(pages[1])
        scatter_layer(LAY, geo, out, fresh, ids)
        assert torch.equal(fresh[:, ids], pages[1][:, ids])
        assert not fresh[:, [i for i in range(20) if i not in set(ids.tolist())]].any()


def test_load_into_right_after_put_many_times():
    """load_into's scatter may be queued before load_into returns (a fast fetch): no race."""
    with open_store(None, layout=LAY, model_id="race", device="cpu", cpu_capacity="1MiB") as s:
        keys = s.block_keys(list(range(16)))
        kv = random_kv(LAY, 2)
        s.put(keys, kv).wait()
        for _ in range(200):
            pages = pages_for(4, 8)
            assert s.load_into(keys, pages, [3, 1]).wait(10) == 2
            assert torch.equal(pages[2][:, 3], kv[0, 2])
