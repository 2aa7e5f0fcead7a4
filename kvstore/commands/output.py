"""What every subcommand prints through: consoles, JSON documents, borderless tables,
progress bars, confirmation prompts, and the guard that turns library errors into a one-line
message and exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

EXIT_OK, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
_SCHEMA = "kvstore.{}/1"


def out_console():
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich would exit 1; kvstore.cli ends quietly
            raise BrokenPipeError

    c = _Console(file=sys.stdout, highlight=False, soft_wrap=False)
    if not c.is_terminal:
        c = _Console(file=sys.stdout, highlight=False, soft_wrap=False, width=220)
    return c


def err_console():
    from rich.console import Console

    return Console(file=sys.stderr, highlight=False)


def error(cmd: str, msg: str) -> int:
    print(f"kvstore {cmd}: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def os_error_text(e: OSError) -> str:
    """``Not a directory: /path`` — the OS's words and the path they are about."""
    text = e.strerror or str(e)
    if e.filename:
        text += f": {e.filename}"
    if getattr(e, "filename2", None):
        text += f" -> {e.filename2}"
    return text


def emit_json(cmd: str, obj: Any, *, indent: int | None = 2) -> None:
    from kvstore.admin import to_jsonable

    data = {"schema": _SCHEMA.format(cmd), **to_jsonable(obj)}
    print(json.dumps(data, indent=indent))


def guard(cmd: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Map library errors to exit status 2 with a one-line message."""

    def run(args: argparse.Namespace) -> int:
        from kvstore.errors import KVStoreError

        try:
            return fn(args)
        except KVStoreError as e:
            return error(cmd, str(e))
        except BrokenPipeError:
            raise  # the reader went away: kvstore.cli ends quietly
        except OSError as e:
            return error(cmd, os_error_text(e))
        except KeyboardInterrupt:
            print(f"kvstore {cmd}: interrupted", file=sys.stderr)
            return 130

    return run


def confirm(cmd: str, question: str, *, yes: bool, stdin_used: bool = False) -> bool:
    """True to go ahead. Without ``-y`` asks on the terminal; refuses without one."""
    if yes:
        return True
    if stdin_used or not sys.stdin.isatty():
        why = "targets were read from stdin" if stdin_used else "stdin is not a terminal"
        print(f"kvstore {cmd}: refusing to go ahead without confirmation ({why}); pass -y "
              "(--yes) to confirm, or --dry-run to only see what would happen", file=sys.stderr)
        return False
    sys.stderr.write(f"{question} [y/N] ")
    sys.stderr.flush()
    answer = sys.stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        print("Nothing changed.", file=sys.stderr)
        return False
    return True


def size(n: int | None) -> str:
    from kvstore.sizes import format_size

    return "unknown" if n is None else format_size(n)


def short(h: str | None, n: int = 12) -> str:
    return "-" if h is None else h[:n]


def table(cols, rows, *, wrap=(), title: str | None = None, width: int | None = None, drop=()):
    """An aligned table without borders. Columns not in ``wrap`` never wrap nor shrink below
    their widest cell; those in ``wrap`` fold when the terminal is narrow. When the table
    cannot fit ``width``, the columns in ``drop`` are left out, in that order, until it does
    (``--format json`` has everything)."""
    from rich.table import Table

    rows = [list(r) for r in rows]
    widths = [max([len(c[0])] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    want = [min(w, 24) if cols[i][0] in wrap else w for i, w in enumerate(widths)]
    keep = list(range(len(cols)))
    if width is not None:
        for name in drop:
            if sum(want[i] for i in keep) + 2 * (len(keep) - 1) <= width:
                break
            keep = [i for i in keep if cols[i][0] != name]
    t = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
    for i in keep:
        name, just = cols[i]
        if name in wrap:
            t.add_column(name, justify=just, overflow="fold")
        else:
            t.add_column(name, justify=just, no_wrap=True, min_width=widths[i])
    for r in rows:
        t.add_row(*[r[i] for i in keep])
    return t


def kv_grid(rows, *, right: bool = True):
    """Two columns, ``name  value``, without borders."""
    from rich.table import Table

    kv = Table.grid(padding=(0, 2))
    kv.add_column(style="bold", no_wrap=True)
    kv.add_column(justify="right" if right else "left", no_wrap=right)
    for name, val in rows:
        kv.add_row(name, val)
    return kv


def progress(err, what: str):
    """A transient progress bar on ``err`` (off when it is not a terminal)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[extra]}"), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err, transient=True,
                    disable=not err.is_terminal)


def with_progress(what: str, total: int, work: Callable[[Callable[[str, int, int], None]], Any]):
    """``work(tick)`` under a progress bar on stderr; ``tick(label, done, total)`` moves it."""
    err = err_console()
    with progress(err, what) as bar:
        task = bar.add_task(what, total=total, extra="")

        def tick(label: str, done: int, of: int) -> None:
            bar.update(task, completed=done, total=of, extra=label)

        return work(tick)


def refuse_if_served(cmd: str, store: str | None, what: str) -> int | None:
    """Exit status 2 with a one-line message when a daemon serves the store, else None."""
    from kvstore.admin.common import StoreServedError
    from kvstore.admin.common import refuse_if_served as refuse

    try:
        refuse(store, what)
    except StoreServedError as e:
        return error(cmd, str(e))
    return None
