"""The CLI's shared vocabulary: argparse value types that refuse bad input as usage errors
(exit 2, naming the flag), and the options every subcommand spells the same way."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

STORE_HELP = "store directory (default: $KVSTORE_PATH or ~/.cache/kvstore)"


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples of an epilog as written; wider option column."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def examples(*lines: str, extra: str = "") -> str:
    """An epilog: ``examples:`` and one command per line (after ``extra``, if given)."""
    head = f"{extra.rstrip()}\n\n" if extra else ""
    return head + "examples:\n" + "\n".join(f"  {ln}" for ln in lines)


def size(*, minimum: int = 0, hint: str = "") -> Callable[[str], int]:
    """A byte size (``4GiB``, ``512MiB``, ``0``) of at least ``minimum`` bytes."""

    def parse(text: str) -> int:
        from kvstore.errors import SizeError
        from kvstore.sizes import format_size, parse_size

        try:
            n = parse_size(text, what="the size")
        except SizeError as e:
            raise argparse.ArgumentTypeError(str(e).replace("the size=", "")) from None
        if n < minimum and not (n == 0 and minimum == 0):
            raise argparse.ArgumentTypeError(
                f"{text} is less than {format_size(minimum)}{hint}")
        return n

    parse.__name__ = "size"  # argparse names the type in "invalid size value" messages
    return parse


def integer(*, minimum: int | None = None, maximum: int | None = None,
            hint: str = "") -> Callable[[str], int]:
    """An int in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        lo = "" if minimum is None else f">= {minimum}"
        hi = "" if maximum is None else f"<= {maximum}"
        if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
            bound = " and ".join(b for b in (lo, hi) if b)
            raise argparse.ArgumentTypeError(f"must be {bound}, got {v}{hint}")
        return v

    parse.__name__ = "integer"
    return parse


def seconds(*, positive: bool = False, hint: str = "") -> Callable[[str], float]:
    """A finite number of seconds, ``> 0`` or ``>= 0``."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds {bound} (got {text}){hint}")
        return v

    parse.__name__ = "seconds"
    return parse


#: ``--grace`` of prune and verify: the same rule, the same words
grace = seconds(hint=": files and blocks younger than this are left alone because another "
                "process may be writing them")


def add_store(p: argparse.ArgumentParser, help: str = STORE_HELP) -> None:
    p.add_argument("--store", metavar="PATH", help=help)


def add_namespace_fields(g: argparse._ArgumentGroup, *, model_help: str) -> None:
    """The fields a namespace id hashes (``--model``, ``--layout``, ``--revision``,
    ``--tp-rank``, ``--tp-size``, ``--extra``), as ``explain`` and ``import`` take them."""
    g.add_argument("--model", metavar="MODEL_ID", help=model_help)
    g.add_argument("--layout", metavar="LAYOUT",
                   help="block layout as 'kvstore ls' prints it, e.g. "
                   "'bfloat16 L32 P2 T16 H8 D128' (optionally ' tp0/2')")
    g.add_argument("--revision", metavar="REV", help="model_revision (default: none)")
    g.add_argument("--tp-rank", type=integer(minimum=0), metavar="N",
                   help="tensor-parallel rank (default 0)")
    g.add_argument("--tp-size", type=integer(minimum=1), metavar="N",
                   help="tensor-parallel size (default 1)")
    g.add_argument("--extra", action="append", metavar="KEY=VALUE",
                   help="a namespace extra (repeatable), as namespace_extras")


def namespace_fields_of(args: argparse.Namespace):
    """The ``NamespaceFields`` that :func:`add_namespace_fields`' options give (``--model``
    and ``--layout`` set)."""
    from kvstore.admin.nsmatch import parse_extras, parse_layout

    return parse_layout(args.layout, model_id=args.model, revision=args.revision or "",
                        tp_rank=args.tp_rank, tp_size=args.tp_size,
                        extras=parse_extras(args.extra or ()))


def add_format(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=["table", "json"], default="table",
                   help="human table (default) or JSON for scripts (docs/cli.md has the schema)")
