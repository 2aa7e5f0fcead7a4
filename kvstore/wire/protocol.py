"""Protocol version and the ``hello`` handshake: from a client's description to a namespace.

The daemon, not the client, derives the namespace a connection works in: from the layout,
model id and revision, tensor-parallel rank/size and extras the client sends, plus - under
the ``per-uid`` salt policy - the peer's uid (taken from the socket, not from the client), so
processes of different users never share, or see, each other's blocks.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.errors import ConfigError, KVStoreError
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.wire.errors import BadRequest, ErrorCode
from kvstore.wire.handshake import Hello

#: bumped on any incompatible change of frames, messages or their meaning
PROTOCOL_VERSION = 1
#: "shared": every allowed process with the same model and layout shares one namespace;
#: "per-uid": the namespace also depends on the connecting process's uid
SALT_POLICIES = ("shared", "per-uid")
#: namespace extras under this prefix are set by the daemon only
RESERVED_PREFIX = "kvstore."
TENANT_EXTRA = "kvstore.tenant"


def check_version(args: object) -> None:
    """Refuse a hello of another protocol version (checked before anything else is parsed)."""
    v = args[0] if isinstance(args, list) and args else None
    if v != PROTOCOL_VERSION:
        raise BadRequest(
            f"protocol version {v!r} is not supported: this daemon speaks version "
            f"{PROTOCOL_VERSION}; upgrade kvstore so that the client and the daemon match",
            ErrorCode.VERSION_MISMATCH,
        )


def make_hello(
    layout: KVLayout, model_id: str, *, model_revision: str | None = None, tp_rank: int = 0,
    tp_size: int = 1, namespace_extras: Mapping[str, object] | None = None,
    salt_policy: str = "shared", warm_capacity: int | None = None, client: str = "",
) -> Hello:
    """The hello a client sends (validated here, so a bad argument fails at ``connect``)."""
    if salt_policy not in SALT_POLICIES:
        raise ConfigError(f"salt_policy must be one of {', '.join(SALT_POLICIES)}, got {salt_policy!r}")
    extras = dict(namespace_extras or {})
    for k, v in extras.items():
        if not isinstance(k, str):
            raise ConfigError(f"namespace extras keys must be str, got {k!r}")
        if k.startswith(RESERVED_PREFIX):
            raise ConfigError(f"namespace extra {k!r}: keys starting with {RESERVED_PREFIX!r} "
                              "are reserved for the daemon")
        if not isinstance(v, (str, bytes, int, float)):  # bool is an int
            raise ConfigError(f"namespace extra {k!r} must be str, bytes, int, float or "
                              f"bool, got {type(v).__name__}")
    # the same validation the daemon will run: a bad namespace fails here, not there
    Namespace.create(model_id, layout, model_revision=model_revision, tp_rank=tp_rank,
                     tp_size=tp_size, extras=extras)
    return Hello(
        version=PROTOCOL_VERSION, model_id=model_id, model_revision=model_revision or "",
        dtype=layout.dtype_name,
        block_shape=(layout.num_layers, layout.kv_planes, layout.block_tokens,
                     layout.num_kv_heads, layout.head_dim),
        tp_rank=tp_rank, tp_size=tp_size, extras=tuple(sorted(extras.items())),
        salt_policy=salt_policy, warm_capacity=warm_capacity, client=client,
    )


def hello_layout(hello: Hello) -> KVLayout:
    L, P, T, H, D = hello.block_shape
    return KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=hello.dtype,
                    block_tokens=T, kv_planes=P)


def derive_namespace(hello: Hello, peer_uid: int, *, force_per_uid: bool = False) -> Namespace:
    """The namespace a hello asks for (raises :class:`BadRequest` with code CONFIG).

    ``per-uid`` (asked by the client, or forced by the daemon) adds the peer's uid as the
    reserved extra ``kvstore.tenant``; a client cannot set reserved extras itself.
    """
    if hello.salt_policy not in SALT_POLICIES:
        raise BadRequest(f"salt_policy must be one of {', '.join(SALT_POLICIES)}",
                         ErrorCode.CONFIG)
    extras: dict[str, object] = {}
    for k, v in hello.extras:
        if k.startswith(RESERVED_PREFIX):
            raise BadRequest(f"namespace extra {k!r} is reserved for the daemon", ErrorCode.CONFIG)
        extras[k] = v
    if force_per_uid or hello.salt_policy == "per-uid":
        extras[TENANT_EXTRA] = f"uid:{peer_uid}"
    try:
        return Namespace.create(
            hello.model_id, hello_layout(hello), model_revision=hello.model_revision,
            tp_rank=hello.tp_rank, tp_size=hello.tp_size, extras=extras,
        )
    except KVStoreError as e:
        raise BadRequest(f"hello: {e}", ErrorCode.CONFIG) from None
