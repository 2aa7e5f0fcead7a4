"""``DaemonConfig``: everything ``kvstore serve`` resolved from its arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvstore.daemon.security import Limits
from kvstore.errors import ConfigError
from kvstore.events.config import EventsConfig
from kvstore.filemodes import resolve_group
from kvstore.tiers.admission import check_admission
from kvstore.tiers.policy import DEFAULT_EVICTION, EVICTIONS

#: "client": honour each hello's salt policy; "per-uid": every namespace is per uid
DAEMON_SALT_POLICIES = ("client", "per-uid")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    path: Path  # the store directory (disk tier) shared by every namespace
    socket_path: Path
    cpu_capacity: int = 4 << 30  # warm tier per namespace (the most a hello may ask for)
    disk_capacity: int = 64 << 30  # 0: no disk tier
    allow_uids: tuple[int, ...] = ()  # empty: the daemon's own uid only
    metrics_path: Path | None = None
    metrics_port: int | None = None
    metrics_interval: float = 10.0
    limits: Limits = field(default_factory=Limits)
    salt_policy: str = "client"
    workers: int = 8  # threads doing store work off the event loop
    shm_base: Path = Path("/dev/shm")
    admission: str = "always"  # the disk tier's: written on a block's first or second put
    warm_admission: str = "always"  # the warm tiers' (kvstore.tiers.admission)
    eviction: str = DEFAULT_EVICTION  # the warm tiers' eviction policy (kvstore.tiers.policy)
    disk_codec: str = "none"
    shutdown_timeout: float = 30.0  # seconds the whole shutdown may take on SIGTERM
    kv_events: EventsConfig | None = None  # publish KV events (kvstore.daemon.events)
    # share the store's files with this group (name or gid; directories 2750, files 0640);
    # None: as the store records it, private (0700/0600) when new (kvstore.filemodes)
    group: str | int | None = None

    def __post_init__(self) -> None:
        if self.salt_policy not in DAEMON_SALT_POLICIES:
            raise ConfigError(f"salt_policy must be one of {', '.join(DAEMON_SALT_POLICIES)}")
        if self.metrics_path is not None and self.metrics_port is not None:
            raise ConfigError("give --metrics-path or --metrics-port, not both")
        if self.cpu_capacity <= 0:
            raise ConfigError("the daemon's cpu capacity must be > 0: the warm tier is the "
                              "shared memory clients read and write")
        if self.workers < 1:
            raise ConfigError("workers must be >= 1")
        check_admission(self.admission, "admission")
        check_admission(self.warm_admission, "warm_admission")
        if self.eviction not in EVICTIONS:
            raise ConfigError(f"eviction must be one of {', '.join(EVICTIONS)}, "
                              f"got {self.eviction!r}")
        resolve_group(self.group)  # an unknown group: at start, naming it
