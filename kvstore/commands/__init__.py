"""Subcommands of the ``kvstore`` CLI: each module has ``register(subparsers)``."""

#: modules whose ``register`` the CLI calls, in help order
COMMANDS = (
    "kvstore.commands.demo",
    "kvstore.commands.bench",
)
