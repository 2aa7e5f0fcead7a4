"""Adversarial reliability pass, round 10: durability and the data path under faults, through
the public API (``open_store``, ``put``/``fetch``/``flush``/``evict``/``close``, reopen) and
the commands an operator runs on the store afterwards.

Faults: an OS call of the write path (``writev``, ``fsync``, ``link``, ``unlink``, the
creating ``open``, the index commit) failing at its Nth call, once or from then on, with EIO,
ENOSPC or EDQUOT; a process out of file descriptors; segments turned into other files after a
flush; capacity eviction racing fetches of the same keys; stores of other layouts and models
on one directory.

Every attack checks the promise: a fetch returns exactly the bytes put under its keys or fewer
blocks (a counted miss), never other bytes, never a crash; ``flush()`` returning normally
means every block put before it survives ``kill -9`` (a copy of the store's files taken at that
moment, which is what ``kill -9`` leaves) and reopen; a flush never acknowledges a block the
disk refused; ``put`` never raises for disk trouble; nothing waits without a bound.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
from pathlib import Path

from conftest import fetch_exact, keyed_kv
from support.attacks import BN, LAY, T, attack_store

from kvstore.cli import main as cli
from kvstore.tiers.disk.segments import FdCache

MODEL = "attacks/round10"


def opened(path, **kw):
    return attack_store(path, model=MODEL, **kw)


def chain(s, i: int, n: int = 6):
    return s.block_keys([(1000 + i) * 100_000 + t for t in range(n * T)])


def killed_copy(src: Path, dst: Path) -> Path:
    """The store's files as they are now: what ``kill -9`` of its process would leave (the
    page cache keeps every write that returned; nothing else is finished for it)."""
    shutil.copytree(src, dst)
    return dst


# -- a process out of file descriptors ---------------------------------------------------------
@contextlib.contextmanager
def descriptors_exhausted(spare: int = 0):
    """Every file descriptor of the process in use (less ``spare``): an engine at its limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        for _ in range(min(spare, len(held))):
            os.close(held.pop())
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_fetch_out_of_file_descriptors_misses_and_loses_nothing_flushed(tmp_path):
    """A fetch of flushed blocks in a process that has used up its descriptors (EMFILE: the
    segment cannot be opened) is a miss; the blocks stay in the index and are served once
    descriptors are free. Before, each was 'damaged': its entry was dropped and the emptied
    segment file unlinked, so every flushed block the process tried to read was gone."""
    with opened(tmp_path) as s:
        ks = chain(s, 1)
        s.put(ks, keyed_kv(LAY, ks))
        s.flush()
    with opened(tmp_path, warm=16) as s:  # nothing in memory, no segment open yet
        with descriptors_exhausted():
            got = s.fetch(ks).wait(20)
        assert got.shape[0] == 0
        assert fetch_exact(s, ks) == len(ks)  # the same store, descriptors free again
    with opened(tmp_path, warm=16) as s:
        assert fetch_exact(s, ks) == len(ks)
        assert s.stats().damaged == 0


def test_a_compaction_that_cannot_open_a_segment_leaves_its_blocks(tmp_path, monkeypatch):
    """``kvstore compact`` that reads a segment's header but cannot open it to read the
    payloads (EMFILE) moves nothing and drops nothing: before, each block it could not read
    was dropped as damaged."""
    with opened(tmp_path, warm=64) as s:
        ks = chain(s, 10, 18)
        s.put(ks, keyed_kv(LAY, ks))
        s.flush()  # one segment
        s.evict(ks[6:], tier="disk")  # dead bytes in its segment(s): compaction candidates
    def no_descriptors(self, segment_id):  # the header was read; the payloads cannot be
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(FdCache, "acquire", no_descriptors)
    cli(["compact", "--store", str(tmp_path), "--threshold", "1.0"])
    monkeypatch.undo()
    with opened(tmp_path, warm=16) as s:
        assert fetch_exact(s, ks) == 6
        assert s.stats().damaged == 0


# -- the disk budget -------------------------------------------------------------------------
def test_puts_that_overflow_to_disk_keep_it_within_its_budget(tmp_path):
    """A put that finds memory full of blocks not yet written goes straight to disk: after it
    the disk is trimmed to its budget as after any write. Before, only a commit of blocks from
    memory trimmed it, so a store whose last writes were overflow stayed over its budget (18
    blocks on a budget of 8 here, for good: reopening does not trim), and whatever survives is
    exact."""
    with opened(tmp_path, warm=2, disk=8 * BN) as s:
        for i in range(4):
            head = chain(s, 20 + i, 2)
            s.put(head, keyed_kv(LAY, head)).wait()  # memory: two blocks, not yet written
            tail = chain(s, 30 + i, 10)
            s.put(tail, keyed_kv(LAY, tail))  # no room: straight to disk
            s.flush()
            assert s.stats().tier("disk").used_bytes <= 8 * BN
        last = tail
    with opened(tmp_path, warm=16, disk=8 * BN) as s:
        assert s.stats().tier("disk").used_bytes <= 8 * BN
        assert fetch_exact(s, last) >= 0
