"""The embedded store: :class:`Store` and :func:`open_store`.

| module | job |
| --- | --- |
| ``facade`` | ``Store`` (the public API, delegating) and ``open_store`` |
| ``config`` | ``StoreConfig``: what ``open_store`` resolved from its arguments |
| ``state`` | ``StoreState``: tiers, catalog, counters, copy engine, lock — shared by the rest |
| ``residency`` | where blocks are: leading runs, LRU touches, making room, ``evict`` |
| ``fetch`` | ``fetch``/``prefetch``: plan under the lock, read lower tiers, copy layer by layer |
| ``put`` | ``put``: reserve slots, the copy, overflow straight to disk |
| ``paged`` | ``load_into``/``save_from``: an engine's paged KV cache |
| ``write_back`` | the background writer's passes into the disk (and remote) tier |
| ``zero_copy`` | leased warm slots, granted puts, borrowed blocks (``kvstore.api.ZeroCopy``) |
"""

from kvstore.api import PinReceipt, PutGrant
from kvstore.store.config import StoreConfig
from kvstore.store.facade import Store, open_store
from kvstore.store.fetch import FetchPlan
from kvstore.store.state import DISK, HOT, REMOTE, WARM

__all__ = ["DISK", "HOT", "REMOTE", "WARM", "FetchPlan", "PinReceipt", "PutGrant", "Store",
           "StoreConfig", "open_store"]
