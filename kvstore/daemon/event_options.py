"""``kvstore serve``'s KV event options (``--kv-events ...``), kept light: the CLI builds its
parser on every call, and the publisher (pyzmq) is only imported when the daemon starts one."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvstore.errors import ConfigError

if TYPE_CHECKING:  # the events package is imported when a daemon starts, not for --help
    from kvstore.events.config import EventsConfig


def _endpoint(text: str) -> str:
    if not text.startswith(("tcp://", "ipc://", "inproc://")):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a ZMQ endpoint: use tcp://HOST:PORT (tcp://*:5557 for every "
            "interface) or ipc:///PATH")
    if text.startswith("tcp://") and not text.rpartition(":")[2].isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} needs a port: tcp://HOST:PORT")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options to ``kvstore serve``'s parser."""
    g = parser.add_argument_group(
        "KV events", "publish what the daemon holds, in vLLM's KV event schema, for routers "
        "(docs/integrations.md, \"Routing across engines\")")
    g.add_argument("--kv-events", type=_endpoint, metavar="ENDPOINT",
                   help="ZMQ PUB endpoint to bind, e.g. tcp://*:5557 or ipc:///run/kvstore/ev")
    g.add_argument("--kv-events-replay", type=_endpoint, metavar="ENDPOINT",
                   help="replay/snapshot endpoint to bind (default: the next TCP port, or "
                        "PATH.replay)")
    g.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                   help="topic frame of every message (default empty)")
    g.add_argument("--kv-events-layout", choices=["map", "array"], default="map",
                   help="event encoding: map (vLLM >= 0.28, default) or array (older vLLM)")


def config_from_args(args: argparse.Namespace) -> EventsConfig | None:
    """What :func:`add_arguments` collected (``None``: no ``--kv-events``)."""
    if not getattr(args, "kv_events", None):
        if getattr(args, "kv_events_replay", None):
            raise ConfigError("--kv-events-replay needs --kv-events")
        return None
    from kvstore.events.config import EventsConfig

    return EventsConfig(args.kv_events, replay_endpoint=args.kv_events_replay or None,
                        topic=args.kv_events_topic, layout=args.kv_events_layout)
