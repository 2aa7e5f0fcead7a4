"""One exception hierarchy for kvstore.

Every message says what to change. A cache miss is never an exception: ``lookup`` and
``fetch`` report misses (and damaged blocks) as shorter results.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A store was opened or configured with values that cannot work."""


class LayoutError(ConfigError):
    """A ``KVLayout`` field is invalid."""


class SizeError(ConfigError):
    """A capacity string or number could not be parsed, or is too small."""


class StorePermissionError(ConfigError):
    """A store's files or directories can be written by users other than its owner (and
    the group it is shared with): refused on open, with the path and the ``chmod`` that
    fixes it (docs/operations.md, "File modes")."""


class TokenError(KVStoreError, ValueError):
    """Token ids are not non-negative integers below 2**32."""


class KeyFormatError(KVStoreError, ValueError):
    """A block key is not 32 bytes, or block extras do not match the blocks."""


class NamespaceMismatchError(KVStoreError, ValueError):
    """Keys were computed for another model, layout or store than the one used."""


class TensorMismatchError(KVStoreError, ValueError):
    """A KV tensor does not have the shape, dtype or device the layout requires."""


class StoreClosedError(KVStoreError, RuntimeError):
    """The store was used after ``close()``."""


class FormatVersionError(KVStoreError, RuntimeError):
    """An on-disk store was written by an incompatible format version."""


class HeaderFormatError(KVStoreError, ValueError):
    """A file's JSON header (a segment's, a pack's) is not ASCII JSON, is larger than a
    kvstore header may be, or nests deeper than one ever does: the file is damaged or not
    kvstore's. ``recover`` and ``verify`` count it as a finding and skip the file;
    ``import`` refuses the pack."""


class TransferError(KVStoreError, RuntimeError):
    """A data transfer failed for a reason other than damaged or missing data."""


class DiskError(KVStoreError, OSError):
    """The disk tier could not write (disk full, read-only directory, I/O error).

    Raised only to the background writer and admin tools; an engine's ``put`` never sees it.
    """


class StoreLockedError(KVStoreError, RuntimeError):
    """An exclusive admin operation could not take the store's lock."""


class StoreCorruptError(KVStoreError, RuntimeError):
    """The store's index (or a file it needs) is damaged or missing beside intact segments.

    The message names what to run (``kvstore recover --store PATH``); nothing has been
    modified, and the store refuses to start over on top of the old files.
    """


class NotDurableError(KVStoreError, RuntimeError):
    """``flush`` cannot vouch for puts made before it: ``blocks`` of them are not on disk.

    Raised by ``flush`` (embedded and daemon client alike) when the disk tier could not write
    them (disk full, I/O error: ``reason`` says which). ``put`` never raises for this; blocks
    still in memory keep being served and are written again by the next ``flush``, which
    returns normally once they are durable (free space, then flush again)."""

    def __init__(self, message: str, blocks: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.blocks = blocks
        self.reason = reason


class CloseTimeoutError(KVStoreError, TimeoutError):
    """``close(timeout=...)`` gave up waiting: the store's last writes to disk did not finish
    in time, most often because another process holds the disk index's write lock (an engine
    stopped with SIGSTOP or hung inside a commit). What earlier ``flush()`` calls returned for
    is on disk; ``blocks`` put since may not be. The close goes on in the background and
    finishes if the lock is released while this process lives. ``path`` is the store's."""

    def __init__(self, message: str, blocks: int = 0, path: str = "") -> None:
        super().__init__(message)
        self.blocks = blocks
        self.path = path


class PutsLostError(NotDurableError):
    """``flush`` cannot vouch for puts a daemon had acknowledged: it restarted (killed,
    crashed) before writing them to disk, or it cannot be reached to confirm. ``blocks`` is
    how many; put them again if they matter."""


class DaemonUnavailableError(KVStoreError, ConnectionError):
    """No ``kvstore serve`` daemon answers at the socket: nothing listens there (a mistyped
    path, a daemon not started or gone), or it did not complete the handshake.

    Raised by ``kvstore.connect`` when the daemon does not answer at connect (unless it is
    told to wait for one that is starting: ``wait_for_daemon=True``), and by the admin
    commands that ask a daemon (``kvstore stats --socket``, ``explain --socket``, ``rm``
    through a daemon). A daemon that answered once and went away is not an error: the
    client misses until it is back."""
