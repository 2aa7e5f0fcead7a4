"""``kvstore serve``: the sidecar daemon (see docs/operations.md, "Running the daemon").

Every flag is checked before anything starts: a bad value is a usage error (exit 2) naming
the flag; a path the daemon cannot use is a one-line error (exit 2) before it takes the
store's lock or binds the socket.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvstore.commands import args as a

#: the smallest warm tier worth starting: blocks of real models are far larger (Llama-3-8B,
#: 16 tokens: 2 MiB); below this only toy layouts fit (the tests use 256-byte blocks)
MIN_CPU_CAPACITY = 16 << 10


def run(args: argparse.Namespace) -> int:
    from kvstore.commands.output import error, os_error_text
    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.daemon import run_daemon
    from kvstore.daemon.event_options import config_from_args
    from kvstore.daemon.security import Limits
    from kvstore.errors import KVStoreError

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s kvstore-serve %(levelname)s %(message)s")
    try:
        limits = Limits(max_frame=args.max_frame, max_keys=args.max_keys,
                        max_leases=args.max_leases, max_connections=args.max_connections,
                        max_namespaces=args.max_namespaces)
        config = DaemonConfig(
            path=Path(args.store).expanduser().absolute(),
            socket_path=Path(args.socket).expanduser().absolute(),
            cpu_capacity=args.cpu_capacity, disk_capacity=args.disk_capacity,
            allow_uids=tuple(args.allow_uid or ()),
            metrics_path=Path(args.metrics_path).expanduser() if args.metrics_path else None,
            metrics_port=args.metrics_port, metrics_interval=args.metrics_interval,
            limits=limits, salt_policy=args.salt_policy, workers=args.workers,
            shm_base=Path(args.shm_dir), admission=args.admission,
            warm_admission=args.warm_admission, eviction=args.eviction,
            disk_codec=args.disk_codec,
            shutdown_timeout=args.shutdown_timeout, kv_events=config_from_args(args),
            group=args.group,
        )
        return run_daemon(config)
    except KVStoreError as e:
        return error("serve", str(e))
    except OSError as e:
        return error("serve", os_error_text(e))


_DESCRIPTION = """\
Serve a store to the engine processes of this host: they connect with kvstore.connect(S) (or
the vLLM connector's "socket" option) and share one cache. The daemon owns the store's disk
tier and one warm tier per namespace (model, revision, layout, TP rank) in shared memory;
clients copy to their own GPUs. SIGTERM or SIGINT stops it gracefully."""


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve", help="run the sidecar daemon: engines share one cache over a Unix socket",
        description=_DESCRIPTION, formatter_class=a.Formatter,
        epilog=a.examples(
            "kvstore serve --store ~/.cache/kvstore --socket $XDG_RUNTIME_DIR/kvstore.sock",
            "kvstore serve --store /var/cache/kvstore --socket /run/kvstore/kvstore.sock \\\n"
            "      --cpu-capacity 16GiB --disk-capacity 500GiB --metrics-port 9464",
            "kvstore serve --store /tmp/kv --socket /tmp/kv/s.sock --disk-capacity 0  "
            "# memory only",
            extra="docs/operations.md (\"Running the daemon\") covers sizing, security and "
            "systemd."))
    s.add_argument("--store", "--path", dest="store", metavar="PATH", required=True,
                   help="store directory (disk tier; created when missing). --path is the "
                   "old spelling")
    s.add_argument("--socket", required=True, metavar="PATH",
                   help="Unix socket path; its directory is created 0700 when missing")
    s.add_argument("--cpu-capacity", type=a.size(minimum=MIN_CPU_CAPACITY, hint=(
                       ": the warm tier holds whole blocks, and a real model's block is "
                       "hundreds of KiB or more (Llama-3-8B: 2 MiB)")),
                   default="4GiB", metavar="SIZE",
                   help="warm tier (shared memory) per namespace, e.g. 16GiB (default 4GiB)")
    s.add_argument("--disk-capacity", type=a.size(), default="64GiB", metavar="SIZE",
                   help="disk tier budget, e.g. 500GiB (default 64GiB; 0 disables the disk "
                   "tier: memory only)")
    s.add_argument("--allow-uid", type=a.integer(minimum=0), action="append", metavar="UID",
                   help="uid allowed to connect (repeatable; default: the daemon's own uid)")
    s.add_argument("--group", metavar="NAME",
                   help="share the store's files with this group (a name or gid): "
                   "directories 2750, files 0640. Default: private (0700/0600) whatever the "
                   "umask; a store shared before stays shared")
    m = s.add_mutually_exclusive_group()
    m.add_argument("--metrics-path", metavar="FILE",
                   help="write Prometheus metrics to FILE every 10 s (node-exporter textfile)")
    m.add_argument("--metrics-port", type=a.integer(minimum=0, maximum=65535), metavar="N",
                   help="serve Prometheus metrics on http://127.0.0.1:N/metrics (0: any free "
                   "port, logged)")
    s.add_argument("--metrics-interval", type=a.seconds(positive=True), default=10.0,
                   help=argparse.SUPPRESS)
    s.add_argument("--max-frame", type=a.size(minimum=1024), default="4MiB", metavar="SIZE",
                   help="largest request frame a client may send (default 4MiB, at least 1KiB)")
    s.add_argument("--max-keys", type=a.integer(minimum=1), default=65536, metavar="N",
                   help="keys in one request (default 65536)")
    s.add_argument("--max-leases", type=a.integer(minimum=1), default=1024, metavar="N",
                   help="leases + granted puts outstanding per connection (default 1024)")
    s.add_argument("--max-connections", type=a.integer(minimum=1), default=256, metavar="N",
                   help="client connections at once; more are refused (default 256)")
    s.add_argument("--max-namespaces", type=a.integer(minimum=1), default=16, metavar="N",
                   help="open stores (one per namespace); the least recently used idle one is "
                   "closed for room (default 16)")
    s.add_argument("--salt-policy", choices=["client", "per-uid"], default="client",
                   help="client: honour each client's salt; per-uid: every namespace also "
                   "depends on the client's uid (tenants never share blocks)")
    s.add_argument("--workers", type=a.integer(minimum=1, maximum=1024), default=8, metavar="N",
                   help="threads doing store work off the event loop (default 8)")
    s.add_argument("--shm-dir", default="/dev/shm", metavar="DIR",
                   help="where the warm tiers' shared-memory files live (default /dev/shm)")
    s.add_argument("--admission", choices=["always", "second-hit"], default="always",
                   help="always: every put is stored; second-hit: a block is stored the "
                   "second time it is put (one-off prompts never reach the disk)")
    s.add_argument("--warm-admission", choices=["always", "second-hit"], default="always",
                   help="always: a new block joins the warm tier like any other; second-hit: "
                   "a block not seen lately joins on probation, first to go unless used again "
                   "(scan protection; docs/architecture.md, eviction policies)")
    s.add_argument("--eviction", choices=["lru", "reuse", "adaptive"], default="adaptive",
                   help="eviction order of each namespace's warm tier: adaptive (recency plus "
                   "reuse weighed online, never worse than LRU on the measured traces; the "
                   "default), reuse or lru (docs/architecture.md, eviction policies)")
    s.add_argument("--disk-codec", choices=["none", "zstd"], default="none",
                   help="compression of blocks on disk (zstd: smaller, more CPU per read)")
    s.add_argument("--shutdown-timeout", type=a.seconds(), default=30.0, metavar="SECONDS",
                   help="seconds the whole shutdown on SIGTERM may take: requests in flight "
                   "finishing, then the stores flushed and closed (default 30)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity on stderr (default info: starts, stops, namespaces "
                   "opened, clients' hellos)")
    from kvstore.daemon.event_options import add_arguments as add_event_arguments

    add_event_arguments(s)
    s.set_defaults(func=run)
