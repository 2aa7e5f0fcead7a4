"""What the connector derives from its configuration: ``kv_connector_extra_config``
(:class:`ConnectorConfig`), the model's identity (:func:`model_identity`,
:func:`weights_fingerprint`) and the store layout that mirrors vLLM's pages
(:func:`engine_layout`).

Page layout. vLLM's CPU backend keeps, per layer, ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` where each (block, head) holds ``block_size`` K rows then ``block_size`` V
rows. The connector copies whole pages as opaque bytes: the store's layout is
``KVLayout(num_layers=L, num_kv_heads=H, head_dim=2 * head_size, kv_planes=1,
block_tokens=block_size)`` so one store block is exactly one vLLM page per layer, and a
layer's cache is copied through the byte-identical view ``[num_blocks, block_size, H,
2 * head_size]`` (page ``i`` = vLLM block ``i``). Because the bytes keep vLLM's interior order
(not kvstore's ``[T, H, D]``), the page layout is part of the namespace
(``namespace_extras["page_layout"]``): blocks written this way are only ever read back by the
same engine layout. On CUDA platforms (flash layout ``[2, num_blocks, block_size, H, D]``)
the store layout is the regular ``kv_planes=2`` one; that path is untested here.

This module imports vLLM only inside the functions that read vLLM's config objects.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "ConnectorConfig",
    "PAGE_LAYOUT_CPU",
    "PAGE_LAYOUT_FLASH",
    "engine_layout",
    "kvstore_transfer",
    "layer_order",
    "model_identity",
    "rank_keys",
    "tp_rank_size",
    "weights_fingerprint",
]

#: what ``KVTransferConfig`` names to load this connector
CONNECTOR_MODULE = "kvstore.integrations.vllm"
CONNECTOR_CLASS = "KVStoreConnector"

#: written into every namespace this connector opens (bumped if the mapping ever changes)
PAGE_LAYOUT_CPU = "vllm-cpu/v1 [num_kv_heads, block_size, 2*head_size] per layer, opaque bytes"
PAGE_LAYOUT_FLASH = "vllm-flash/v1 [2, num_blocks, block_size, num_kv_heads, head_size]"

#: ``load_timeout``'s default: seconds a load may take before vLLM gets its
#: request back as failed (to recompute): far above a healthy load (milliseconds to a second
#: or two for a long prompt from a slow disk), far below a client giving up on a request
DEFAULT_LOAD_TIMEOUT_S = 30.0

_EXTRA_KEYS = {
    "store_path", "cpu_capacity", "disk_capacity", "gpu_capacity", "admission", "disk_codec",
    "eviction", "socket", "warm_capacity", "salt_policy", "model_id", "model_revision", "stats_path",
    "timeout", "prefault", "layerwise", "wait_for_daemon", "save_decode_blocks",
    "load_async", "load_timeout",
}
#: keys that only mean something in one mode: given in the other, they would do nothing
_EMBEDDED_ONLY = ("cpu_capacity", "disk_capacity", "gpu_capacity", "admission", "eviction",
                  "disk_codec", "prefault")
_DAEMON_ONLY = ("warm_capacity", "salt_policy", "timeout", "wait_for_daemon")
_SIZE_KEYS = ("cpu_capacity", "disk_capacity", "gpu_capacity", "warm_capacity", "prefault")


# -- kv_connector_extra_config ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config``, validated.

    Embedded mode: ``store_path`` (None = memory only), ``cpu_capacity``, ``disk_capacity``,
    ``gpu_capacity``, ``admission``, ``eviction``, ``disk_codec`` (as
    :func:`kvstore.open_store`).
    Daemon mode: ``socket`` (and optionally ``warm_capacity``, ``salt_policy``, ``timeout``,
    ``wait_for_daemon``: as :func:`kvstore.connect`; without it a daemon that does not answer
    when the engine starts is an error).
    ``prefault`` (embedded, default ``"1GiB"``, ``0`` = off): how much of the warm tier to
    fault in at start, so the first loads after a restart do not pay page faults.
    ``layerwise``: scatter each layer when the forward reaches it (overlapping the rest of
    the load with compute) instead of before the forward. Default: on for GPUs, off on the
    CPU, where the copy threads would compete with the forward's OpenMP threads for cores
    (measured: slower on 2 cores).
    Both: ``model_id`` / ``model_revision`` override what is derived from vLLM's model config;
    ``stats_path`` (a directory) makes each connector write its counters there as JSON.
    ``save_decode_blocks`` (default on): save full blocks of generated tokens too, so a chat's
    next turn, whose prompt repeats the previous answer, hits it; off = prompt blocks only.
    ``load_async`` (default on): a hit that must come from below memory (disk, the daemon,
    Redis) is loaded in the background while the engine runs other requests (vLLM's
    ``load_kv_async``); off = every load before the step's forward.
    ``load_timeout`` (seconds, default 30): how long a load may take (a background one, or
    the step's loads before the forward together); past it vLLM gets the request back with its blocks as load errors (it recomputes them) and
    nothing the abandoned read does reaches vLLM's pages (``loads.py``).
    """

    socket: str | None = None
    store_path: str | None = None
    cpu_capacity: int | str | None = None
    disk_capacity: int | str | None = None
    gpu_capacity: int | str | None = None
    admission: str | Mapping[str, str] | None = None  # as open_store: a name or per tier
    eviction: str | Mapping[str, str] | None = None
    disk_codec: str | None = None
    warm_capacity: int | str | None = None
    salt_policy: str | None = None
    timeout: float | None = None
    wait_for_daemon: bool | None = None
    model_id: str | None = None
    model_revision: str | None = None
    stats_path: str | None = None
    prefault: int | str | None = None
    layerwise: bool | None = None
    save_decode_blocks: bool = True
    load_async: bool = True
    load_timeout: float = DEFAULT_LOAD_TIMEOUT_S

    @property
    def mode(self) -> str:
        return "daemon" if self.socket else "embedded"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config has unknown keys {unknown}; known: "
                f"{sorted(_EXTRA_KEYS)}"
            )
        for name in ("save_decode_blocks", "load_async", "layerwise", "wait_for_daemon"):
            v = extra.get(name)
            if v is not None and not isinstance(v, bool):
                raise ConfigError(f"kv_connector_extra_config: {name!r} must be true or false, "
                                  f"got {v!r}")
        _check_values(extra)
        if extra.get("socket") and extra.get("store_path"):
            raise ConfigError(
                "kv_connector_extra_config: give either 'socket' (daemon mode) or 'store_path' "
                "(embedded mode), not both"
            )
        daemon = extra.get("socket") is not None
        wrong = [k for k in (_EMBEDDED_ONLY if daemon else _DAEMON_ONLY)
                 if extra.get(k) is not None]
        if wrong:
            raise ConfigError(
                f"kv_connector_extra_config: {wrong} only apply in "
                f"{'embedded' if daemon else 'daemon'} mode, and this is "
                f"{'daemon' if daemon else 'embedded'} mode ("
                + ("'socket' is set: the daemon's own options size its cache, e.g. "
                   "'kvstore serve --cpu-capacity'" if daemon else "no 'socket'") + ")"
            )
        if "load_timeout" in extra:
            extra["load_timeout"] = float(extra["load_timeout"])
        return cls(**extra)


def _check_values(extra: Mapping[str, Any]) -> None:
    """Each value's type (and sizes parsed), so a malformed one is a ConfigError naming its
    key when the engine starts, not a TypeError, or a store that silently is not what was
    asked for, later."""
    from kvstore.sizes import parse_size

    def bad(name: str, want: str) -> ConfigError:
        return ConfigError(f"kv_connector_extra_config: {name!r} must be {want}, "
                           f"got {extra[name]!r:.80}")

    for name in ("store_path", "socket", "stats_path", "model_id"):
        v = extra.get(name)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise bad(name, "a non-empty string (leave the key out for none)")
    for name in ("model_revision", "salt_policy", "disk_codec"):
        if extra.get(name) is not None and not isinstance(extra[name], str):
            raise bad(name, "a string")
    for name in ("admission", "eviction"):
        if extra.get(name) is not None and not isinstance(extra[name], (str, Mapping)):
            raise bad(name, "a name or a {tier: name} mapping")
    for name in _SIZE_KEYS:
        if extra.get(name) is not None:
            parse_size(extra[name], what=f"kv_connector_extra_config: {name!r}")
    t = extra.get("timeout")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
        raise bad("timeout", "a number of seconds > 0")
    if "load_timeout" in extra:
        t = extra["load_timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise bad("load_timeout", "a number of seconds > 0 (how long a load "
                      "may take before vLLM recomputes its blocks; leave the key out for 30)")


def kvstore_transfer(extra: Mapping[str, Any], policy: str = "recompute") -> dict[str, Any]:
    """``KVTransferConfig`` arguments (as a dict) that load this connector with ``extra`` as
    its ``kv_connector_extra_config``: ``KVTransferConfig(**kvstore_transfer({...}))``."""
    return {
        "kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both", "kv_load_failure_policy": policy,
        "kv_connector_extra_config": dict(extra),
    }


# -- model identity --------------------------------------------------------------------------------
def _fingerprint_file(h: Any, path: Path, full_limit: int = 64 << 20, chunks: int = 64,
                      chunk: int = 64 << 10) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}|{size}|".encode())
    with open(path, "rb") as f:
        if size <= full_limit:
            for part in iter(lambda: f.read(1 << 20), b""):
                h.update(part)
            return
        head = f.read(8)
        h.update(head)
        if path.suffix == ".safetensors" and len(head) == 8:
            # the safetensors header names every tensor, dtype, shape and offset
            h.update(f.read(min(int.from_bytes(head, "little"), 100 << 20)))
        step = max(1, (size - chunk) // (chunks - 1))
        for i in range(chunks):
            f.seek(min(i * step, size - chunk))
            h.update(f.read(chunk))


_FINGERPRINTS: dict[tuple[str, tuple], str] = {}


def weights_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """A digest of a local checkpoint directory: config, and the weight files (whole files up
    to 64 MiB, else their headers plus 64 evenly spaced 64 KiB samples); of a model given as
    one weights file (a GGUF checkpoint), that file.

    Cheap enough to run in every engine process; two checkpoints that differ anywhere a
    sample falls (random or trained weights differ everywhere) get different digests. Pass
    ``model_revision`` explicitly when that is not good enough.
    """
    d = Path(model_dir)
    files = [d] if d.is_file() else sorted(
        p for p in d.iterdir()
        if p.is_file() and (p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf")
                            or p.name in ("config.json", "generation_config.json"))
    )
    sig = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    cache_key = (str(d.resolve()), sig)
    got = _FINGERPRINTS.get(cache_key)
    if got is None:
        h = hashlib.sha256(b"kvstore-vllm-weights/1")
        for p in files:
            _fingerprint_file(h, p)
        got = _FINGERPRINTS[cache_key] = h.hexdigest()
    return got


def model_identity(vllm_config: VllmConfig, cfg: ConnectorConfig) -> tuple[str, str]:
    """``(model_id, model_revision)`` for the namespace: the configured overrides, else vLLM's
    ``model`` and its revision plus a weights fingerprint (local) or the hub commit hash."""
    mc = vllm_config.model_config
    model_id = cfg.model_id or str(mc.model)
    revision = cfg.model_revision
    if revision is None:
        parts = []
        if getattr(mc, "revision", None):
            parts.append(f"rev={mc.revision}")
        if os.path.exists(str(mc.model)):  # a local directory, or one weights file (GGUF)
            parts.append(f"weights={weights_fingerprint(str(mc.model))}")
        else:
            commit = getattr(getattr(mc, "hf_config", None), "_commit_hash", None)
            if commit:
                parts.append(f"commit={commit}")
        revision = ";".join(parts)
    return model_id, revision


def _config_digest(vllm_config: VllmConfig) -> str:
    """Digest of what, beyond the weights, changes the KV a model computes."""
    mc = vllm_config.model_config
    try:
        hf = mc.hf_text_config.to_dict() if hasattr(mc, "hf_text_config") else mc.hf_config.to_dict()
    except Exception:  # an exotic config: fall back to its repr
        hf = repr(getattr(mc, "hf_config", None))
    volatile = {"transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype"}
    if isinstance(hf, dict):
        hf = {k: v for k, v in hf.items() if k not in volatile}
    doc = {
        "hf_config": hf,
        "quantization": str(getattr(mc, "quantization", None)),
        "model_dtype": str(getattr(mc, "dtype", None)),
        "hf_overrides": repr(getattr(mc, "hf_overrides", None)),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


# -- tensor parallel ranks -------------------------------------------------------------------------
def tp_rank_size(vllm_config: VllmConfig, is_scheduler: bool) -> tuple[int, int]:
    """``(tp_rank, tp_size)`` for the namespace. Each worker stores its slice of the heads
    (vLLM's per-rank pages) under a namespace naming its rank and the TP size; the scheduler,
    which has no rank, keys and looks up in rank 0's namespace (:func:`rank_keys`)."""
    size = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if size == 1 or is_scheduler:
        return 0, size
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


_RANK_TAG = b"kvstore-vllm/tp-rank-key/1"


def rank_keys(keys: Sequence[bytes], parent: bytes | None, namespace_id: bytes,
              tp_rank: int) -> tuple[list[bytes], bytes | None]:
    """The scheduler's keys (rank 0's namespace) as the keys of rank ``tp_rank``'s namespace
    ``namespace_id``: rank 0 uses them as they are; another rank's are ``SHA-256(tag ||
    namespace_id || key)``, one per block, so every rank's blocks have keys of their own and
    a chain keeps its links (the parent is mapped the same way)."""
    if tp_rank == 0:
        return list(keys), parent

    def one(k: bytes) -> bytes:
        return hashlib.sha256(_RANK_TAG + namespace_id + bytes(k)).digest()

    return [one(k) for k in keys], (None if parent is None else one(parent))


# -- the store layout of vLLM's pages --------------------------------------------------------------
def _single_group_spec(kv_cache_config: KVCacheConfig | None,
                       model: str = "this model") -> tuple[Any, list[str]]:
    """The one KV-cache group the connector stores, or a ConfigError naming the model and why.

    Sliding-window layers beside full-attention ones are stored: vLLM turns its hybrid
    KV-cache manager off for a connector that does not declare ``SupportsHMA`` (this one),
    and then allocates every layer's blocks in one full-attention group (a sliding-window
    layer keeps its window in the attention, and all its blocks in the cache), so every
    block holds every layer. What is refused: more than one group (the hybrid manager turned
    on explicitly, or Mamba/linear-attention state), and a model whose every layer is
    sliding-window or chunked-local (vLLM drops its blocks outside the window)."""
    if kv_cache_config is None:
        raise ConfigError("KVStoreConnector needs vLLM's kv_cache_config (vLLM >= 0.11)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        kinds = ", ".join(
            f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)" for g in groups)
        raise ConfigError(
            f"KVStoreConnector cannot cache {model}: its KV cache has {len(groups)} groups "
            f"({kinds}), and the connector stores one group, where every block holds every "
            "layer. For sliding-window layers beside full-attention ones, leave vLLM's hybrid "
            "KV-cache manager off (do not pass --no-disable-hybrid-kv-cache-manager): vLLM "
            "then keeps one group. Mamba and linear-attention models are not supported."
        )
    spec = groups[0].kv_cache_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if not isinstance(spec, FullAttentionSpec):
        raise ConfigError(
            f"KVStoreConnector cannot cache {model}: its KV-cache group is "
            f"{type(spec).__name__}, not full attention (sliding-window and chunked-local "
            "layers alone: vLLM drops their blocks outside the window, which a prefix cache "
            "needs). Models with some full-attention layers are supported."
        )
    return spec, list(groups[0].layer_names)


def layer_order(names: Sequence[str]) -> list[str]:
    """vLLM's layer names in model order (by their layer index where they have one)."""
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        return sorted(names, key=extract_layer_index)
    except Exception:  # names without an index: keep vLLM's order
        return list(names)


def engine_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
) -> tuple[KVLayout, dict[str, object], str]:
    """The store layout that holds one vLLM page per layer, the namespace extras that pin the
    engine's page layout, and the page kind (``"cpu"`` or ``"flash"``)."""
    spec, names = _single_group_spec(
        kv_cache_config, str(getattr(vllm_config.model_config, "model", "this model")))
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ConfigError(
            "KVStoreConnector supports pipeline_parallel_size == 1 (each stage would hold "
            f"other layers of a block); got PP={pc.pipeline_parallel_size}: run with PP=1"
        )
    head_v = getattr(spec, "head_size_v", spec.head_size) or spec.head_size
    if head_v != spec.head_size:
        raise ConfigError("KVStoreConnector needs equal K and V head sizes")
    from vllm.platforms import current_platform

    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    extras: dict[str, object] = {
        "engine": "vllm",
        "kv_cache_layout": str(getattr(kv_cache_config, "kv_cache_layout", "")),
        "cache_dtype": cache_dtype,
        "config": _config_digest(vllm_config),
    }
    if current_platform.is_cpu():
        kind = "cpu"
        extras["page_layout"] = PAGE_LAYOUT_CPU
        layout = KVLayout(num_layers=len(names), num_kv_heads=spec.num_kv_heads,
                          head_dim=2 * spec.head_size, dtype=spec.dtype,
                          block_tokens=spec.block_size, kv_planes=1)
    else:
        kind = "flash"
        extras["page_layout"] = PAGE_LAYOUT_FLASH
        layout = KVLayout(num_layers=len(names), num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_size, dtype=spec.dtype,
                          block_tokens=spec.block_size, kv_planes=2)
    return layout, extras, kind
