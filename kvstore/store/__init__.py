"""The embedded store: :class:`Store` and :func:`open_store`.

| module | job |
| --- | --- |
| ``entry`` | ``open_store``: checks the arguments, builds the config and the ``Store`` |
| ``facade`` | ``Store``: the public API, delegating to the modules below |
| ``config`` | ``StoreConfig``: what ``open_store`` resolved from its arguments |
| ``opening`` | building the tiers: memory, then the lower tiers (disk, remote) |
| ``state`` | ``StoreState``: tiers, catalog, counters, copy engine, lock — shared by the rest |
| ``residency`` | where blocks are: leading runs, LRU touches, making room, ``evict`` |
| ``fetch`` | ``fetch``/``prefetch``: ``FetchPlan`` under the lock, a ``FetchJob`` reads the lower tiers and copies layer by layer |
| ``put`` | ``put``: reserve slots, the copy, overflow straight to the durable tier |
| ``paged`` | ``load_into``/``save_from``: an engine's paged KV cache |
| ``write_back`` | the background writer's passes into every lower tier |
| ``zero_copy`` | leased warm slots, granted puts, borrowed blocks (``kvstore.api.ZeroCopy``) |
"""

from kvstore.api import PinReceipt, PutGrant
from kvstore.store.config import StoreConfig
from kvstore.store.entry import open_store
from kvstore.store.facade import Store
from kvstore.store.fetch import FetchPlan
from kvstore.store.state import DISK, HOT, REMOTE, WARM

__all__ = ["DISK", "HOT", "REMOTE", "WARM", "FetchPlan", "PinReceipt", "PutGrant", "Store",
           "StoreConfig", "open_store"]
