"""Key -> slot directory of a shared warm slab, which the daemon's clients probe themselves.

An open-addressing hash table (linear probing, load factor <= 1/2) in a shared-memory file
next to the slab, ``<slab>.keys``. The daemon is its only writer (under its store lock);
clients map it read-only and answer ``lookup`` for blocks in the warm tier without a round
trip, asking the daemon only about the stretch the table does not show (disk, remote).

File: a 64-byte header (magic ``b"kvkeys01"``, u64 LE capacity, zero padding), then
``capacity`` entries of five u64 LE words: the 32-byte key, then ``slot + 1`` (0: never used,
``2**64 - 1``: removed). Keys are SHA-256 outputs, so their first word is the hash.

Readers take no lock, so a probe racing a writer can miss a key (it then asks the daemon) or,
in a vanishingly rare interleaving, see a block that was just evicted; a lookup is a
point-in-time answer either way, and ``fetch`` is answered by the daemon, which re-checks.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

from kvstore.errors import SizeError
from kvstore.keys import _native

MAGIC = b"kvkeys01"
HEADER_BYTES = 64
WORDS = 5  # four key words and slot + 1
_EMPTY = 0
_GONE = 2**64 - 1
_MAX_PROBE = 64  # entries a reader probes before it gives up (and asks the daemon)


def capacity_for(slots: int) -> int:
    """Entries for ``slots`` blocks: a power of two at least twice as large (80 bytes a
    block at most)."""
    return 1 << max(4, (2 * slots - 1).bit_length())


class KeyDirectory:
    """The table over a mapping; ``writable`` for the daemon's side."""

    def __init__(self, buf: mmap.mmap, *, writable: bool) -> None:
        if len(buf) < HEADER_BYTES or bytes(buf[:8]) != MAGIC:
            raise SizeError("not a kvstore key directory (bad magic)")
        cap = int.from_bytes(buf[8:16], "little")
        if cap & (cap - 1) or len(buf) < HEADER_BYTES + cap * WORDS * 8:
            raise SizeError(f"key directory of capacity {cap} does not fit its {len(buf)} bytes")
        self._buf = buf
        self.capacity = cap
        self._mask = np.uint64(cap - 1)  # for the vectorised readers
        self.table = np.frombuffer(buf, dtype="<u8", count=cap * WORDS,
                                   offset=HEADER_BYTES).reshape(cap, WORDS)
        if not writable:
            self.table.flags.writeable = False
        self._removed = 0
        self._live = 0

    # -- files ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str, slots: int) -> KeyDirectory:
        cap = capacity_for(slots)
        nbytes = HEADER_BYTES + cap * WORDS * 8
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        buf[:16] = MAGIC + cap.to_bytes(8, "little")
        return cls(buf, writable=True)

    @classmethod
    def open_readonly(cls, path: str) -> KeyDirectory:
        fd = os.open(path, os.O_RDONLY)
        try:
            nbytes = os.fstat(fd).st_size
            buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(buf, writable=False)

    def close(self) -> None:
        self.table = np.zeros((0, WORDS), dtype="<u8")
        with contextlib.suppress(BufferError):
            self._buf.close()

    # -- writer ----------------------------------------------------------------------------------
    def insert(self, key: bytes, slot: int) -> None:
        """Publish ``key`` at ``slot`` (``key`` must not be in the table)."""
        words = np.frombuffer(key, dtype="<u8")
        t, mask = self.table, self.capacity - 1
        i = int(words[0]) & mask
        for _ in range(self.capacity):
            v = int(t[i, 4])
            if v in (_EMPTY, _GONE):
                if v == _GONE:
                    self._removed -= 1
                t[i, :4] = words  # the key before the slot: a reader never sees a slot
                t[i, 4] = slot + 1  # under the wrong key (x86 keeps stores in order)
                self._live += 1
                return
            i = (i + 1) & mask
        raise SizeError("key directory full")  # pragma: no cover - capacity >= 2 x slots

    def remove(self, key: bytes) -> None:
        """Withdraw ``key`` (absent keys are ignored)."""
        words = np.frombuffer(key, dtype="<u8")
        t, mask = self.table, self.capacity - 1
        i = int(words[0]) & mask
        for _ in range(self.capacity):
            v = int(t[i, 4])
            if v == _EMPTY:
                return
            if v != _GONE and t[i, :4].tobytes() == key:
                t[i, 4] = _GONE  # withdrawn first, then the key wiped
                t[i, :4] = 0
                self._live -= 1
                self._removed += 1
                if self._removed > self.capacity // 4:
                    self._rebuild()
                return
            i = (i + 1) & mask

    def _rebuild(self) -> None:
        """Re-place the live entries without the removal markers (probe chains shrink)."""
        t = self.table
        live = t[(t[:, 4] != _EMPTY) & (t[:, 4] != _GONE)].copy()
        t[:, 4] = _EMPTY  # readers miss during the rebuild and ask the daemon instead
        t[:, :4] = 0
        self._removed = self._live = 0
        for row in live:
            self.insert(row[:4].tobytes(), int(row[4]) - 1)

    # -- readers ---------------------------------------------------------------------------------
    def leading_run(self, blob: bytes) -> int:
        """How many of the ``n * 32``-byte keys in ``blob``, in a row from the first, the table
        holds: one C loop over the mapping (``kvstore._native.directory_run``), else a
        vectorised numpy probe (no Python object per key either way)."""
        if _native is not None:
            return _native.directory_run(self._buf, blob)
        q = np.frombuffer(blob, dtype="<u8").reshape(-1, 4)
        n = len(q)
        if n == 0:
            return 0
        t, mask = self.table, self._mask
        found = np.zeros(n, dtype=bool)
        active = np.arange(n)
        qa = q
        pos = q[:, 0] & mask
        for _ in range(_MAX_PROBE):
            rows = np.take(t, pos, axis=0)
            slot = rows[:, 4]
            same = ((rows[:, 0] ^ qa[:, 0]) | (rows[:, 1] ^ qa[:, 1]) | (rows[:, 2] ^ qa[:, 2])
                    | (rows[:, 3] ^ qa[:, 3])) == 0
            hit = same & (slot != _EMPTY) & (slot != _GONE)
            found[active[hit]] = True
            more = ~hit & (slot != _EMPTY)  # a full entry of another key: probe on
            if not more.any():
                break
            active, qa = active[more], qa[more]
            pos = (pos[more] + np.uint64(1)) & mask
        return n if found.all() else int(np.argmin(found))
