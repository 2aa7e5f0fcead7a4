"""load_into / save_from: blocks to and from an engine's paged KV cache, on the copy engine."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from kvstore import streams as _streams
from kvstore.errors import TransferError
from kvstore.hints import PutHint, check_hint
from kvstore.kernels import gather_pages, scatter_pages
from kvstore.keys import KeyChain
from kvstore.paged import _layer_tensors, page_index, paged_geometry
from kvstore.store.copy_engine import Job, mark_layer_done
from kvstore.store.fetch import Fetcher
from kvstore.store.put import Putter
from kvstore.store.state import StoreState
from kvstore.streams import Stream, begin_copy, handoff
from kvstore.transfer import Transfer


class PagedIO:
    """``load_into``/``save_from``: blocks to and from an engine's paged KV cache."""

    def __init__(self, st: StoreState, fetcher: Fetcher, putter: Putter) -> None:
        self.st = st
        self.fetcher = fetcher
        self.putter = putter

    # -- paged engines --------------------------------------------------------------------
    def load_into(
        self, keys: Sequence[bytes], pages: Sequence[object], block_ids: object,
        *, page_size: int | None = None,
    ) -> Transfer[int]:
        """Scatter the leading held blocks of ``keys`` into an engine's KV cache.

        ``pages[l]`` is layer ``l``'s paged tensor ``[kv_planes, num_pages, page_size, H, D]``
        (vLLM flash-attention layout) or a ``(key, value)`` pair of ``[batch, heads, seq,
        head_dim]`` tensors (transformers; ``page_size`` defaults to ``block_tokens``).
        ``block_ids`` names one page per ``page_size`` tokens, ``block_tokens // page_size``
        per key, in token order. Pages not named, or past the loaded run, are never written.
        The transfer yields the number of blocks loaded; ``wait_layer(i)`` returns once layer
        ``i`` is in place.
        """
        ks = self.st.keys(keys)
        lay = self.st.layout
        geo = paged_geometry(lay, pages, page_size)
        ids = page_index(block_ids, len(ks) * geo.pages_per_block, geo)
        t: Transfer[int] = Transfer(lay.num_layers)
        # The fetch may complete (and queue the scatter) before _submit_fetch has returned
        # its plan: the scatter waits for it.
        handed: dict[str, object] = {}
        planned = threading.Event()
        assert self.st.engine is not None
        streams = self.st.engine.streams
        # the scatter writes the engine's pages after the work it queued on them (rule 1)
        page_tensors = [x for layer in pages for x in _layer_tensors(layer)]
        ready = handoff(streams, *page_tensors)

        def run(stream: Stream | None) -> list:
            # queued by the fetch's completion: its bytes are in ``staged``
            if not planned.wait(_streams.COPY_TIMEOUT_S):
                raise TransferError("load_into's fetch was never planned (an internal error)")
            begin_copy(streams, ready, stream)
            plan, staged = handed["plan"], handed["staged"]
            n = plan.valid
            sel = ids[: n * geo.pages_per_block]
            events = []
            for layer in range(lay.num_layers):
                if n:
                    assert staged is not None
                    if streams is not None:
                        streams.access(stream, reads=[staged[:n, layer]],
                                       writes=list(_layer_tensors(pages[layer])), what="scatter")
                    scatter_pages(lay, geo, staged[:n, layer], pages[layer], sel)
                mark_layer_done(t, stream, layer, events)
            return events

        def finish(ok: bool, error: BaseException | None) -> None:
            if ok:
                t.set_result(handed["plan"].valid)
            else:
                t.set_error(error or RuntimeError("load_into failed"))

        def scatter_after_fetch(ok: bool, error: BaseException | None) -> None:
            if not ok:
                t.set_error(error or RuntimeError("load_into's fetch failed"))
                return
            try:
                assert self.st.engine is not None
                self.st.engine.submit("h2d", Job(t, run, finish))
            except BaseException as e:  # closing
                t.set_error(e)

        try:
            _, handed["plan"], handed["staged"] = self.fetcher.submit(
                ks, self.st.chain_parent(keys), None, want_result=True, then=scatter_after_fetch
            )
        finally:
            planned.set()
        return t

    def save_from(
        self, pages: Sequence[object], block_ids: object, keys: Sequence[bytes],
        *, page_size: int | None = None, hint: PutHint | None = None,
    ) -> Transfer[int]:
        """Gather the blocks for ``keys`` out of an engine's KV cache and ``put`` them.

        Same ``pages``/``block_ids`` conventions as :meth:`load_into`. The gather is a copy
        taken before this returns, so the engine may overwrite its pages right away.
        ``hint``: as :meth:`~kvstore.store.put.Putter.put`'s.
        """
        ks = self.st.keys(keys)
        check_hint(hint)
        lay = self.st.layout
        geo = paged_geometry(lay, pages, page_size)
        ids = page_index(block_ids, len(ks) * geo.pages_per_block, geo)
        kv = torch.empty(lay.batch_shape(len(ks)), dtype=lay.dtype, device=geo.device)
        streams = self.st.engine.streams if self.st.engine is not None else None
        for layer in range(lay.num_layers):
            if streams is not None:  # on the caller's stream, after its forward wrote them
                streams.access(streams.current(), reads=list(_layer_tensors(pages[layer])),
                               writes=[kv[:, layer]], what="save_from gather")
            gather_pages(lay, geo, pages[layer], ids, kv[:, layer])
        # put's copy waits for this gather on the caller's stream (kvstore.streams, rule 1)
        return self.putter.put(keys if isinstance(keys, KeyChain) else ks, kv, hint)
