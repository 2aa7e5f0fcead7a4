"""``kvstore import``: a prefix pack into a store, fail-closed.

The whole pack is verified first (:func:`kvstore.packs.reader.open_pack`: header, length,
manifest, parents, every block's checksum) and checked against the namespace the operator
expects, if any; only then is anything written, and then all of it is published at once —
the blocks go into new segment files and one index transaction makes them visible, so a
pack is imported completely or not at all. Blocks the store already holds are skipped.
An engine (or daemon) with the store open sees the blocks at its next lookup.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.admin.common import AdminError, StoreNotFoundError, check_store, resolve_store_path
from kvstore.admin.nsmatch import NamespaceFields, differences
from kvstore.packs.format import PackError
from kvstore.packs.reader import OpenPack, open_pack

__all__ = ["ImportResult", "import_pack"]

Progress = Callable[[str, int, int], None]  # (phase, done, total): "verify" bytes, "write"


@dataclass(frozen=True, slots=True)
class ImportResult:
    """Result of :func:`import_pack`."""

    pack: str
    store: str
    namespace_id: str
    model_id: str
    layout: str
    blocks: int  # in the pack
    imported: int  # newly written
    present: int  # already in the store (skipped)
    data_bytes: int  # raw bytes of the pack's blocks
    created_store: bool
    dry_run: bool
    seconds: float


def import_pack(pack: str | os.PathLike[str], store: str | os.PathLike[str] | None, *,
                expect: NamespaceFields | str | None = None, create: bool = False,
                dry_run: bool = False, progress: Progress | None = None) -> ImportResult:
    """Verify the pack at ``pack`` and import its blocks into the store at ``store``.

    ``expect``: the namespace the blocks must be for (fields as the engine opens the store,
    or a namespace id prefix / model id); another namespace is refused naming the differing
    fields. ``create``: create the store when the path does not exist (or is an empty
    directory). ``dry_run``: verify and count, write nothing. Raises :class:`PackError`
    (``kind`` says why) with nothing written when the pack does not check out."""
    t0 = time.perf_counter()
    path = resolve_store_path(store)
    created = _check_target(path, create=create, dry_run=dry_run)
    tick = None if progress is None else (lambda d, n: progress("verify", d, n))
    with open_pack(os.fspath(pack), progress=tick) as p:
        h = p.header
        _check_expected(p, expect)
        if dry_run:
            present = _present(path, p) if not created else 0
            imported = 0
        else:
            if progress is not None:
                progress("write", 0, h.blocks)
            imported = _write(path, p)
            present = h.blocks - imported
            if progress is not None:
                progress("write", h.blocks, h.blocks)
    f = h.namespace
    return ImportResult(p.path, str(path), h.namespace_id.hex(), f.model_id, f.layout,
                        h.blocks, imported, present, h.blocks * h.block_nbytes,
                        created and not dry_run, dry_run, time.perf_counter() - t0)


def _check_target(path, *, create: bool, dry_run: bool) -> bool:
    """Whether the store is to be created; its absence is an error without ``create``."""
    try:
        check_store(path)
        return False
    except StoreNotFoundError:
        # empty directories only: none, or what a store creation killed before its index
        # was made leaves (segments/, index/), so that the retry of the same import goes on
        empty = not path.exists() or (path.is_dir() and not any(
            not p.is_dir() or p.is_symlink() for p in path.rglob("*")))
        if not empty:
            raise
        if not create:
            raise StoreNotFoundError(
                f"no kvstore store at {path}; pass --create to create one there (engines "
                "opening that path then find the imported blocks)") from None
        return True


def _check_expected(p: OpenPack, expect: NamespaceFields | str | None) -> None:
    h = p.header
    if expect is None:
        return
    if isinstance(expect, str):
        t = expect.strip()
        ok = h.namespace.model_id == t or (len(t) >= 4 and h.namespace_id.hex().startswith(
            t.lower()))
        if not ok:
            raise PackError("wrong_namespace", f"the pack holds namespace "
                            f"{h.namespace_id.hex()[:12]} ({h.namespace.model_id}, "
                            f"{h.namespace.layout}), not {t!r}; nothing was imported")
        return
    diffs = differences(expect, h.namespace)
    if diffs:
        what = "; ".join(f"{d.field} {d.stored!r} in the pack, {d.wanted!r} expected"
                         for d in diffs)
        raise PackError("wrong_namespace", f"the pack is for another namespace ({what}); "
                        "nothing was imported")


def _namespace(p: OpenPack):
    from kvstore.layout import KVLayout, dtype_from_name
    from kvstore.namespace import Namespace

    f = p.header.namespace
    lay = KVLayout(num_layers=f.num_layers, num_kv_heads=f.num_kv_heads, head_dim=f.head_dim,
                   dtype=dtype_from_name(f.dtype), block_tokens=f.block_tokens,
                   kv_planes=f.kv_planes)
    ns = Namespace(model_id=f.model_id, layout=lay, model_revision=f.model_revision,
                   tp_rank=f.tp_rank, tp_size=f.tp_size, extras=f.extras,
                   format_version=f.format_version)
    if ns.id != p.header.namespace_id:
        raise PackError("version", "this kvstore cannot reproduce the pack's namespace id "
                        "(a namespace of another format version); nothing was imported")
    return ns


def _present(path, p: OpenPack) -> int:
    from kvstore.tiers.disk import DiskTier

    t = DiskTier(path, capacity_bytes=0, readonly=True)
    try:
        nid = p.header.namespace_id
        return sum(1 for k in p.keys if t.contains(k, nid))
    finally:
        t.close()


def _write(path, p: OpenPack) -> int:
    """Write every block of the verified pack in one batch: one commit publishes them all."""
    import torch

    from kvstore.tiers.disk import DiskTier, DiskWrite

    ns = _namespace(p)
    h = p.header
    nid = h.namespace_id
    try:
        t = DiskTier(path, capacity_bytes=0)
    except OSError as e:
        raise AdminError(f"cannot open the store at {path} for writing: {e}") from e
    try:
        t.register_namespace(ns)
        data = torch.frombuffer(p.buffer(), dtype=torch.uint8)
        nb = h.block_nbytes
        items = [DiskWrite(k, None if q < 0 else p.keys[q], nid,
                           data[h.blocks_start + i * nb : h.blocks_start + (i + 1) * nb])
                 for i, (k, q) in enumerate(zip(p.keys, p.parents, strict=True))]
        new = t.write_blocks(items)
        del items, data  # the mapping can be closed only without views into it
        return len(new)
    finally:
        t.close()
