"""The ``kvstore`` command line: subcommands live in :mod:`kvstore.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvstore.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvstore", description="Persistent, tiered KV prefix cache for LLM inference."
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        mod.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
