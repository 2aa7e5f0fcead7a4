"""What ``prune`` and ``verify`` report: a :class:`FindingEntry` per problem found, with the
action that fixing it takes, built from :class:`kvstore.tiers.disk.Finding` and the records
it names."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.admin.common import AdminError

if TYPE_CHECKING:
    from kvstore.tiers.disk import DiskRecord, Finding

__all__ = [
    "DEFAULT_GRACE_S",
    "FindingEntry",
    "block_id",
    "check_grace",
    "entries",
    "entry_block_id",
    "file_sizes",
]

#: ``prune``/``verify`` leave unreferenced files younger than this alone (an in-flight writer
#: of another process renames its segment before it commits the records)
DEFAULT_GRACE_S = 60.0

#: what fixing a finding does: ``drop`` its record (the block becomes a miss), ``repair`` it
#: (rewrite the block into a fresh segment), ``remove`` the file, ``rebuild`` the side indexes,
#: or ``none`` (files that are not the store's are never touched)
_ACTIONS = {"orphan_segment": "remove", "temp_file": "remove", "unknown_file": "none",
            "quarantined_segment": "none", "bad_index": "rebuild", "bad_header": "repair"}
_FILE_KINDS = ("orphan_segment", "temp_file", "unknown_file", "quarantined_segment")


@dataclass(frozen=True, slots=True)
class FindingEntry:
    """One problem found (``kind`` as in :class:`kvstore.tiers.disk.Finding`, plus
    ``unreachable``) and what fixing it does (``action``)."""

    kind: str  # orphan_segment | temp_file | missing_segment | short_segment |
    #            checksum_mismatch | bad_record | bad_header | unreachable | bad_index |
    #            unknown_file | quarantined_segment | loose_mode (a path more open than the
    #            store promises)
    path: str
    key: str | None  # the block (hex), for record findings
    detail: str
    fixed: bool
    nbytes: int  # file bytes (orphan_segment, temp_file, unknown_file), the block's stored
    #              bytes (record findings), 0 when not known (bad_index)
    action: str = "none"  # drop | repair | remove | rebuild | chmod | none
    namespace_id: str | None = None  # the block's namespace (hex), for record findings


def block_id(namespace_id: bytes, key: bytes) -> bytes:
    """A block's identity: namespace id ‖ key (every namespace has a key space of its own;
    this is also the disk index's LMDB key, ``kvstore.tiers.disk.index.dbkey``)."""
    return namespace_id + key


def entry_block_id(f: FindingEntry) -> bytes:
    """A record finding's block identity (:func:`block_id`), or its bare key when the
    namespace is not known (an undecodable record)."""
    assert f.key is not None
    key = bytes.fromhex(f.key)
    return key if f.namespace_id is None else bytes.fromhex(f.namespace_id) + key


def _entry(f: Finding, nbytes: int = 0, namespace_id: bytes | None = None) -> FindingEntry:
    key = None if f.key is None else bytes(f.key).hex()
    return FindingEntry(f.kind, f.path, key, f.detail, bool(f.fixed), nbytes,
                        _ACTIONS.get(f.kind, "drop"),
                        None if namespace_id is None else namespace_id.hex())


def file_sizes(segdir: str) -> dict[str, int]:
    """Size of every file in the segment directory, by path (for file findings)."""
    out: dict[str, int] = {}
    try:
        found = list(os.scandir(segdir))
    except FileNotFoundError:
        return out
    for de in found:
        with contextlib.suppress(FileNotFoundError):
            out[de.path] = de.stat(follow_symlinks=False).st_size
    return out


def entries(findings: Iterable[Finding], sizes: Mapping[str, int],
            recs: Mapping[bytes, DiskRecord]) -> list[FindingEntry]:
    """Findings of ``DiskTier.check`` as entries; ``recs``: block key -> its record (for the
    stored bytes and the namespace)."""
    out = []
    for f in findings:
        r = recs.get(bytes(f.key)) if f.key is not None else None
        if f.kind in _FILE_KINDS:
            out.append(_entry(f, sizes.get(f.path, 0)))
        elif r is not None:
            out.append(_entry(f, r.stored_nbytes, r.namespace_id))
        else:
            out.append(_entry(f))
    return out


def check_grace(grace_s: float) -> None:
    """Refuse a grace period that is not a number of seconds >= 0."""
    if not grace_s >= 0:  # also refuses NaN
        raise AdminError(f"grace must be a number of seconds >= 0, got {grace_s}")
