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
import sys

import numpy as np

from kvstore.errors import SizeError
from kvstore.keys import _native

MAGIC = b"kvkeys01"
HEADER_BYTES = 64
WORDS = 5  # four key words and slot + 1
_EMPTY = 0
_GONE = 2**64 - 1
_ZERO_KEY = bytes(32)
_MAX_PROBE = 64  # entries a reader probes before it gives up (and asks the daemon)


def directory_path(slab_path: str) -> str:
    """Where the key directory of the shared slab at ``slab_path`` lives (torch-free: the
    client and ``kvstore explain --socket`` find it without loading the slab module)."""
    return slab_path + ".keys"


def capacity_for(slots: int) -> int:
    """Entries for ``slots`` blocks: a power of two at least twice as large (80 bytes a
    block at most)."""
    return 1 << max(4, (2 * slots - 1).bit_length())


#: the writer stores native words into a little-endian file: only where those agree
WRITABLE_HERE = sys.byteorder == "little"


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
        # the writer's scalar path: plain memoryviews (a numpy scalar access costs ~10x more)
        self._raw = memoryview(buf)
        self._words = self._raw[HEADER_BYTES : HEADER_BYTES + cap * WORDS * 8].cast("Q")
        self._removed = 0
        self._closed = False

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
        """Unmap (a probe racing this sees an empty table: misses, never an error)."""
        self._closed = True
        self.table = np.zeros((0, WORDS), dtype="<u8")
        self._words.release()
        self._raw.release()
        with contextlib.suppress(BufferError):
            self._buf.close()

    # -- writer ----------------------------------------------------------------------------------
    def insert(self, key: bytes, slot: int) -> None:
        """Publish ``key`` at ``slot`` (``key`` must not be in the table)."""
        words, raw, mask = self._words, self._raw, self.capacity - 1
        i = int.from_bytes(key[:8], "little") & mask
        for _ in range(self.capacity):
            v = words[i * WORDS + 4]
            if v in (_EMPTY, _GONE):
                if v == _GONE:
                    self._removed -= 1
                off = HEADER_BYTES + i * WORDS * 8
                raw[off : off + 32] = key  # the key before the slot: a reader never sees a
                words[i * WORDS + 4] = slot + 1  # slot under the wrong key (x86 keeps stores in order)
                return
            i = (i + 1) & mask
        raise SizeError("key directory full")  # pragma: no cover - capacity >= 2 x slots

    def remove(self, key: bytes) -> None:
        """Withdraw ``key`` (absent keys are ignored)."""
        words, raw, mask = self._words, self._raw, self.capacity - 1
        i = int.from_bytes(key[:8], "little") & mask
        for _ in range(self.capacity):
            v = words[i * WORDS + 4]
            if v == _EMPTY:
                return
            off = HEADER_BYTES + i * WORDS * 8
            if v != _GONE and raw[off : off + 32] == key:
                words[i * WORDS + 4] = _GONE  # withdrawn first, then the key wiped
                raw[off : off + 32] = _ZERO_KEY
                self._removed += 1
                if self._removed > self.capacity // 4:
                    self._rebuild()
                return
            i = (i + 1) & mask

    def _rebuild(self) -> None:
        """Re-place the live entries without the removal markers (probe chains shrink), in
        vectorised rounds: every entry still unplaced takes its current position if free (the
        first of several wanting it wins) or moves on by one, so the entries it passed over
        are occupied, as linear probing needs. A million entries take milliseconds, not the
        seconds of one insert each under the daemon's lock."""
        t = self.table
        slot = t[:, 4]
        live = t[(slot != _EMPTY) & (slot != _GONE)].copy()
        t[:, 4] = _EMPTY  # readers miss during the rebuild and ask the daemon instead
        t[:, :4] = 0
        mask = self._mask
        pos = live[:, 0] & mask
        pending = np.arange(len(live))
        while pending.size:
            p = pos[pending]
            free = t[p, 4] == _EMPTY
            cand, cpos = pending[free], p[free]
            taken, first = np.unique(cpos, return_index=True)
            winners = cand[first]
            t[taken, :4] = live[winners, :4]
            t[taken, 4] = live[winners, 4]
            placed = np.zeros(len(live), dtype=bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            pos[pending] = (pos[pending] + np.uint64(1)) & mask
        self._removed = 0

    # -- readers ---------------------------------------------------------------------------------
    def leading_run(self, blob: bytes) -> int:
        """How many of the ``n * 32``-byte keys in ``blob``, in a row from the first, the table
        holds: one C loop over the mapping (``kvstore._native.directory_run``), else a
        vectorised numpy probe (no Python object per key either way)."""
        if self._closed:
            return 0
        if _native is not None:
            try:
                return _native.directory_run(self._buf, blob)
            except ValueError:
                if self._closed:  # unmapped under us by another thread's close()
                    return 0
                raise
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
