"""One live connection to the daemon and this process's mapping of its namespace's warm
slab (and key directory), opened by :func:`open_session` with the hello handshake."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvstore.layout import KVLayout
from kvstore.wire import messages as m
from kvstore.wire.channel import Channel
from kvstore.wire.errors import ErrorCode, ProtocolVersionError, ServerError
from kvstore.wire.protocol import PROTOCOL_VERSION

if TYPE_CHECKING:
    import torch

    from kvstore.tiers.key_directory import KeyDirectory

__all__ = ["Session", "SharedMemoryUnavailable", "open_session"]

log = logging.getLogger("kvstore.client")


class SharedMemoryUnavailable(OSError):
    """The daemon answered, but the shared memory its hello named cannot be mapped here."""

    def __init__(self, socket_path: str, shm_path: str, why: str) -> None:
        super().__init__(
            f"the kvstore daemon at {socket_path} answered, but its shared memory {shm_path} "
            f"cannot be mapped ({why}): it was removed or truncated under the running daemon "
            "(a /dev/shm clean-up, systemd-logind's RemoveIPC=yes when its user logged out), "
            "or this process does not see the daemon's shared-memory directory (another "
            "container or mount namespace): restart the daemon, and run it and its clients "
            "with one /dev/shm (or the same --shm-dir)")


class Session:
    """One live connection and the mapping of its namespace's slab.

    Copies into or out of slots this connection holds (leases, granted puts) run inside
    :meth:`copying`; the socket is closed only when none is in flight, because the daemon
    frees a connection's slots as soon as it sees the connection go.
    """

    __slots__ = ("channel", "hello", "slab", "pinned", "directory", "instance", "_active", "_idle")

    def __init__(self, channel: Channel, hello: m.HelloReply, slab: torch.Tensor,
                 pinned: bool, directory: KeyDirectory | None = None) -> None:
        self.channel = channel
        self.hello = hello
        self.slab = slab  # [slots, block_nbytes] uint8, shared with the daemon
        self.pinned = pinned
        self.directory = directory  # the warm tier's key -> slot table, read-only
        # which daemon run this is (an older daemon does not say: its pid has to do)
        self.instance = hello.instance or hello.server.encode()
        self._active = 0
        self._idle = threading.Condition()

    def warm_run(self, blob: bytes) -> int | None:
        """The leading run of ``blob``'s keys in the daemon's shared key directory; None when
        there is no directory to read (none shared, or its daemon is gone: a dead daemon's
        table says nothing)."""
        if self.directory is None or not self.channel.peer_alive():
            return None
        return self.directory.leading_run(blob)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        with self._idle:
            self._active += 1
        try:
            yield
        finally:
            with self._idle:
                self._active -= 1
                if not self._active:
                    self._idle.notify_all()

    def close(self, timeout: float | None = 60.0) -> None:
        """Close once the calls in flight are done, or after ``timeout`` seconds (``None``:
        wait for them): a call still waiting then ends as a miss (its channel is closed)."""
        with self._idle:
            self._idle.wait_for(lambda: not self._active, timeout=timeout)
        self.channel.close()
        if self.directory is not None:
            self.directory.close()
        if self.pinned:
            from kvstore.tiers.slab import unregister_pinned

            with contextlib.suppress(Exception):  # best effort
                unregister_pinned(self.slab)


def open_session(socket_path: str, timeout: float | None, hello: m.Hello, layout: KVLayout,
                 device: torch.device) -> Session:
    """Connect, say hello, map the namespace's slab (registered as pinned memory when the
    client's device is a GPU) and open its key directory. Raises for a daemon that speaks
    another protocol version or disagrees on the block size; the channel never leaks."""
    ch = Channel.connect(socket_path, timeout)
    try:
        reply = ch.call(hello)
        assert isinstance(reply, m.HelloReply)
        if reply.version != PROTOCOL_VERSION:
            raise ProtocolVersionError(ErrorCode.VERSION_MISMATCH,
                                       f"daemon answered with protocol {reply.version}")
        if reply.block_nbytes != layout.block_nbytes:
            raise ServerError(ErrorCode.CONFIG, "daemon disagrees on the block size")
        ch.max_frame = reply.max_frame
        if reply.new_namespace:  # a typo'd model id would otherwise just never hit
            log.warning("kvstore daemon at %s: %s", socket_path, reply.new_namespace)
        try:
            slab = _map_slab(reply)
        except (OSError, ValueError) as e:  # ValueError: SizeError, an mmap refused
            why = (e.strerror if isinstance(e, OSError) else None) or str(e)
            raise SharedMemoryUnavailable(socket_path, reply.shm_path, why) from None
        pinned = device.type == "cuda" and _pin(slab)
        directory = _open_directory(reply.shm_path)
    except BaseException:
        ch.close()
        raise
    return Session(ch, reply, slab, pinned, directory)


def _map_slab(reply: m.HelloReply) -> torch.Tensor:
    import torch

    from kvstore.tiers.slab import map_shared

    mapping = map_shared(reply.shm_path, reply.slots * reply.block_nbytes, create=False)
    slab = torch.frombuffer(mapping, dtype=torch.uint8).view(reply.slots, reply.block_nbytes)
    del mapping  # the tensor keeps the mapping alive for as long as it is used
    return slab


def _pin(slab: torch.Tensor) -> bool:
    from kvstore.tiers.slab import register_pinned

    try:
        register_pinned(slab)
    except OSError as e:
        log.warning("could not register the shared slab as pinned memory (%s); "
                    "copies to the GPU will be staged", e)
        return False
    return True


def _open_directory(shm_path: str) -> KeyDirectory | None:
    from kvstore.tiers.key_directory import KeyDirectory, directory_path

    try:
        return KeyDirectory.open_readonly(directory_path(shm_path))
    except (OSError, ValueError) as e:  # an older daemon: every lookup asks it
        log.info("no key directory next to %s (%s); lookups go to the daemon", shm_path, e)
        return None

