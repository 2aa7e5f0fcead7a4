"""``kvstore serve --kv-events`` daemons for the event and routing tests.

Until ``kvstore serve`` registers the KV event options itself (the two-line hook:
``event_options.add_arguments(s)`` in its ``register``, ``kv_events=
event_options.config_from_args(args)`` in its ``DaemonConfig``), the daemon is started through
the same parser and ``run_daemon`` with the options added on the side (``_BOOT``): the same
daemon code either way.
"""

from __future__ import annotations

import argparse
import functools

from kvstore.daemon.process import DaemonProcess

_BOOT = """
import dataclasses, sys
import kvstore.daemon.daemon as d
from kvstore.cli import build_parser
from kvstore.daemon import event_options
p = build_parser()
serve = next(a for a in p._actions if isinstance(a, __import__("argparse")._SubParsersAction))
event_options.add_arguments(serve.choices["serve"])
args = p.parse_args(sys.argv[1:])
events = event_options.config_from_args(args)
run = d.run_daemon
d.run_daemon = lambda cfg: run(dataclasses.replace(cfg, kv_events=events))
sys.exit(args.func(args))
"""


@functools.cache
def serve_has_event_options() -> bool:
    from kvstore.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return any("--kv-events" in a.option_strings for a in sub.choices["serve"]._actions)


class EventDaemon(DaemonProcess):
    """A ``kvstore serve`` publishing its KV events on ``endpoint``."""

    def __init__(self, path, socket_path, endpoint: str, *args: str, **kw) -> None:
        super().__init__(path, socket_path, "--kv-events", endpoint, *args, **kw)
        self.endpoint = endpoint

    def command(self) -> list[str]:
        cmd = super().command()
        if serve_has_event_options():
            return cmd
        i = cmd.index("kvstore.cli")
        return [*cmd[: i - 1], "-c", _BOOT, *cmd[i + 1:]]
