"""kvstore: a persistent, tiered KV prefix cache store for LLM inference.

Embedded use::

    from kvstore import KVLayout, open_store
    with open_store(path, layout=layout, model_id="my-model") as store:
        keys = store.block_keys(token_ids)
        n = store.lookup(keys)
        kv = store.fetch(keys[:n]).wait()
        store.put(keys[n:], kv_new)
"""

from kvstore.client import connect
from kvstore.errors import (
    ConfigError,
    DiskError,
    FormatVersionError,
    KeyFormatError,
    KVStoreError,
    LayoutError,
    NamespaceMismatchError,
    SizeError,
    StoreClosedError,
    StoreCorruptError,
    TensorMismatchError,
    TokenError,
    TransferError,
)
from kvstore.keys import BlockKey, KeyChain
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.sizes import format_size, parse_size
from kvstore.stats import StoreStats, TierStats
from kvstore.store import PinReceipt, Store, open_store
from kvstore.transfer import Transfer

__version__ = "0.1.0"

__all__ = [
    "BlockKey",
    "ConfigError",
    "DiskError",
    "FormatVersionError",
    "KVLayout",
    "KVStoreError",
    "KeyChain",
    "KeyFormatError",
    "LayoutError",
    "Namespace",
    "NamespaceMismatchError",
    "PinReceipt",
    "SizeError",
    "Store",
    "StoreClosedError",
    "StoreCorruptError",
    "StoreStats",
    "TensorMismatchError",
    "TierStats",
    "TokenError",
    "Transfer",
    "TransferError",
    "connect",
    "format_size",
    "open_store",
    "parse_size",
]
