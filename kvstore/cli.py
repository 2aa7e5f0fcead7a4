"""The ``kvstore`` command line: subcommands live in :mod:`kvstore.commands`.

Usage errors exit 2 with the subcommand's own usage (``main`` raises argparse's
``SystemExit(2)``); a reader that goes away (``kvstore ls
| head``) ends the command quietly (exit 141, as if killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

from kvstore.commands import COMMANDS

#: a value like ``-1GiB`` or ``-5``: argparse takes it for an option unless joined to its flag
_NEGATIVE_VALUE = re.compile(r"^-(\d|\.\d)")
EXIT_BROKEN_PIPE = 141


class _Parser(argparse.ArgumentParser):
    """Reports arguments no subcommand knows with that subcommand's usage, not the top one."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            _chosen(self, ns).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def _subparsers_action(p: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = _subparsers_action(p)
    return {} if action is None else dict(action.choices)


def _chosen(p: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser ``ns`` was parsed by (``kvstore batch run``)."""
    while (action := _subparsers_action(p)) is not None:
        name = getattr(ns, action.dest, None)
        if name not in action.choices:
            break
        p = action.choices[name]
    return p


def build_parser() -> argparse.ArgumentParser:
    from kvstore import __version__
    from kvstore.commands.args import Formatter, examples

    p = _Parser(
        prog="kvstore", formatter_class=Formatter,
        description="Persistent, tiered KV prefix cache for LLM inference.",
        epilog=examples("kvstore demo", "kvstore serve --store ~/.cache/kvstore --socket "
                        "/run/user/$UID/kvstore.sock", "kvstore ls", "kvstore <command> --help",
                        extra="docs/cli.md describes every command."),
    )
    p.add_argument("--version", action="version",
                   version=f"kvstore {__version__} (python {sys.version.split()[0]})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=argparse.ArgumentParser)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        mod.register(sub)
    return p


def _value_options(p: argparse.ArgumentParser) -> set[str]:
    """Option strings (of every subcommand) that take exactly one value."""
    out: set[str] = set()
    todo = [p]
    while todo:
        parser = todo.pop()
        todo.extend(_subparsers(parser).values())
        for action in parser._actions:
            if action.option_strings and action.nargs is None:
                out.update(action.option_strings)
    return out


def join_negative_values(p: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--disk-capacity -1GiB`` -> ``--disk-capacity=-1GiB``, so that the value reaches its
    type check (which refuses it with a message naming the flag) instead of argparse calling
    it a missing argument."""
    takes_value = _value_options(p)
    out: list[str] = []
    it = iter(argv)
    for tok in it:
        if tok == "--":
            out.append(tok)
            out.extend(it)
            break
        if tok in takes_value:
            nxt = next(it, None)
            if nxt is not None and _NEGATIVE_VALUE.match(nxt):
                out.append(f"{tok}={nxt}")
                continue
            out.append(tok)
            if nxt is not None:
                out.append(nxt)
            continue
        out.append(tok)
    return out


def _quiet_broken_pipe() -> int:
    # Python flushes stdout once more at exit: point it at /dev/null so that flush cannot
    # fail again and print "Exception ignored ... BrokenPipeError"
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(join_negative_values(parser, argv))
        status = int(args.func(args))
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return _quiet_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
