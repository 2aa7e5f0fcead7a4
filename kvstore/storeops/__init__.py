"""The store's operations, one module per job; :class:`kvstore.store.Store` combines them.

Each module holds a mixin over the state :class:`~kvstore.store.Store` sets up (tiers,
catalog, counters, copy engine, lock); they are not meant to be used on their own.
"""

HOT, WARM, DISK, REMOTE = "hot", "warm", "disk", "remote"
