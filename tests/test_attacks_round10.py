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
import signal
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import pytest
from conftest import bit_equal, fetch_exact, keyed_kv, run_bounded
from support.attacks import BN, LAY, T, attack_store

from kvstore import open_store
from kvstore.cli import main as cli
from kvstore.errors import NotDurableError, StoreClosedError
from kvstore.tiers.disk import env as disk_env
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


def test_a_fetch_out_of_file_descriptors_misses_and_loses_nothing_flushed(tmp_path, caplog):
    """A fetch of flushed blocks in a process that has used up its descriptors (EMFILE: the
    segment cannot be opened) is a miss; the blocks stay in the index and are served once
    descriptors are free. Before, each was 'damaged': its entry was dropped and the emptied
    segment file unlinked, so every flushed block the process tried to read was gone. The
    log says so once, not once per block."""
    with opened(tmp_path) as s:
        ks = chain(s, 1)
        s.put(ks, keyed_kv(LAY, ks))
        s.flush()
    with opened(tmp_path, warm=16) as s:  # nothing in memory, no segment open yet
        with descriptors_exhausted():
            got = s.fetch(ks).wait(20)
        assert got.shape[0] == 0
        said = [r for r in caplog.records if "cannot be read now" in r.getMessage()]
        assert len(said) <= 1  # one line for the stretch (within 10 s), not one per block
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



def test_verify_fix_that_cannot_open_a_segment_drops_nothing(tmp_path, monkeypatch, caplog):
    """``kvstore verify --fix`` whose reads cannot open a segment (EMFILE) reports no damage
    and drops nothing; before, each block it could not read was a 'checksum_mismatch'
    finding and the fix dropped every one of them."""
    with opened(tmp_path, warm=64) as s:
        ks = chain(s, 11, 6)
        s.put(ks, keyed_kv(LAY, ks))
        s.flush()

    def no_descriptors(self, segment_id):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(FdCache, "acquire", no_descriptors)
    cli(["verify", "--store", str(tmp_path), "--fix", "-y", "--grace", "0"])
    monkeypatch.undo()
    assert any("could not be read now" in r.getMessage() for r in caplog.records)
    with opened(tmp_path, warm=16) as s:
        assert fetch_exact(s, ks) == 6
        assert s.stats().damaged == 0

# -- a write path call failing at its Nth call --------------------------------------------------
class _NthCall:
    """Fails the ``n``-th call (and with ``sticky`` every later one) while ``on``."""

    def __init__(self, n: int, err: int, sticky: bool) -> None:
        self.n, self.err, self.sticky, self.calls, self.hits, self.on = n, err, sticky, 0, 0, False

    def __call__(self) -> None:
        if self.on:
            self.calls += 1
            if self.calls == self.n or (self.sticky and self.calls > self.n):
                self.hits += 1
                raise OSError(self.err, os.strerror(self.err))


def _inject(monkeypatch, call: str, fault: _NthCall) -> None:
    if call == "index_commit":  # the commit's write transaction raises at its end
        real = disk_env.SharedEnv.write

        def write(self, fn):
            return real(self, lambda txn: (fn(txn), fault())[0])

        monkeypatch.setattr(disk_env.SharedEnv, "write", write)
        return
    real = getattr(os, call)

    def failing(*a, **kw):
        if call != "open" or a[1] & os.O_CREAT:  # opens for reading are left alone
            fault()
        return real(*a, **kw)

    monkeypatch.setattr(os, call, failing)


@pytest.mark.parametrize("call", ["writev", "fsync", "link", "unlink", "open", "index_commit"])
def test_a_write_path_call_failing_at_its_nth_call_never_gets_a_block_lost_once_vouched(
        tmp_path, monkeypatch, call):
    """``call`` fails at its Nth call (N = 1..4; once, or from then on), with EIO, ENOSPC or
    EDQUOT, across 8 puts and 4 flushes, with memory for all of them or a warm tier of 8
    slots (puts overflow straight to disk); then the fault clears and one more flush. Puts
    never raise; each flush returns or raises NotDurableError; a copy of the files taken
    after the last flush (what kill -9 leaves) serves every vouched chain exactly, every
    other chain exactly or shorter, and verifies clean."""
    errs = (errno.EIO, errno.ENOSPC, errno.EDQUOT)
    case = 0
    for n in range(1, 5):
        for sticky in (False, True):
            for warm in (256, 8):
                case += 1
                fault = _NthCall(n, errs[case % 3], sticky)
                with monkeypatch.context() as mp:
                    _inject(mp, call, fault)
                    here = tmp_path / f"{case}"
                    vouched, chains, since = set(), [], []
                    with opened(here / "store", warm=warm) as s:
                        fault.on = True
                        for i in range(9):
                            if i == 8:
                                fault.on = False
                            else:
                                ks = chain(s, i)
                                s.put(ks, keyed_kv(LAY, ks))
                                chains.append(ks)
                                since.append(i)
                            if i % 2 or i == 8:
                                try:
                                    s.flush(timeout=30)
                                    # all in memory: a flush vouches for every earlier put;
                                    # else only for those since the last flush (the ones
                                    # before may have left memory unwritten, and were reported)
                                    vouched |= set(range(len(chains)) if warm > 8 else since)
                                except NotDurableError as e:
                                    assert e.blocks > 0 and e.reason
                                since = []
                        copy = killed_copy(here / "store", here / "killed")
                assert fault.hits, "the fault never fired: the attack did not attack"
                with opened(copy, warm=16) as s:
                    for i, ks in enumerate(chains):
                        got = fetch_exact(s, ks)
                        assert i not in vouched or got == len(ks), (n, sticky, warm, i)
                    assert s.stats().damaged == 0
                assert cli(["verify", "--store", str(copy), "--format", "json"]) == 0



@pytest.mark.parametrize("who, call, n", [("flush", "unlink", 1), ("compact", "unlink", 1),
                                          ("compact", "fsync", 2)])
def test_a_segment_write_failing_after_it_was_named_leaves_no_orphan(tmp_path, monkeypatch,
                                                                      who, call, n):
    """The temp name's unlink after the segment was linked into place (``unlink`` 1), or
    compaction's directory fsync (``fsync`` 2), fails: the write fails as a whole, and the
    named file no record points at is removed with it. Before, it stayed as an orphan that
    ``kvstore verify`` reported (and that would come back with ``kvstore recover``)."""
    with opened(tmp_path) as s:
        ks = chain(s, 50, 12)
        s.put(ks, keyed_kv(LAY, ks))
        if who == "compact":
            s.flush()
            s.evict(ks[6:], tier="disk")
        fault = _NthCall(n, errno.EIO, False)
        with monkeypatch.context() as mp:
            _inject(mp, call, fault)
            fault.on = True
            if who == "flush":
                with pytest.raises(NotDurableError):
                    s.flush()
            else:
                assert cli(["compact", "--store", str(tmp_path), "--threshold", "1.0"]) != 0
        assert fault.hits == 1
        s.flush()
    with opened(tmp_path, warm=16) as s:
        assert fetch_exact(s, ks) == (12 if who == "flush" else 6)
    assert cli(["verify", "--store", str(tmp_path), "--grace", "0", "--format", "json"]) == 0


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



def test_capacity_eviction_racing_fetches_of_the_same_keys_serves_exact_bytes(tmp_path):
    """A writer thread puts and flushes chains into a disk budget of 24 blocks (each flush
    evicts the oldest) while three threads fetch the newest chains from disk and drop their
    warm copies: every fetch is exact or shorter, nothing raises or hangs, and the budget
    holds."""
    import random
    import time

    stop = threading.Event()
    chains: list = []
    failures: list[BaseException] = []
    served = [0]
    with opened(tmp_path, warm=8, disk=24 * BN) as s:
        def writer() -> None:
            i = 0
            while not stop.is_set():
                ks = chain(s, 100 + i, 4)
                s.put(ks, keyed_kv(LAY, ks))
                chains.append(ks)
                if i % 2:
                    s.flush(timeout=30)
                i += 1

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                if not chains:
                    continue
                ks = chains[max(0, len(chains) - 1 - rng.randrange(8))]
                try:
                    served[0] += fetch_exact(s, ks)
                    if rng.random() < 0.3:
                        s.evict(ks, tier="warm")
                except BaseException as e:
                    failures.append(e)
                    return

        threads = [threading.Thread(target=writer)] + [
            threading.Thread(target=reader, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a fetch or flush hung"
        assert not failures, failures[0]
        assert served[0] > 0 and len(chains) > 20
        s.flush()
        assert s.stats().tier("disk").used_bytes <= 24 * BN


def test_stores_of_other_layouts_and_models_on_one_directory_never_share_blocks(tmp_path):
    """Stores of two layouts and two models on one directory, in one process, putting the
    same token ids: each fetch serves only its own store's bytes; after a reopen too."""
    from kvstore import KVLayout

    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=LAY.dtype,
                     block_tokens=T * 2)
    kinds = [(LAY, MODEL), (LAY, MODEL + "-b"), (other, MODEL)]

    def open_kind(lay, model, **kw):
        return open_store(tmp_path, layout=lay, model_id=model, device="cpu", gpu_capacity=0,
                          cpu_capacity=16 * lay.block_nbytes, **kw)

    tokens = list(range(1000, 1000 + 8 * T))
    stores = [open_kind(lay, model) for lay, model in kinds]
    try:
        for i, st in enumerate(stores):
            ks = st.block_keys(tokens)
            kv = keyed_kv(st.layout, ks)
            st.put(ks, kv if i % 2 == 0 else kv.neg()).wait()  # model -b stores other bytes
            st.flush()
    finally:
        for st in stores:
            st.close()
    for i, (lay, model) in enumerate(kinds):
        with open_kind(lay, model) as st:
            ks = st.block_keys(tokens)
            got = st.fetch(ks).wait(20)
            want = keyed_kv(lay, ks)
            assert got.shape[0] == len(ks)
            assert bit_equal(got, want if i % 2 == 0 else want.neg())


# -- processes -------------------------------------------------------------------------------
class _StallingSink:
    """An event sink that holds the first warm announcement (made under the store's lock)
    until told to go: a thread of the parent inside the store when another thread forks."""

    def __init__(self) -> None:
        self.inside, self.go = threading.Event(), threading.Event()

    def stored(self, tier, keys, parents) -> None:
        if tier == "warm" and not self.go.is_set():
            self.inside.set()
            self.go.wait(30)

    def removed(self, tier, keys) -> None:
        pass

    def cleared(self, tier=None) -> None:
        pass


def test_a_forked_child_gets_store_closed_even_while_a_parent_thread_was_inside(tmp_path):
    """A fork while another thread of the parent is inside the store (holding its lock): the
    child's calls on its copy raise StoreClosedError naming the fork and its close returns,
    and a store the child opens on the same directory serves the parent's flushed blocks and
    flushes its own. Before, the child's first call waited forever on the lock no thread of
    the child would ever release."""
    sink = _StallingSink()
    s = open_store(tmp_path, layout=LAY, model_id=MODEL, device="cpu", gpu_capacity=0,
                   cpu_capacity=16 * BN, events=sink)
    sink.go.set()
    flushed = chain(s, 40)
    s.put(flushed, keyed_kv(LAY, flushed)).wait()
    s.flush()
    sink.go.clear()
    ks = chain(s, 41)
    t = threading.Thread(target=lambda: s.put(ks, keyed_kv(LAY, ks)))
    t.start()
    assert sink.inside.wait(10)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(20)  # a hang ends the child, and the test sees it
        code = 0
        try:
            for call in (lambda: s.lookup(ks), lambda: s.put(ks, keyed_kv(LAY, ks)), s.stats):
                try:
                    call()
                    code = 2
                except StoreClosedError as e:
                    code = code or (0 if "fork" in str(e) else 3)
            s.close()
            with opened(tmp_path, warm=16) as c:
                code = code or (0 if fetch_exact(c, flushed) == len(flushed) else 4)
                own = chain(c, 42)
                c.put(own, keyed_kv(LAY, own))
                c.flush()
        except BaseException:
            code = 5
        os._exit(code)
    try:
        status = run_bounded(lambda: os.waitpid(pid, 0)[1], 40)
    finally:
        sink.go.set()
        t.join(30)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
    own = chain(s, 42)
    assert fetch_exact(s, own) == len(own)
    s.close()


def test_evict_from_warm_of_blocks_held_nowhere_else_counts_every_block_that_left(tmp_path):
    """``evict(keys, tier="warm")`` of blocks with no copy elsewhere removes them with their
    descendants, as documented, and returns how many left: before, 1 for a chain of 6 (the
    subtree's root was counted, not the blocks that went with it)."""
    with attack_store(None, model=MODEL, warm=16, disk=0) as s:
        ks = chain(s, 60)
        s.put(ks, keyed_kv(LAY, ks)).wait()
        assert s.evict(ks, tier="warm") == len(ks)
        assert s.lookup(ks) == 0
        s.put(ks, keyed_kv(LAY, ks)).wait()
        assert s.evict(ks[2:], tier="warm") == len(ks) - 2
        assert fetch_exact(s, ks) == 2


_DIES_READING = r"""
import lmdb, os, signal, sys
env = lmdb.open(sys.argv[1], max_readers=1024, max_dbs=16)  # kvstore's own settings
txn = env.begin()  # a read transaction: one reader slot...
txn.stat(env.open_db(b"blocks", txn=txn, create=False))
os.kill(os.getpid(), signal.SIGKILL)  # ...kept by a process that died with it
"""


@contextlib.contextmanager
def _flushed_on_8_reader_slots(tmp_path, monkeypatch, i: int):
    """A store whose index has 8 reader slots (the table is sized by its first opener: this
    process), and a flushed chain read from disk only (evicted from memory)."""
    real_open = lmdb.open
    monkeypatch.setattr(lmdb, "open", lambda path, **kw: real_open(path, **{**kw, "max_readers": 8}))
    with opened(tmp_path, warm=16) as s:
        monkeypatch.undo()
        ks = chain(s, i)
        s.put(ks, keyed_kv(LAY, ks))
        s.flush()
        s.evict(ks, tier="warm")
        yield s, ks


def test_readers_killed_inside_a_read_do_not_lock_every_process_out_of_the_index(
        tmp_path, monkeypatch):
    """Engines killed -9 inside a read transaction of the index (a lookup, a fetch) each
    leave a reader slot taken: once they filled the table (1,024 slots; 8 here), every read
    of every process failed with MDB_READERS_FULL, raised out of ``put``, ``lookup`` and
    ``fetch``, until every process had closed the store. Now the slots of dead processes are
    cleared and the reads go on."""
    with _flushed_on_8_reader_slots(tmp_path, monkeypatch, 70) as (s, ks):
        for _ in range(9):
            subprocess.run([sys.executable, "-c", _DIES_READING, str(tmp_path / "index")],
                           check=False, timeout=60)
        more = chain(s, 71)
        assert s.put(more, keyed_kv(LAY, more)).wait(10) == len(more)
        assert s.lookup(ks) == len(ks)
        assert fetch_exact(s, ks) == len(ks)
        s.flush()


_READS_AND_WAITS = _DIES_READING.replace(
    "os.kill(os.getpid(), signal.SIGKILL)  # ...kept by a process that died with it",
    "print('reading', flush=True); sys.stdin.read()  # ...kept while it lives")


def test_an_index_no_process_can_read_now_is_a_miss_for_put_lookup_and_fetch(
        tmp_path, monkeypatch):
    """Every reader slot of the index held by live processes (8 here): ``put`` stores in
    memory, ``lookup`` and ``fetch`` miss, ``stats`` gives the disk's last occupancy, none
    raises (they raised MDB_READERS_FULL); once
    those processes are killed, their slots are cleared and the flushed blocks are served."""
    with _flushed_on_8_reader_slots(tmp_path, monkeypatch, 72) as (s, ks):
        on_disk = s.stats().tier("disk")
        readers = [subprocess.Popen([sys.executable, "-c", _READS_AND_WAITS,
                                     str(tmp_path / "index")], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for _ in range(8)]
        try:
            assert all(p.stdout.readline() == "reading\n" for p in readers)
            more = chain(s, 73)
            assert s.put(more, keyed_kv(LAY, more)).wait(10) == len(more)
            assert s.lookup(ks) == 0
            assert fetch_exact(s, ks) == 0
            assert s.stats().tier("disk") == on_disk  # the last occupancy read
        finally:
            for p in readers:
                p.kill()
                p.wait(30)
        assert fetch_exact(s, ks) == len(ks)
        s.flush()
    with opened(tmp_path, warm=16) as s:
        assert fetch_exact(s, more) == len(more)


def test_a_put_after_evict_from_disk_stores_the_blocks_anew(tmp_path):
    """``evict(keys, tier="disk")`` keeps memory's copies; a later ``put`` of the same keys
    stores them on disk anew (as the evict promises), so the flush after it vouches for
    blocks that are there. Before, the put was a duplicate of what memory held, nothing was
    written, and a kill -9 after that flush lost every block (found by a fuzz of puts,
    evicts and flushes under write faults)."""
    with opened(tmp_path / "store", warm=64) as s:
        ks = chain(s, 80)
        s.put(ks, keyed_kv(LAY, ks))
        s.flush()
        assert s.evict(ks, tier="disk") == len(ks)
        assert s.put(ks, keyed_kv(LAY, ks)).wait(10) == 0  # held: nothing new in memory
        s.flush()
        copy = killed_copy(tmp_path / "store", tmp_path / "killed")
    with opened(copy, warm=16) as s:
        assert fetch_exact(s, ks) == len(ks)


def test_puts_evicts_reopens_and_flushes_under_random_write_faults_lose_nothing_vouched(
        tmp_path, monkeypatch):
    """A seeded mix of puts (chains of 1-7 blocks, extended or cut), fetches, evicts from
    every tier, reopens and flushes while write-path calls fail at random (10 %): every
    fetch is exact; a copy of the files after a last flush without faults (kill -9) serves
    at least what each flush vouched for."""
    import random

    rng, fail = random.Random(10), [0.0]

    def maybe() -> None:
        if rng.random() < fail[0]:
            raise OSError(errno.EIO, "injected")

    for call in ("writev", "fsync", "link", "unlink"):
        real = getattr(os, call)
        monkeypatch.setattr(os, call, lambda *a, _r=real, **kw: (maybe(), _r(*a, **kw))[1])
    chains: dict = {}
    vouched: dict[int, int] = {}
    since: dict[int, int] = {}
    path = tmp_path / "store"
    s = opened(path, warm=64)
    try:
        fail[0] = 0.1
        for _ in range(400):
            op, i = rng.random(), rng.randrange(20)
            if op < 0.4:
                n = rng.randrange(1, 8)
                ks = chain(s, 200 + i, n)
                s.put(ks, keyed_kv(LAY, ks)).wait(30)
                chains[i] = max(chains.get(i, ks), ks, key=len)
                since[i] = max(since.get(i, 0), min(n, s.lookup(ks)))
            elif op < 0.6 and i in chains:
                fetch_exact(s, chains[i])
            elif op < 0.75 and i in chains:
                k = rng.randrange(len(chains[i]))
                s.evict(chains[i][k:], tier=rng.choice([None, "warm", "disk"]))
                for d in (vouched, since):
                    d[i] = min(d.get(i, 0), k)
            elif op < 0.8:
                s.close()  # flushes; what it could not write it logs
                s, since = opened(path, warm=64), {}
            else:
                with contextlib.suppress(NotDurableError):
                    s.flush(timeout=30)
                    for j, m in since.items():
                        vouched[j] = max(vouched.get(j, 0), m)
                since = {}
        fail[0] = 0.0
        s.flush(timeout=30)
        for j, m in since.items():
            vouched[j] = max(vouched.get(j, 0), m)
        copy = killed_copy(path, tmp_path / "killed")
    finally:
        fail[0] = 0.0
        s.close()
    with opened(copy, warm=16) as s:
        for i, ks in chains.items():
            assert fetch_exact(s, ks) >= vouched.get(i, 0), f"chain {i} lost vouched blocks"
