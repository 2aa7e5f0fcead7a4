"""One store per process per (mode, place, namespace), shared by the connectors that ask for it.

:func:`open_connector_store` is how a connector gets its store: in daemon mode a
:func:`kvstore.client.connect` client, in embedded mode a :func:`kvstore.open_store` store.
Scheduler and worker connectors of one process (vLLM with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) share one store; alone, an embedded scheduler opens a
lookup-only store on the same directory. :func:`release_store` drops a connector's reference
(the last one closes the store) and :func:`close_all` closes what is still open, also at exit.

Imports neither vLLM nor torch (the stores import torch).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstore.api import KVCache, ZeroCopy
from kvstore.layout import KVLayout

from .config import ConnectorConfig

__all__ = ["acquire_store", "close_all", "open_connector_store", "release_store"]

log = logging.getLogger("vllm.kvstore")

_shared_lock = threading.Lock()
_shared: dict[tuple, list] = {}  # key -> [store, refcount]


def acquire_store(key: tuple, opener: Callable[[], KVCache] | None, *,
                  reuse_only: bool = False) -> tuple[KVCache | None, bool]:
    """The process's store for ``key`` (opened by ``opener`` if there is none yet) and whether
    this call opened it. ``reuse_only``: return ``(None, False)`` instead of opening."""
    with _shared_lock:
        entry = _shared.get(key)
        opened = False
        if entry is None:
            if reuse_only or opener is None:
                return None, False
            entry = _shared[key] = [opener(), 0]
            opened = True
        entry[1] += 1
        return entry[0], opened


def release_store(key: tuple) -> None:
    """Drop one reference to ``key``'s store; the last one closes it."""
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _shared[key]
    try:
        entry[0].close()
    except Exception:
        log.exception("kvstore: closing the store failed")


@atexit.register
def close_all() -> None:
    """Flush and close what is still open when the engine process exits."""
    with _shared_lock:
        entries = list(_shared.values())
        _shared.clear()
    for store, _ in entries:
        with contextlib.suppress(Exception):
            store.close()


def open_connector_store(
    c: ConnectorConfig, *, layout: KVLayout, model_id: str, model_revision: str,
    ns_extras: dict[str, object], page_kind: str, is_scheduler: bool,
    tp_rank: int = 0, tp_size: int = 1,
) -> tuple[KVCache, tuple]:
    """The store a connector uses, and the key to hand to :func:`release_store` once done.
    ``tp_rank``/``tp_size``: the namespace's tensor-parallel shard (each TP rank's worker
    stores its slice of the heads in a namespace of its own)."""
    kw: dict[str, Any] = dict(layout=layout, model_id=model_id, model_revision=model_revision,
                              namespace_extras=ns_extras)
    if tp_size != 1:
        kw.update(tp_rank=tp_rank, tp_size=tp_size)
    ident = (layout, model_id, model_revision, tuple(sorted(ns_extras.items())), tp_rank, tp_size)
    if c.mode == "daemon":
        return _connect(c, kw, ident, page_kind=page_kind, is_scheduler=is_scheduler)
    return _open_embedded(c, kw, ident, page_kind=page_kind, is_scheduler=is_scheduler)


def _connect(c: ConnectorConfig, kw: dict[str, Any], ident: tuple, *, page_kind: str,
             is_scheduler: bool) -> tuple[KVCache, tuple]:
    from kvstore.client import connect

    device = "cpu" if is_scheduler or page_kind == "cpu" else None
    ckw: dict[str, Any] = {}
    for name in ("warm_capacity", "salt_policy", "timeout", "wait_for_daemon"):
        if getattr(c, name) is not None:
            ckw[name] = getattr(c, name)
    key = ("daemon", os.path.abspath(os.path.expanduser(c.socket or "")), *ident, device)
    store, _ = acquire_store(key, lambda: connect(c.socket, device=device, **kw, **ckw))
    assert store is not None
    return store, key


def _open_embedded(c: ConnectorConfig, kw: dict[str, Any], ident: tuple, *, page_kind: str,
                   is_scheduler: bool) -> tuple[KVCache, tuple]:
    from kvstore.store import open_store

    okw: dict[str, Any] = {}
    for name in ("cpu_capacity", "disk_capacity", "admission", "eviction", "disk_codec"):
        if getattr(c, name) is not None:
            okw[name] = getattr(c, name)
    if page_kind == "cpu" or is_scheduler:
        device = "cpu"
        # a scheduler-only store answers lookups: memory, then the shared disk index
    else:
        device = None
        if c.gpu_capacity is not None:
            okw["gpu_capacity"] = c.gpu_capacity
    path = os.path.abspath(os.path.expanduser(c.store_path)) if c.store_path else None
    key: tuple = ("embedded", path, *ident)
    if is_scheduler:
        # In one process with the worker (vLLM creates the worker's connector first):
        # share its store. Alone (vLLM's scheduler/worker process split) the scheduler only
        # answers lookups, from the disk index the worker's process writes: a warm tier of
        # a few blocks is all it needs.
        store, _ = acquire_store(key, None, reuse_only=True)
        if store is not None:
            return store, key
        key = (*key, "lookup-only")
        if path is not None:
            okw["cpu_capacity"] = 16 * kw["layout"].block_nbytes
    store, opened = acquire_store(key, lambda: open_store(path, device=device, **kw, **okw))
    assert store is not None
    if opened and not is_scheduler:
        _prefault(store, c.prefault)
    return store, key


def _prefault(store: KVCache, prefault: int | str | None) -> None:
    """Touch the first ``prefault`` bytes of a freshly opened store's warm tier.

    Its slab is allocated lazily: the first copy into each page faults it in (about
    17 ms per 32 MiB here), which would land on the first loads after a restart. Slots
    are handed out from the start of the slab, and nothing uses a store that was just
    opened, so zeroing its first rows now is safe.
    """
    from kvstore.sizes import parse_size

    want = parse_size(prefault if prefault is not None else "1GiB", what="prefault")
    slab = store.warm_slab if isinstance(store, ZeroCopy) else None
    if not want or slab is None or not slab.numel():
        return
    rows = min(slab.shape[0], -(-want // slab.shape[1]))
    t0 = time.perf_counter()
    slab[:rows].zero_()
    log.info("kvstore: pre-faulted %d MiB of the warm tier in %.0f ms",
             rows * slab.shape[1] >> 20, (time.perf_counter() - t0) * 1e3)
