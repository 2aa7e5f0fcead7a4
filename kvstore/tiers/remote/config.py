"""The remote tier's settings and the shapes its calls take and give."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.errors import ConfigError
from kvstore.tiers.remote import format as fmt
from kvstore.tiers.remote.conn import parse_remote_url, redact

if TYPE_CHECKING:
    import torch

__all__ = ["ADMISSIONS", "RemoteConfig", "RemoteStats", "RemoteWrite", "deadline_budget"]

ADMISSIONS = ("always", "second-hit")


@dataclass(frozen=True, slots=True, repr=False)
class RemoteConfig:
    """Settings of the remote tier.

    ``url``: ``redis://[user:pass@]host:port/db``, ``rediss://...`` (TLS),
    ``redis+cluster://host:port[,host:port...]`` (startup nodes of a Redis Cluster) or
    ``rediss+cluster://``. Query arguments are redis-py connection arguments
    (``?ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem``). ``username``/``password``/``ssl_*``
    and ``connection_kwargs`` override the URL's.

    ``codec``: ``"zstd"`` (byte-shuffled by the dtype's item size; default) or ``"none"``.
    ``ttl_s``: expiry set on every write (None: no TTL; eviction is Redis's LRU).
    ``budget_s``: the most a ``leading_run`` or ``read_many`` call waits for Redis; also the
    socket connect/read timeout. Reads get ``budget_s + raw bytes / min_read_rate``.
    ``write_budget_s``: the same for ``write_blocks``/``delete`` (writes run in the background).
    ``backoff_s``/``backoff_max_s``: circuit breaker interval after a failure, doubling.
    ``admission``: ``"always"`` or ``"second-hit"`` — recorded for the store, which applies it.
    """

    url: str
    codec: str = "zstd"
    ttl_s: float | None = None
    budget_s: float = 0.05
    key_prefix: str = "kvstore:"
    admission: str = "always"
    write_budget_s: float = 2.0
    min_read_rate: float = 200e6
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    zstd_level: int = 1
    workers: int = 8
    username: str | None = None
    password: str | None = None
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str | None = None
    connection_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        parse_remote_url(self.url)  # raises ConfigError
        if self.codec not in fmt.REMOTE_CODECS:
            raise ConfigError(f"remote codec must be one of {fmt.REMOTE_CODECS}, got {self.codec!r}")
        if self.admission not in ADMISSIONS:
            raise ConfigError(f"remote admission must be one of {ADMISSIONS}, got {self.admission!r}")
        for name in ("budget_s", "write_budget_s", "min_read_rate", "backoff_s", "backoff_max_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"remote {name} must be a number > 0, got {v!r}")
        if self.ttl_s is not None and (isinstance(self.ttl_s, bool)
                                       or not isinstance(self.ttl_s, (int, float))
                                       or not self.ttl_s > 0):
            raise ConfigError(f"remote ttl_s must be None or a number of seconds > 0, "
                              f"got {self.ttl_s!r}")
        if not isinstance(self.key_prefix, str) or not self.key_prefix:
            raise ConfigError(f"remote key_prefix must be a non-empty str, got {self.key_prefix!r}")
        if not isinstance(self.zstd_level, int) or not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"remote zstd_level must be 1..22, got {self.zstd_level!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"remote workers must be an int >= 1, got {self.workers!r}")

    @property
    def cluster(self) -> bool:
        return parse_remote_url(self.url)[0]

    def __repr__(self) -> str:
        return (f"RemoteConfig(url={redact(self.url)!r}, codec={self.codec!r}, "
                f"ttl_s={self.ttl_s!r}, budget_s={self.budget_s!r}, "
                f"key_prefix={self.key_prefix!r}, admission={self.admission!r})")


@dataclass(frozen=True, slots=True)
class RemoteWrite:
    """One block to write. ``data``: CPU, contiguous, uint8, 1-D (the raw block). ``itemsize``:
    bytes per element of the KV dtype (2 for bf16/fp16: byte-shuffled before zstd); 0 = ask the
    tier's ``itemsize_for(namespace_id)``, else no shuffle."""

    key: bytes
    namespace_id: bytes
    data: torch.Tensor
    itemsize: int = 0


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """Counters since the tier was opened (this process).

    ``hits``/``misses``/``corrupt`` count blocks asked of ``read_many`` (a miss: absent, node
    skipped or failed, no answer within the budget, written by a newer format); ``timeouts``
    and ``errors`` count failed node calls; ``skipped`` counts blocks not asked because the
    node's circuit breaker was open. ``bytes_sent``/``bytes_received`` are value bytes (header
    + payload), not protocol overhead. ``available``: every known node answered its last call.
    """

    hits: int
    misses: int
    corrupt: int
    timeouts: int
    errors: int
    skipped: int
    lookups: int
    lookup_blocks: int
    blocks_written: int
    write_failures: int
    deleted: int
    bytes_sent: int
    bytes_received: int
    raw_bytes_written: int
    stored_bytes_written: int
    available: bool
    nodes: int
    nodes_down: int

    @property
    def compression_ratio(self) -> float:
        """Raw bytes / stored bytes (header included) of the blocks written; 1.0 before any."""
        return self.raw_bytes_written / self.stored_bytes_written if self.stored_bytes_written else 1.0


def deadline_budget(what: str, cfg: RemoteConfig) -> str:
    if what in ("write", "delete"):
        return f"the write budget ({cfg.write_budget_s:g} s)"
    return f"the budget ({cfg.budget_s * 1e3:g} ms{' + transfer time' if what == 'read' else ''})"
