"""``kvstore ls`` and ``kvstore inspect``: what a store holds (see ``docs/cli.md``)."""

from __future__ import annotations

import argparse
import time

from kvstore.commands.output import EXIT_OK, emit_json, out_console, short, size, table


def namespace_table(items, now: float, title: str | None = None, width: int | None = None):
    from kvstore.admin import format_age

    cols = [("ID", "left"), ("MODEL", "left"), ("REVISION", "left"), ("LAYOUT", "left"),
            ("BLOCKS", "right"), ("SIZE", "right"), ("TIERS", "left"),
            ("LAST ACCESSED", "left"), ("HITS", "right")]
    rows = [(e.namespace_id[:12], e.model_id or "?", e.model_revision or "-", e.layout,
             str(e.blocks), size(e.stored_bytes), ",".join(e.tiers) or "-",
             format_age(e.last_accessed, now), str(e.hits)) for e in items]
    drop = ("REVISION", "TIERS", "HITS", "BLOCKS")
    return table(cols, rows, wrap=("MODEL", "REVISION", "LAYOUT"), title=title, width=width,
                 drop=drop)


def block_table(items, now: float, width: int | None = None):
    from kvstore.admin import format_age

    cols = [("KEY", "left"), ("NAMESPACE", "left"), ("MODEL", "left"), ("PARENT", "left"),
            ("STORED", "right"), ("RAW", "right"), ("CODEC", "left"), ("SEGMENT", "right"),
            ("CREATED", "left"), ("LAST ACCESSED", "left"), ("HITS", "right")]
    rows = [(e.key[:16], e.namespace_id[:12], e.model_id or "?", short(e.parent, 16),
             size(e.stored_bytes), size(e.raw_bytes), e.codec, f"{e.segment:x}",
             format_age(e.created, now), format_age(e.last_accessed, now), str(e.hits))
            for e in items]
    drop = ("CREATED", "RAW", "NAMESPACE", "CODEC", "SEGMENT", "HITS", "PARENT")
    return table(cols, rows, wrap=("MODEL",), width=width, drop=drop)


def run_ls(args: argparse.Namespace) -> int:
    from kvstore.admin import list_blocks, list_namespaces

    now = time.time()
    if args.blocks:
        res = list_blocks(args.store, filters=args.filter or (), sort=args.sort,
                          limit=args.limit, now=now)
    else:
        res = list_namespaces(args.store, filters=args.filter or (), sort=args.sort,
                              limit=args.limit, include_empty=args.all, now=now)
    if args.quiet:
        for i in res.ids:
            print(i)
        return EXIT_OK
    if args.format == "json":
        emit_json("ls", res)
        return EXIT_OK
    con = out_console()
    what = "block" if args.blocks else "namespace"
    if not res.items:
        if res.total == 0:
            con.print(f"The store at {res.store} holds no blocks.")
        else:
            con.print(f"No {what}s match ({res.total} in the store).")
        return EXIT_OK
    con.print(block_table(res.items, now, con.width) if args.blocks
              else namespace_table(res.items, now, width=con.width))
    shown = "" if len(res.items) == res.matched else f", {len(res.items)} shown"
    if args.blocks:
        con.print(f"\nFound {res.matched} block(s){shown}: {size(res.stored_bytes)} on disk.")
    else:
        blocks = sum(e.blocks for e in res.items)
        con.print(f"\nFound {res.matched} namespace(s){shown}: {blocks} block(s), "
                  f"{size(res.stored_bytes)} on disk.")
    return EXIT_OK


def _inspect_rows(s) -> list[tuple[str, str]]:
    from kvstore.sizes import plural

    d = s.tiers[0]
    f = s.fragmentation
    misses = ("counted only while running (kvstore stats --socket S)"
              if s.counters.misses is None else str(s.counters.misses))
    return [
        ("store", s.path),
        ("format", f"disk format version {s.format_version}"),
        ("disk tier", f"{plural(d.blocks, 'block')}, {size(d.used_bytes)} stored "
                      f"({size(d.raw_bytes)} raw); capacity not recorded in the store "
                      "(the engines' disk_capacity setting)"),
        ("disk files", f"{size(d.file_bytes)} (segments + index); filesystem "
                       f"{size(d.filesystem_free_bytes)} free of {size(d.filesystem_bytes)}"),
        ("memory tiers", "held by the processes that have the store open: "
                         "kvstore stats --socket S for a daemon's"),
        ("segments", f"{plural(f.segments, 'file')}, {size(f.segment_bytes)}: "
                     f"{size(f.live_bytes)} live, {size(f.dead_bytes)} dead "
                     f"({f.live_fraction:.1%} live)"),
        ("fragmentation", f"{plural(f.sparse_segments, 'segment')} below "
                          f"{f.sparse_threshold:.0%} live, {size(f.reclaimable_bytes)} "
                          "reclaimable (kvstore compact)"),
        ("leftovers", f"{plural(f.temp_files, 'temp file')}, "
                      f"{plural(f.unreferenced_segments, 'unreferenced segment')} "
                      f"({size(f.unreferenced_bytes)}) (kvstore prune; recent ones may be "
                      "writes in flight)"),
        ("index", f"{s.index.path}: {size(s.index.file_bytes)}, "
                  f"{plural(s.index.blocks, 'block')}, {plural(s.index.namespaces, 'namespace')}"),
        ("counters", f"{plural(s.counters.hits, 'hit')} persisted on blocks; misses {misses}"),
    ]


def _namespace_rows(e, now: float) -> list[tuple[str, str]]:
    from kvstore.admin import format_age

    extras = ", ".join(f"{k}={v}" for k, v in e.extras) or "-"
    return [("namespace", e.namespace_id), ("model", e.model_id or "?"),
            ("revision", e.model_revision or "-"), ("layout", e.layout),
            ("block", size(e.block_nbytes)), ("extras", extras),
            ("format version", str(e.format_version)), ("blocks", str(e.blocks)),
            ("stored", f"{size(e.stored_bytes)} ({size(e.raw_bytes)} raw)"),
            ("tiers", ",".join(e.tiers) or "-"), ("created", format_age(e.created, now)),
            ("last accessed", format_age(e.last_accessed, now)), ("hits", str(e.hits))]


def _block_rows(e, now: float) -> list[tuple[str, str]]:
    from kvstore.admin import format_age

    return [("block", e.key), ("namespace", f"{e.namespace_id} ({e.model_id or '?'})"),
            ("parent", e.parent or "- (the first block of a prompt)"),
            ("stored", f"{size(e.stored_bytes)} ({size(e.raw_bytes)} raw, codec {e.codec})"),
            ("segment", f"{e.segment:x} at offset {e.offset}"), ("checksum", e.checksum),
            ("tiers", ",".join(e.tiers) or "-"), ("created", format_age(e.created, now)),
            ("last accessed", format_age(e.last_accessed, now)), ("hits", str(e.hits))]


def _run_inspect_target(args: argparse.Namespace) -> int:
    from kvstore.admin import inspect_target
    from kvstore.commands.output import kv_grid

    now = time.time()
    res = inspect_target(args.store, args.target, now=now)
    if args.format == "json":
        emit_json("inspect", res)
        return EXIT_OK
    con = out_console()
    parts = [_namespace_rows(e, now) for e in res.namespaces]
    parts += [_block_rows(e, now) for e in res.blocks]
    for i, rows in enumerate(parts):
        if i:
            con.print()
        con.print(kv_grid(rows, right=False))
    return EXIT_OK


def run_inspect(args: argparse.Namespace) -> int:
    from kvstore.admin import inspect_store
    from kvstore.commands.output import kv_grid

    if getattr(args, "target", None) is not None:
        return _run_inspect_target(args)
    s = inspect_store(args.store)
    if args.format == "json":
        emit_json("inspect", s)
        return EXIT_OK
    con = out_console()
    con.print(kv_grid(_inspect_rows(s), right=False))
    if s.namespaces:
        con.print()
        con.print(namespace_table(s.namespaces, time.time(), width=con.width))
    return EXIT_OK
