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


# -- strided store-side blocks (kv[:, layer]) and engine pages: read and written in place ------
def _self_alloc_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


def test_reference_scatter_reads_a_strided_layer_slice_without_a_copy():
    from kvstore.paged import paged_geometry, scatter_layer

    lay = KVLayout(num_layers=4, num_kv_heads=4, head_dim=16, dtype=torch.float16, block_tokens=16)
    kv = torch.randn(lay.batch_shape(8)).to(lay.dtype)
    blocks = kv[:, 1]  # what save_from/load_into hand over: not contiguous
    assert not blocks.is_contiguous()
    ids = torch.randperm(40)[:32]
    got = torch.zeros(2, 40, 4, 4, 16, dtype=lay.dtype)
    geo = paged_geometry(lay, [got] * 4)
    ref = got.clone()
    for b in range(8):
        for j in range(4):
            ref[:, ids[b * 4 + j]] = blocks[b, :, j * 4 : (j + 1) * 4]
    allocated = _self_alloc_bytes(lambda: scatter_layer(lay, geo, blocks, got, ids))
    assert torch.equal(got, ref)
    assert allocated < blocks.numel() * blocks.element_size() // 4  # the old reshape copied it all


def _storage_bytes(t):
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(st), t.data_ptr() - st.data_ptr()


def emulate_kernel(name, a, b, ids, args):
    """What paged_copy.cu does with ``args``, byte for byte, on CPU tensors' storage."""
    A, ao = _storage_bytes(a)
    B, bo = _storage_bytes(b)
    c = args.chunk_bytes
    assert args.grid == (args.n_pages_moved, args.planes)
    for m in range(args.n_pages_moved):
        blk, j = divmod(m, args.ppb)
        for p in range(args.planes):
            store = blk * args.block_stride + p * args.block_plane_stride + j * c
            page = p * args.page_plane_stride + int(ids[m]) * args.page_stride
            if name == "kvstore_scatter_pages":
                B[bo + page : bo + page + c] = A[ao + store : ao + store + c]
            else:
                B[bo + store : bo + store + c] = A[ao + page : ao + page + c]


@pytest.mark.parametrize("planes_axis", [True, False])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_kernel_launch_args_address_strided_blocks_and_pages(planes_axis, page_size):
    from kvstore.kernels import launch_args
    from kvstore.paged import gather_layer, paged_geometry, scatter_layer

    P = 2 if planes_axis else 1
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=16,
                   kv_planes=P)
    n, ppb, num_pages = 5, 16 // page_size, 5 * (16 // page_size) + 7
    kv = torch.randn(lay.batch_shape(n)).to(lay.dtype)
    # engine pages that are a strided view too (every other page of a bigger cache)
    shape = (num_pages, 2, page_size, 2, 8)
    big = torch.randn((P, *shape) if planes_axis else shape).to(lay.dtype)
    pages = big.select(-4, 0)
    assert not pages.is_contiguous()
    geo = paged_geometry(lay, [pages] * 3)
    ids = torch.randperm(num_pages)[: n * ppb]
    for layer in range(3):
        blocks = kv[:, layer]
        args = launch_args(lay, geo, blocks, pages, ids.numel())
        assert args is not None
        assert args.block_stride == lay.block_nbytes  # kv[:, layer]: one whole block apart
        ref, got = pages.clone(), big.clone().select(-4, 0)
        scatter_layer(lay, geo, blocks, ref, ids)
        emulate_kernel("kvstore_scatter_pages", blocks, got, ids, args)
        assert torch.equal(ref, got)
        out_ref = torch.empty_like(blocks)
        out = torch.zeros_like(kv)
        gather_layer(lay, geo, pages, ids, out_ref)
        emulate_kernel("kvstore_gather_pages", pages, out[:, layer], ids,
                       launch_args(lay, geo, out[:, layer], pages, ids.numel()))
        assert torch.equal(out[:, layer], out_ref)
        assert not out[:, (layer + 1) % 3].any()  # nothing outside its layer written


def test_kernel_launch_args_refuse_what_the_kernels_cannot_address():
    from kvstore.kernels import launch_args
    from kvstore.paged import paged_geometry

    lay = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_tokens=4)
    pages = torch.zeros(2, 6, 4, 2, 8, dtype=lay.dtype)
    geo = paged_geometry(lay, [pages])
    heads_last = torch.zeros(2, 2, 4, 8, 2, dtype=lay.dtype).permute(0, 1, 2, 4, 3)  # H not dense
    assert launch_args(lay, geo, heads_last, pages, 2) is None
    odd_pages = torch.zeros(2, 6, 2, 8, 4, dtype=lay.dtype).permute(0, 1, 4, 2, 3)
    assert launch_args(lay, geo, torch.zeros(2, 2, 4, 2, 8, dtype=lay.dtype), odd_pages, 2) is None


def test_kernel_dispatch_passes_strided_tensors_in_place(monkeypatch):
    """scatter_pages/gather_pages hand kv[:, layer] itself to the kernel: no .contiguous()
    copy (scatter), no torch fallback for a non-contiguous out (gather)."""
    import kvstore.kernels as kernels
    from kvstore.paged import gather_layer, paged_geometry

    launched = []

    def launch(name, a, b, ids, args):
        launched.append((name, a.data_ptr(), b.data_ptr()))
        emulate_kernel(name, a, b, ids, args)
        return True

    monkeypatch.setattr(kernels, "_use_kernel", lambda geo, t, other: True)
    monkeypatch.setattr(kernels, "_launch", launch)
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, block_tokens=8)
    kv = torch.randn(lay.batch_shape(3)).to(lay.dtype)
    pages = torch.zeros(2, 12, 4, 2, 8, dtype=lay.dtype)
    geo = paged_geometry(lay, [pages, pages])
    ids = torch.randperm(12)[:6]
    kernels.scatter_pages(lay, geo, kv[:, 1], pages, ids)
    out = torch.zeros_like(kv)
    kernels.gather_pages(lay, geo, pages, ids, out[:, 0])
    assert launched == [("kvstore_scatter_pages", kv[:, 1].data_ptr(), pages.data_ptr()),
                        ("kvstore_gather_pages", pages.data_ptr(), out[:, 0].data_ptr())]
    ref = torch.empty_like(kv[:, 1])
    gather_layer(lay, geo, pages, ids, ref)
    assert torch.equal(ref, kv[:, 1]) and torch.equal(out[:, 0], kv[:, 1])
