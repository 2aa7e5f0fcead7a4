"""Prefix packs: the KV blocks of one namespace as one self-describing, checksummed
safetensors file (``docs/format.md`` "Prefix packs"), to pre-warm a fleet of hosts with a
system prompt's KV or move a cache between machines (``kvstore export`` / ``kvstore
import``, ``docs/operations.md``).

| module | holds |
| --- | --- |
| ``format`` | the header: canonical encoding, parsing and its checks; ``PackError`` |
| ``reader`` | opening a pack and verifying all of it (``open_pack``) |
| ``export`` | choosing a namespace's blocks and writing their pack (``export_pack``) |
| ``importer`` | verifying a pack and publishing its blocks in a store at once (``import_pack``) |
"""

from kvstore.packs.export import ExportResult, export_pack
from kvstore.packs.format import PACK_VERSION, PackError, PackHeader
from kvstore.packs.importer import ImportResult, import_pack
from kvstore.packs.reader import OpenPack, open_pack, read_pack_header

__all__ = [
    "PACK_VERSION",
    "ExportResult",
    "ImportResult",
    "OpenPack",
    "PackError",
    "PackHeader",
    "export_pack",
    "import_pack",
    "open_pack",
    "read_pack_header",
]
