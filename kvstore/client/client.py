"""The :class:`Client`: the embedded store's API, over a ``kvstore serve`` daemon (see
:mod:`kvstore.client`). Round trips go through its :class:`~kvstore.client.link.Link`; the
KV bytes are copied through the session's mapping of the namespace's warm slab.

Importing this module does not import torch (``kvstore stats --socket`` and other daemon-only
commands never load it); a :class:`Client` imports it when it is created."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvstore.api import PinReceipt
from kvstore.client.link import CLOSED_MESSAGE, Link
from kvstore.client.session import Session, open_session
from kvstore.errors import (
    NamespaceMismatchError,
    NotDurableError,
    PutsLostError,
    StoreClosedError,
)
from kvstore.hints import PutHint, check_hint
from kvstore.keys import KEY_BYTES, BlockKey, KeyChain, check_key, join_keys
from kvstore.keys import block_keys as _block_keys
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.stats import StoreStats
from kvstore.transfer import Transfer
from kvstore.wire import messages as m
from kvstore.wire.channel import ChannelClosed
from kvstore.wire.errors import ErrorCode, ServerError
from kvstore.wire.protocol import derive_namespace, make_hello

if TYPE_CHECKING:
    import torch

__all__ = ["Client", "connect"]

log = logging.getLogger("kvstore.client")

_TIERS = (None, "hot", "warm", "disk")


#: evict and prefetch wait this many times the client's timeout for the daemon
LONG_CALLS = 4

class Client:
    """A store served by a daemon; the same API as :class:`kvstore.store.Store`.

    Create with :func:`connect`. Thread-safe: requests from several threads share one
    connection (each round trip holds it briefly; copies run outside it).
    """

    def __init__(
        self, socket_path: str | os.PathLike[str], *, layout: KVLayout, model_id: str,
        model_revision: str | None = None, device: str | torch.device | None = None,
        tp_rank: int = 0, tp_size: int = 1, namespace_extras: Mapping[str, object] | None = None,
        timeout: float | None = 30.0, salt_policy: str = "shared",
        warm_capacity: int | None = None, backoff: tuple[float, float] = (0.05, 5.0),
    ) -> None:
        if not isinstance(layout, KVLayout):
            from kvstore.errors import ConfigError

            raise ConfigError(f"layout must be a KVLayout, got {type(layout).__name__}")
        from kvstore.validate import resolve_device  # imports torch

        self.socket_path = os.fspath(socket_path)
        self.layout = layout
        self.device = resolve_device(device)
        self.timeout = timeout
        self._hello = make_hello(
            layout, model_id, model_revision=model_revision, tp_rank=tp_rank, tp_size=tp_size,
            namespace_extras=namespace_extras, salt_policy=salt_policy,
            warm_capacity=warm_capacity, client=f"pid {os.getpid()}",
        )
        # what the daemon will derive; its hello reply has the final word
        self.namespace: Namespace = derive_namespace(self._hello, os.getuid())
        self.namespace_id: bytes = self.namespace.id
        self._link = Link(self.socket_path, self._open, backoff)
        self._report_lock = threading.Lock()
        self._unreported = [0, 0, 0]  # lookups, hits, misses answered from the key directory
        self._reported_at = 0.0
        # blocks committed since the last flush that covered them, by daemon instance: a
        # flush answered by another instance cannot vouch for them
        self._put_lock = threading.Lock()
        self._unflushed: dict[bytes, int] = {}

    # -- connection ------------------------------------------------------------------------------
    def _open(self) -> Session:
        s = open_session(self.socket_path, self.timeout, self._hello, self.layout, self.device)
        if s.hello.namespace_id != self.namespace_id:
            log.warning("the daemon derived namespace %s, not %s (its salt policy?); keys "
                        "computed before now are rejected", s.hello.namespace_id.hex()[:16],
                        self.namespace_id.hex()[:16])
            self.namespace_id = s.hello.namespace_id
        return s

    def _connect_first(self, wait: bool = False) -> None:
        """At ``connect``: configuration errors and a daemon that does not answer raise
        (unless ``wait``: then an absent daemon only warns)."""
        self._link.connect_first(wait)

    @property
    def _session(self) -> Session | None:
        return self._link.session

    @property
    def _closed(self) -> bool:
        return self._link.closed

    def _get(self) -> Session | None:
        """The live session, reconnecting if it is time to; ``None`` while the daemon is down."""
        return self._link.get()

    def _lost(self, s: Session, e: BaseException) -> None:
        self._link.lost(s, e)

    def _request(self, s: Session, req: m.Request, timeout: float | None | bool = True) -> object | None:
        """A round trip on ``s``; ``None`` when it could not be answered (a miss for the
        caller). Only errors that are the caller's to fix raise (bad arguments)."""
        return self._link.request(s, req, timeout)

    def _long_wait(self) -> float | None:
        """How long evict and prefetch (many blocks on disk) wait for the daemon:
        :data:`LONG_CALLS` x the client's timeout (None: no bound, as the client's). A daemon
        that does not answer by then is treated as gone (0 evicted or prefetched), never
        waited for forever."""
        return None if self.timeout is None else LONG_CALLS * max(self.timeout, 0.1)

    def _call(self, req: m.Request, timeout: float | None | bool = True) -> object | None:
        """A round trip; ``None`` when the daemon is not there (the caller reports a miss)."""
        s = self._get()
        return None if s is None else self._request(s, req, timeout)

    # -- keys and validation -------------------------------------------------------------------
    def block_keys(
        self, token_ids: object, salt: str | bytes | None = None, *,
        extras: Sequence[bytes | None] | None = None,
    ) -> KeyChain:
        """Keys of every full block of ``token_ids`` (computed here, no round trip)."""
        self._check_open()
        return _block_keys(self.namespace_id, token_ids, self.layout.block_tokens, salt=salt,
                           extras=extras)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(CLOSED_MESSAGE)

    def _keys(self, keys: Sequence[bytes]) -> tuple[bytes, int, bytes | None]:
        """``keys`` as one ``n * 32``-byte blob, ``n`` and the chain's parent key."""
        if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
            raise TypeError("keys must be a list of block keys from block_keys()")
        parent = None
        if isinstance(keys, KeyChain):
            if keys.namespace_id not in (None, self.namespace_id):
                raise NamespaceMismatchError(
                    "these keys were computed for another namespace (model, revision, layout, "
                    "tensor-parallel shard or store); compute them with this store's block_keys()"
                )
            parent = keys.parent
        n = len(keys)
        blob = join_keys(keys)  # the common case: one C loop checks and joins
        if blob is None:
            try:
                blob = b"".join(keys)
                ok = len(blob) == KEY_BYTES * n and (not n or set(map(len, keys)) == {KEY_BYTES})
            except TypeError:
                ok = False
            if not ok:
                blob = b"".join([check_key(k) for k in keys])  # raises KeyFormatError, naming why
        return blob, n, parent

    def _check_kv(self, kv: torch.Tensor, n: int) -> None:
        from kvstore.validate import check_kv

        check_kv(self.layout, self.device, kv, n)

    def _check_out(self, out: torch.Tensor, n: int) -> None:
        from kvstore.validate import check_out

        check_out(self.layout, out, n)

    # -- lookup / fetch / prefetch ---------------------------------------------------------------
    def memory_run(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the daemon's warm tier holds now, read from its shared
        key directory: no round trip, no reconnect (0 while the daemon is down or without a
        shared slab). As ``Store.zero_copy.memory_run``: what a load can copy from memory."""
        blob, n, _ = self._keys(keys)
        self._check_open()
        s = self._session
        return (s.warm_run(blob) or 0) if n and s is not None else 0

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` held by the daemon (0 while it is down).

        Blocks in the daemon's warm tier are found in its shared key directory without a
        round trip; only the stretch after them is asked of the daemon (its disk tier)."""
        blob, n, parent = self._keys(keys)
        self._check_open()
        if not n:
            return 0
        s = self._get()
        if s is None:
            return 0
        local = s.warm_run(blob)
        if local is None:
            local = 0
            if s.channel.broken:
                s = self._get()  # reconnect now (or learn that the daemon is down)
                if s is None:
                    return 0
        if local == n:
            self._report(1, n, 0)
            return n
        if local:
            self._report(0, local, 0)
        step = KEY_BYTES * s.hello.max_keys
        found = local
        for off in range(local * KEY_BYTES, len(blob), step):  # the daemon's per-request cap
            chunk = blob[off : off + step]
            r = self._call(m.Lookup(chunk, parent if off == 0 else blob[off - KEY_BYTES : off]))
            if r is None:
                return 0
            found += r.n  # type: ignore[attr-defined]
            if r.n < len(chunk) // KEY_BYTES:  # type: ignore[attr-defined]
                break
        return found

    def _report(self, lookups: int, hits: int, misses: int, *, now: bool = False) -> None:
        """Tell the daemon about lookups answered from the key directory (its counters and
        metrics count every lookup), at most every 100 ms, without waiting for a reply."""
        with self._report_lock:
            acc = self._unreported
            acc[0] += lookups
            acc[1] += hits
            acc[2] += misses
            t = time.monotonic()
            if not any(acc) or (not now and t - self._reported_at < 0.1):
                return
            report, self._unreported, self._reported_at = m.LookupReport(*acc), [0, 0, 0], t
        s = self._session
        if s is None or s.channel.broken:
            return  # a daemon that restarted lost its counters anyway
        with contextlib.suppress(ChannelClosed, OSError):
            s.channel.send(report)

    def fetch(self, keys: Sequence[bytes], *, out: torch.Tensor | None = None) -> Transfer[torch.Tensor]:
        """Copy the leading held blocks into ``out`` (or a new tensor on the client's device).

        The result ``[n, L, P, T, H, D]`` may hold fewer blocks than keys (misses, damage,
        or the daemon being down); callers check its length.
        """
        blob, n, parent = self._keys(keys)
        if out is not None:
            self._check_out(out, n)
        self._check_open()
        result = self._fetch(blob, n, parent, out, self.device)
        return Transfer.completed(result, self.layout.num_layers)

    def _fetch(self, blob: bytes, n: int, parent: bytes | None, out: torch.Tensor | None,
               device: torch.device) -> torch.Tensor:
        import torch

        from kvstore.tiers.slab import runs

        lease: m.Lease | None = None
        s = self._get() if n else None
        if s is not None:
            lease = self._request(s, m.Fetch(blob, parent))  # type: ignore[assignment]
        got = len(lease.slots) if lease is not None else 0
        lay = self.layout
        if out is None:
            out = torch.empty(lay.batch_shape(got), dtype=lay.dtype, device=device)
        result = out[:got]
        if not got:
            return result
        assert s is not None and lease is not None
        try:
            with s.copying():
                if s.channel.broken:  # the lease may already be gone
                    return out[:0]
                dst = result.view(got, -1).view(torch.uint8)
                cuda = dst.is_cuda
                for pos, first, length in runs(lease.slots):
                    dst[pos : pos + length].copy_(s.slab[first : first + length], non_blocking=cuda)
                if cuda:
                    torch.cuda.current_stream(dst.device).synchronize()  # before the slots go back
        finally:
            try:
                s.channel.send(m.Release(lease.lease_id))  # pipelined: not waited for
            except ChannelClosed as e:
                self._lost(s, e)  # the daemon releases a dead connection's leases itself
        return result

    def prefetch(self, keys: Sequence[bytes]) -> Transfer[int]:
        """Have the daemon read the leading blocks from disk into its warm tier."""
        blob, n, parent = self._keys(keys)
        self._check_open()
        r = self._call(m.Prefetch(blob, parent), self._long_wait()) if n else None
        return Transfer.completed(0 if r is None else r.n)  # type: ignore[attr-defined]

    # -- put -------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], kv: torch.Tensor,
            hint: PutHint | None = None) -> Transfer[int]:
        """Store ``kv`` (``[len(keys), L, P, T, H, D]``); validation raises synchronously.

        The blocks are copied into the daemon's shared memory and committed before this
        returns (the transfer is already done); its result is the number of blocks stored
        (0 while the daemon is down: the put is dropped). ``hint``: as the store's
        (:class:`~kvstore.hints.PutHint`; a daemon older than hints refuses a hinted put).
        """
        blob, n, parent = self._keys(keys)
        self._check_kv(kv, n)
        check_hint(hint)
        self._check_open()
        s = self._get() if n else None
        if s is None:
            return Transfer.completed(0)
        put = (m.Put(blob, parent) if hint is None
               else m.Put(blob, parent, hint.session, hint.priority))
        grant: m.Grant | None = self._request(s, put)  # type: ignore[assignment]
        if grant is None or not grant.slots:
            return Transfer.completed(0)
        try:
            with s.copying():
                if s.channel.broken:  # the grant may already be gone: never write its slots
                    return Transfer.completed(0)
                self._write_slots(s.slab, kv, grant.positions, grant.slots)
        except BaseException:
            try:
                s.channel.send(m.Abort(grant.grant_id))
            except ChannelClosed as e:
                self._lost(s, e)
            raise
        # a connection lost here: the daemon aborts its granted puts itself
        stored = self._request(s, m.Commit(grant.grant_id))
        n = 0 if stored is None else stored.n  # type: ignore[attr-defined]
        if n:
            with self._put_lock:
                self._unflushed[s.instance] = self._unflushed.get(s.instance, 0) + n
        return Transfer.completed(n)

    def _write_slots(self, slab: torch.Tensor, kv: torch.Tensor, positions: list[int],
                     slots: list[int]) -> None:
        import torch

        from kvstore.tiers.slab import paired_runs

        lay = self.layout
        if kv.is_contiguous():
            src = kv.reshape(kv.shape[0], -1).view(torch.uint8)
            for p, s, length in paired_runs(list(zip(positions, slots, strict=True))):
                slab[s : s + length].copy_(src[p : p + length])
        else:
            for p, s in zip(positions, slots, strict=True):
                slab[s].view(lay.dtype).view(lay.block_shape).copy_(kv[p])

    # -- paged engines ---------------------------------------------------------------------------
    def load_into(self, keys: Sequence[bytes], pages: Sequence[object], block_ids: object, *,
                  page_size: int | None = None) -> Transfer[int]:
        """Scatter the leading held blocks into an engine's paged KV cache (see
        :meth:`kvstore.store.Store.load_into`); the transfer yields the blocks loaded."""
        from kvstore.kernels import scatter_pages
        from kvstore.paged import page_index, paged_geometry

        blob, n, parent = self._keys(keys)
        lay = self.layout
        geo = paged_geometry(lay, pages, page_size)
        ids = page_index(block_ids, n * geo.pages_per_block, geo)
        self._check_open()
        staged = self._fetch(blob, n, parent, None, geo.device)
        got = staged.shape[0]
        if got:
            sel = ids[: got * geo.pages_per_block]
            for layer in range(lay.num_layers):
                scatter_pages(lay, geo, staged[:, layer], pages[layer], sel)
        return Transfer.completed(got, lay.num_layers)

    def save_from(self, pages: Sequence[object], block_ids: object, keys: Sequence[bytes], *,
                  page_size: int | None = None, hint: PutHint | None = None) -> Transfer[int]:
        """Gather the blocks for ``keys`` out of an engine's paged cache and ``put`` them
        (``hint`` as :meth:`put`'s)."""
        import torch

        from kvstore.kernels import gather_pages
        from kvstore.paged import page_index, paged_geometry

        _blob, n, _parent = self._keys(keys)
        lay = self.layout
        geo = paged_geometry(lay, pages, page_size)
        ids = page_index(block_ids, n * geo.pages_per_block, geo)
        kv = torch.empty(lay.batch_shape(n), dtype=lay.dtype, device=geo.device)
        for layer in range(lay.num_layers):
            gather_pages(lay, geo, pages[layer], ids, kv[:, layer])
        return self.put(keys, kv, hint)

    # -- pins / evict ------------------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> PinReceipt:
        """Pin the leading held blocks (for this connection: a dropped client's pins go)."""
        blob, n, parent = self._keys(keys)
        self._check_open()
        r = self._call(m.Pin(blob, parent)) if n else None
        got = 0 if r is None else r.n  # type: ignore[attr-defined]
        ks = [BlockKey(blob[i * KEY_BYTES : (i + 1) * KEY_BYTES]) for i in range(got)]
        return PinReceipt(self.unpin, ks)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Drop one of this client's pins from each of ``keys``; returns how many were pinned."""
        blob, n, _parent = self._keys(keys)
        if self._closed or not n:
            return 0
        r = self._call(m.Unpin(blob))
        return 0 if r is None else r.n  # type: ignore[attr-defined]

    def evict(self, keys: Sequence[bytes] | None = None, *, tier: str | None = None) -> int:
        """Evict ``keys`` (default: every unpinned block of the namespace); see
        :meth:`kvstore.store.Store.evict`."""
        if tier not in _TIERS:
            from kvstore.errors import ConfigError

            raise ConfigError(f"tier must be None, 'hot', 'warm' or 'disk', got {tier!r}")
        blob = None if keys is None else self._keys(keys)[0]
        self._check_open()
        r = self._call(m.Evict(blob, tier), self._long_wait())
        return 0 if r is None else r.n  # type: ignore[attr-defined]

    # -- stats / flush / close ---------------------------------------------------------------------
    def _stats_reply(self) -> m.StatsReply | None:
        self._check_open()
        self._report(0, 0, 0, now=True)  # counters include our own latest lookups
        return self._call(m.Stats())  # type: ignore[return-value]

    def stats(self) -> StoreStats:
        """The namespace's counters in the daemon (all its clients together); zeros while the
        daemon is down."""
        r = self._stats_reply()
        if r is None:
            z = {f: 0 for f in StoreStats.__dataclass_fields__ if f != "tiers"}
            z["block_nbytes"] = self.layout.block_nbytes
            return StoreStats(**z, tiers=())
        return r.store

    def server_stats(self) -> m.ServerStats | None:
        """The daemon's own counters (leases, granted puts, free slots...); ``None`` if down."""
        r = self._stats_reply()
        return None if r is None else r.server

    def ping(self) -> bool:
        """True if the daemon answers."""
        self._check_open()
        return self._call(m.Ping()) is not None

    def flush(self, timeout: float | None = None) -> None:
        """Return once every earlier put is durable in the daemon's disk tier.

        Raises :class:`~kvstore.errors.PutsLostError` (after flushing what it can) when puts
        this client made since its last flush went to a daemon that has since restarted
        without a clean stop, or when no daemon answers to confirm them. Puts a flush
        reported lost are not reported again.
        """
        self._check_open()
        s = self._get()
        with self._put_lock:
            pending = dict(self._unflushed)
        if s is None:
            self._unconfirmed(pending)
            return
        survived = {s.instance, *s.hello.flushed_instances}  # this daemon, or stopped clean
        gone = sum(n for inst, n in pending.items() if inst not in survived)
        refused: ServerError | None = None
        # the daemon answers by ``timeout`` (TIMEOUT when its flush is not done); one that does
        # not answer at all (hung, stopped) must not hold this call past it either: no answer
        # is a flush nobody confirmed
        wait = None if timeout is None else timeout + max(self.timeout or 0.0, 1.0)
        try:
            answered = self._request(s, m.Flush(timeout), wait) is not None
        except ServerError as e:  # the daemon's disk could not write some of them
            if e.code != ErrorCode.NOT_DURABLE:
                raise
            answered, refused = True, e
        if not answered:  # lost while flushing
            self._unconfirmed(pending)
            return
        # a refused flush vouched for nothing: the counts stay for the next one (which also
        # tells whether this daemon survived until its disk took them)
        with self._put_lock:  # puts committed meanwhile stay for the next flush
            for inst, n in pending.items() if refused is None else ():
                left = self._unflushed.get(inst, 0) - n
                if left > 0:
                    self._unflushed[inst] = left
                else:
                    self._unflushed.pop(inst, None)
        if gone:
            raise PutsLostError(
                f"flush: {gone} block(s) put since the last flush may be lost: the kvstore "
                f"daemon at {self.socket_path} restarted without a clean stop (killed or "
                "crashed) before confirming them on disk; put them again if they matter "
                "(later puts are flushed)", gone)
        if refused is not None:
            raise not_durable(refused.message)

    def _unconfirmed(self, pending: dict[bytes, int]) -> None:
        """No daemon answered the flush: puts not yet flushed cannot be vouched for (they stay
        counted: the next flush tells whether they survived)."""
        n = sum(pending.values())
        if n:
            raise PutsLostError(
                f"flush: {n} block(s) put since the last flush are not confirmed on disk: no "
                f"kvstore daemon answers at {self.socket_path} (they are lost if it restarts "
                "without a clean stop); flush again once it is back", n)

    @property
    def connected(self) -> bool:
        s = self._session
        return s is not None and not s.channel.broken and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def new_namespace(self) -> str:
        """The daemon's note when nothing was stored under this client's namespace before it
        connected (its fields, and stored namespaces differing in one field: a typo'd
        ``model_id``); ``""`` otherwise or while disconnected. Also logged as a warning."""
        s = self._session
        return s.hello.new_namespace if s is not None else ""

    def close(self, timeout: float | None = 30.0) -> None:
        """Close the connection (the daemon gives back whatever it still holds for us),
        waiting at most ``timeout`` seconds (``None``: no bound) for calls in flight on other
        threads, which then end as misses. What the daemon acknowledged stays with it."""
        if not self._link.mark_closed():
            return
        if self._session is not None:
            self._report(0, 0, 0, now=True)
        s = self._link.detach()
        if s is not None:
            s.close(timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self.connected else "down")
        return f"<kvstore.Client {self.socket_path} namespace {self.namespace_id.hex()[:16]} {state}>"


def connect(
    socket_path: str | os.PathLike[str], *, layout: KVLayout, model_id: str,
    model_revision: str | None = None, device: str | torch.device | None = None,
    tp_rank: int = 0, tp_size: int = 1, namespace_extras: Mapping[str, object] | None = None,
    timeout: float | None = 30.0, salt_policy: str = "shared", warm_capacity: int | str | None = None,
    wait_for_daemon: bool = False,
) -> Client:
    """Connect to a ``kvstore serve`` daemon; the client has the embedded store's API.

    ``salt_policy="per-uid"`` asks for a namespace of this uid's own. ``warm_capacity`` asks
    for the namespace's warm tier size when this client is the one to open it (capped by the
    daemon's ``--cpu-capacity``).

    No daemon answering at ``socket_path`` (a mistyped path, a daemon not started) raises
    :class:`~kvstore.errors.DaemonUnavailableError`, as does a daemon that refuses us (uid,
    protocol version, namespace). ``wait_for_daemon=True`` is for a daemon that is still
    starting (started together with the engine): ``connect`` returns at once, and the client
    misses (lookups find nothing, puts are dropped) until the daemon answers, then connects
    (retrying with backoff). A daemon that answered and later goes away is never an error:
    the client misses and reconnects when it is back, with or without the flag.
    """
    from kvstore.sizes import parse_size

    cap = None if warm_capacity is None else parse_size(warm_capacity, what="warm_capacity")
    c = Client(socket_path, layout=layout, model_id=model_id, model_revision=model_revision,
               device=device, tp_rank=tp_rank, tp_size=tp_size,
               namespace_extras=namespace_extras, timeout=timeout, salt_policy=salt_policy,
               warm_capacity=cap)
    c._connect_first(wait_for_daemon)
    return c


def not_durable(message: str) -> NotDurableError:
    """The daemon's NOT_DURABLE reply as the embedded store raises it (protocol.md: the
    message starts ``flush: N block(s)`` and names the cause after the colon)."""
    match = _NOT_DURABLE.match(message)
    blocks = int(match.group(1)) if match else 0
    reason = match.group(2) if match else ""
    return NotDurableError(message, blocks, reason)


_NOT_DURABLE = re.compile(r"flush: (\d+) block\(s\) put before this flush are not on disk: "
                          r"(.*?)\. \d+ of them")
