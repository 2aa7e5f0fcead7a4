"""kvstore: a persistent, tiered KV prefix cache store for LLM inference.

Embedded use::

    from kvstore import KVLayout, open_store
    with open_store(path, layout=layout, model_id="my-model") as store:
        keys = store.block_keys(token_ids)
        n = store.lookup(keys)
        kv = store.fetch(keys[:n]).wait()
        store.put(keys[n:], kv_new)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvstore.errors import (
    ConfigError,
    DaemonUnavailableError,
    DiskError,
    FormatVersionError,
    KeyFormatError,
    KVStoreError,
    LayoutError,
    NamespaceMismatchError,
    PutsLostError,
    SizeError,
    StoreClosedError,
    StoreCorruptError,
    TensorMismatchError,
    TokenError,
    TransferError,
)
from kvstore.hints import PutHint
from kvstore.sizes import format_size, parse_size

if TYPE_CHECKING:
    from kvstore.api import PinReceipt
    from kvstore.client import connect
    from kvstore.keys import BlockKey, KeyChain
    from kvstore.layout import KVLayout
    from kvstore.namespace import Namespace
    from kvstore.stats import StoreStats, TierStats
    from kvstore.store import Store, open_store
    from kvstore.transfer import Transfer

# Names that need torch are imported on first use, so that ``kvstore --help``, ``kvstore ls``
# and other tools that never touch a tensor start without loading torch (~2.4 s).
_LAZY = {
    "connect": "kvstore.client",
    "BlockKey": "kvstore.keys",
    "KeyChain": "kvstore.keys",
    "KVLayout": "kvstore.layout",
    "Namespace": "kvstore.namespace",
    "StoreStats": "kvstore.stats",
    "TierStats": "kvstore.stats",
    "PinReceipt": "kvstore.api",
    "Store": "kvstore.store",
    "open_store": "kvstore.store",
    "Transfer": "kvstore.transfer",
}


def __getattr__(name: str) -> object:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "BlockKey",
    "ConfigError",
    "DaemonUnavailableError",
    "DiskError",
    "FormatVersionError",
    "KVLayout",
    "KVStoreError",
    "KeyChain",
    "KeyFormatError",
    "LayoutError",
    "Namespace",
    "NamespaceMismatchError",
    "PutHint",
    "PutsLostError",
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
