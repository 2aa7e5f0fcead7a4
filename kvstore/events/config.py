"""``EventsConfig``: where and how a publisher sends its KV events."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.events.codec import LAYOUTS

_SCHEMES = ("tcp://", "ipc://", "inproc://")


def replay_endpoint_for(endpoint: str) -> str:
    """The replay socket beside ``endpoint``: the next TCP port (port 0: another free port),
    ``<path>.replay`` for ``ipc://``, ``<name>-replay`` for ``inproc://``."""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[6:].rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"a tcp endpoint needs a port (tcp://HOST:PORT), got {endpoint!r}")
        n = int(port)
        return f"tcp://{host}:{n + 1 if n else 0}"
    if endpoint.startswith("ipc://"):
        return endpoint + ".replay"
    return endpoint + "-replay"


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """``endpoint`` is bound by the publisher's PUB socket (``tcp://*:5557``,
    ``tcp://10.0.0.5:5557``, ``ipc:///run/kvstore/events``); ``replay_endpoint`` by its replay
    and snapshot socket (default: :func:`replay_endpoint_for`)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    layout: str = "map"  # "array": vLLM < 0.28 consumers
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark (messages)
    heartbeat_s: float = 1.0  # an empty batch after this long without one: liveness
    max_batch_blocks: int = 4096  # block hashes per batch at most (bounds a message)
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(_SCHEMES):
            raise ConfigError(f"the events endpoint must start with tcp://, ipc:// or "
                              f"inproc://, got {self.endpoint!r}")
        if self.replay_endpoint is not None and not self.replay_endpoint.startswith(_SCHEMES):
            raise ConfigError(f"the replay endpoint must start with tcp://, ipc:// or "
                              f"inproc://, got {self.replay_endpoint!r}")
        if self.replay_endpoint is None:
            object.__setattr__(self, "replay_endpoint", replay_endpoint_for(self.endpoint))
        if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":0"):
            raise ConfigError("the events and replay endpoints must differ")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        for name in ("buffer_steps", "hwm", "max_batch_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if not self.heartbeat_s > 0:
            raise ConfigError("heartbeat_s must be > 0")
