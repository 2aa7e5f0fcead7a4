"""Subcommands of the ``kvstore`` CLI: each module has ``register(subparsers)``.

A module listed here that is not importable (a piece still being built) is skipped.
"""

#: modules whose ``register`` the CLI calls, in help order
COMMANDS = (
    "kvstore.commands.demo",
    "kvstore.commands.serve",
    "kvstore.commands.admin",
    "kvstore.commands.recover",
    "kvstore.commands.explain",
    "kvstore.commands.packs",
    "kvstore.commands.batch",
    "kvstore.commands.replay",
    "kvstore.commands.bench",
)
