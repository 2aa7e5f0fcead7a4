"""``kvstore serve``: the sidecar daemon (see docs/operations.md, "Running the daemon")."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    from kvstore.daemon.config import DaemonConfig
    from kvstore.daemon.daemon import run_daemon
    from kvstore.daemon.security import Limits
    from kvstore.errors import KVStoreError
    from kvstore.sizes import parse_size

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s kvstore-serve %(levelname)s %(message)s")
    limits = Limits(
        max_frame=parse_size(args.max_frame, what="--max-frame"),
        max_keys=args.max_keys, max_leases=args.max_leases,
        max_connections=args.max_connections, max_namespaces=args.max_namespaces,
    )
    config = DaemonConfig(
        path=Path(args.path).expanduser(),
        socket_path=Path(args.socket).expanduser(),
        cpu_capacity=parse_size(args.cpu_capacity, what="--cpu-capacity"),
        disk_capacity=parse_size(args.disk_capacity, what="--disk-capacity"),
        allow_uids=tuple(args.allow_uid or ()),
        metrics_path=Path(args.metrics_path) if args.metrics_path else None,
        metrics_port=args.metrics_port,
        metrics_interval=args.metrics_interval,
        limits=limits,
        salt_policy=args.salt_policy,
        workers=args.workers,
        shm_base=Path(args.shm_dir),
        admission=args.admission,
        disk_codec=args.disk_codec,
        shutdown_timeout=args.shutdown_timeout,
    )
    try:
        return run_daemon(config)
    except (KVStoreError, OSError) as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 2


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve", help="run the sidecar daemon: engines share one cache over a Unix socket",
        description="Serve a store to engine processes on this host (kvstore.connect()).",
    )
    s.add_argument("--path", required=True, help="store directory (disk tier)")
    s.add_argument("--socket", required=True,
                   help="Unix socket path; its directory is created 0700 when missing")
    s.add_argument("--cpu-capacity", default="4GiB",
                   help="warm tier (shared memory) per namespace (default 4GiB)")
    s.add_argument("--disk-capacity", default="64GiB",
                   help="disk tier budget (default 64GiB; 0 disables the disk tier)")
    s.add_argument("--allow-uid", type=int, action="append", metavar="UID",
                   help="uid allowed to connect (repeatable; default: the daemon's own uid)")
    m = s.add_mutually_exclusive_group()
    m.add_argument("--metrics-path", metavar="FILE",
                   help="write Prometheus metrics to FILE every 10 s")
    m.add_argument("--metrics-port", type=int, metavar="N",
                   help="serve Prometheus metrics on http://127.0.0.1:N/metrics")
    s.add_argument("--metrics-interval", type=float, default=10.0, help=argparse.SUPPRESS)
    s.add_argument("--max-frame", default="4MiB", help="largest request frame (default 4MiB)")
    s.add_argument("--max-keys", type=int, default=65536, help="keys per request")
    s.add_argument("--max-leases", type=int, default=1024,
                   help="leases + granted puts outstanding per connection")
    s.add_argument("--max-connections", type=int, default=256)
    s.add_argument("--max-namespaces", type=int, default=16,
                   help="open stores; the least recently used idle one is closed for room")
    s.add_argument("--salt-policy", choices=["client", "per-uid"], default="client",
                   help="per-uid: every namespace also depends on the client's uid")
    s.add_argument("--workers", type=int, default=8, help="threads doing store work")
    s.add_argument("--shm-dir", default="/dev/shm", help="where the shared-memory slabs live")
    s.add_argument("--admission", choices=["always", "second-hit"], default="always")
    s.add_argument("--disk-codec", choices=["none", "zstd"], default="none")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=run)
