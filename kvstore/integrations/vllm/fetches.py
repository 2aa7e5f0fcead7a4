"""Loads before the forward on the fetch path (daemon mode, CUDA pages, a store without a
warm tier): one fetch per request into a slice of a staging buffer the step's loads share,
each layer scattered into vLLM's pages when the forward reaches it (``wait_for_layer_load``),
or every layer before the forward.

The step's loads have one deadline (``load_timeout`` after ``start_load_kv``). A load past it
is never scattered again and is reported failed; its fetch may still write its slice of the
staging buffer, so the next step's fetches get a new buffer (the worker keeps the abandoned
load, and with it the old buffer, until its fetch returns)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvstore.kernels import scatter_pages
from kvstore.layout import KVLayout
from kvstore.paged import page_index

from .stats import ConnectorStats

if TYPE_CHECKING:
    from .metadata import BlockRun

__all__ = ["FetchLoad", "Fetches", "left"]

log = logging.getLogger("vllm.kvstore")


def left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0."""
    return max(0.0, deadline - time.monotonic())


@dataclass(slots=True)
class FetchLoad:
    """One request's fetch in flight this step."""

    run: BlockRun
    transfer: Any  # Transfer -> tensor of the blocks fetched (n <= planned)
    out: torch.Tensor  # [planned, L, P, T, H, D] staging slice the fetch writes
    ids: torch.Tensor  # vLLM page ids, one per planned block
    deadline: float  # time.monotonic() past which it is abandoned
    scattered: set[int] = field(default_factory=set)  # layers already in vLLM's pages
    broken: bool = False  # a scatter failed, or it is late: vLLM recomputes the whole request
    late: bool = False  # past its deadline: reported once, never scattered again


class Fetches:
    """The step's fetches and the staging buffer they share. ``fail(run, loaded)`` reports a
    load that came back short; ``late(load)`` one past its deadline (counted, logged, kept
    until its fetch returns)."""

    def __init__(self, layout: KVLayout, stats: ConnectorStats, *,
                 fail: Callable[[BlockRun, int], None],
                 late: Callable[[FetchLoad], None]) -> None:
        self.layout = layout
        self.stats = stats
        self._fail = fail
        self._late = late
        self.loading: list[FetchLoad] = []
        self._pages: Sequence[torch.Tensor] = ()
        self._geo: Any = None
        self._buf: torch.Tensor | None = None

    def bind(self, pages: Sequence[torch.Tensor], geo: Any) -> None:
        """vLLM's pages, one view per layer, and their geometry (``paged_geometry``)."""
        self._pages, self._geo = pages, geo

    def staging(self, nblocks: int) -> torch.Tensor:
        """A reusable buffer, on the pages' device, for this step's fetched blocks (grown on
        demand)."""
        lay = self.layout
        buf = self._buf
        if buf is None or buf.shape[0] < nblocks:
            dev = self._pages[0].device if self._pages else torch.device("cpu")
            buf = self._buf = torch.empty(lay.batch_shape(max(nblocks, 8)), dtype=lay.dtype,
                                          device=dev)
        return buf

    def start(self, runs: Sequence[BlockRun], fetch: Callable[[BlockRun, torch.Tensor], Any],
              deadline: float, *, layerwise: bool) -> None:
        """One ``fetch(run, out)`` per run into a slice of the staging buffer (the copy engine
        reads disk blocks straight into it and copies memory blocks layer by layer); unless
        ``layerwise``, every layer is in vLLM's pages (or reported) on return."""
        buf = self.staging(sum(len(r.keys) for r in runs))
        off = 0
        for run in runs:
            n = len(run.keys)
            out = buf[off:off + n]
            off += n
            try:
                ids = page_index(run.block_ids, n, self._geo)
                t = fetch(run, out)
            except Exception:  # never raise into the engine: recompute instead
                log.exception("kvstore: fetch failed for request %s", run.req_id)
                self._fail(run, 0)
                continue
            self.loading.append(FetchLoad(run, t, out, ids, deadline))
            self.stats.count(loads=1, load_blocks=n)
        if not layerwise:
            for ld in self.loading:
                with contextlib.suppress(Exception):  # reported by scatter or finish
                    ld.transfer.wait(timeout=left(ld.deadline))
                for layer in range(self.layout.num_layers):
                    self.scatter(ld, layer)

    def scatter(self, ld: FetchLoad, layer: int) -> None:
        """Wait (until the deadline) for ``layer`` of ``ld`` and scatter it into the pages."""
        if layer in ld.scattered or ld.late:
            return
        ld.scattered.add(layer)
        try:
            ld.transfer.wait_layer(layer, timeout=left(ld.deadline))
        except TimeoutError:
            self._abandon(ld)
            return
        except Exception:  # the fetch failed: reported in finish
            return
        n = len(ld.run.keys)
        if ld.transfer.done():
            try:
                n = int(ld.transfer.wait().shape[0])
            except Exception:
                return
        # While the fetch is still running its final length is unknown: every planned page of
        # this layer is written then, and pages past the valid run (a short fetch) are
        # reported as load errors, so vLLM recomputes them before anything reads them.
        if n:
            # on the forward's stream, after wait_layer saw the copy's event complete (the
            # fetch into the reused staging buffer waited for this step's earlier scatters:
            # kvstore.streams); a failure is a load error, never an exception into vLLM
            try:
                scatter_pages(self.layout, self._geo, ld.out[:n, layer], self._pages[layer],
                              ld.ids[:n])
            except Exception:
                log.exception("kvstore: scattering layer %d of request %s failed", layer,
                              ld.run.req_id)
                ld.broken = True

    def wait_for_layer(self, layer: int | None) -> None:
        """``layer`` of every load in the pages (None: every layer)."""
        for ld in self.loading:
            for i in range(self.layout.num_layers) if layer is None else (layer,):
                self.scatter(ld, i)

    def finish(self) -> None:
        """Every load scattered or reported (after the forward, before saves)."""
        loading, self.loading = self.loading, []
        for ld in loading:
            for layer in range(self.layout.num_layers):  # layers the forward did not wait for
                self.scatter(ld, layer)
            if ld.late:  # reported by _abandon
                continue
            try:
                n = 0 if ld.broken else int(ld.transfer.wait(timeout=left(ld.deadline)).shape[0])
            except TimeoutError:
                self._abandon(ld)
                continue
            except Exception:
                log.exception("kvstore: a load failed for request %s", ld.run.req_id)
                n = 0
            self.stats.count(loaded_blocks=n)
            if n < len(ld.run.keys):
                self._fail(ld.run, n)

    def _abandon(self, ld: FetchLoad) -> None:
        ld.late = ld.broken = True
        self._buf = None  # the late fetch may still write it: never reused
        self._late(ld)
