"""Disk index opened while other processes write it (issue 26, item 6): a ``data.mdb`` that
grows between the size check and the map, or whose last pages LMDB left unwritten (free
pages of the last commit), is not a cut-off file — the store is never reported damaged.
"""

from __future__ import annotations

import os
import random
import time

import lmdb
import pytest
import torch
from support.disk import chain, fork_call, namespace, small_layout, wait_child, writes

from kvstore.errors import StoreCorruptError
from kvstore.tiers.disk import DiskTier

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

LAY = small_layout(torch.bfloat16)
BN = LAY.block_nbytes



OPENS = int(os.environ.get("KVSTORE_OPEN_STRESS", "1000"))
#: how long this process stalls after each fstat of the index guard (longer than most of
#: the writer's fdatasyncs between growing the file and writing its meta page)
STALL_S = 0.004


class _Stalled:
    """``os`` as the index guard of this process sees it: stalled for a moment after each
    ``fstat`` — a loaded machine descheduling it — which is when another process's commit
    can grow data.mdb and write a meta page that names the new pages."""

    def __getattr__(self, name: str):
        return getattr(os, name)

    @staticmethod
    def fstat(fd: int) -> os.stat_result:
        st = os.fstat(fd)
        time.sleep(STALL_S)
        return st


def _grow(path, ns, stop: int) -> None:
    """Write chains (the index grows, page by page) and delete some (LMDB frees pages) until
    ``stop`` is readable."""
    os.set_blocking(stop, False)
    rnd = random.Random(6)
    t = DiskTier(path, capacity_bytes=1 << 30)
    written: list[list[bytes]] = []
    i = 0
    try:
        while True:
            try:
                if os.read(stop, 1):
                    break
            except BlockingIOError:
                pass
            ks = chain(f"grow{i}", rnd.randint(1, 24))
            t.write_blocks(writes(ks, ns))
            written.append(ks)
            if i % 3 == 2:
                gone = [written.pop(rnd.randrange(len(written))) for _ in range(2)]
                t.delete_owned([k for ks in gone for k in ks], ns.id)
            i += 1
    finally:
        t.close()


def test_opening_a_store_another_process_grows_is_never_a_false_alarm(tmp_path, monkeypatch):
    """One process writes chains and deletes some, growing the index; this one opens the
    store 1,000 times meanwhile, stalling after each size check of the index guard. Every
    open succeeds: 0 StoreCorruptError (it said "the file is cut off ... run kvstore
    recover" about a healthy store)."""
    from kvstore.tiers.disk import guard, lmdb_meta, lmdb_trees

    ns = namespace(LAY)
    with DiskTier(tmp_path, capacity_bytes=1 << 30) as t:
        t.register_namespace(ns)
        t.write_blocks(writes(chain("first", 4), ns))
    r, w = os.pipe()
    pid = fork_call(lambda: (os.close(w), _grow(tmp_path, ns, r)))
    os.close(r)
    for mod in (guard, lmdb_meta):
        monkeypatch.setattr(mod, "os", _Stalled())
    # open as a large index does (the named databases walked at their root pages): the
    # writer grows this one past the full walk's size within seconds
    monkeypatch.setattr(lmdb_trees, "DEFAULT_FULL_PAGES", 64)
    alarms: list[str] = []
    try:
        for _ in range(OPENS):
            try:
                with DiskTier(tmp_path, capacity_bytes=1 << 30) as t:
                    assert t.leading_run(chain("first", 4), ns.id) == 4
            except StoreCorruptError as e:
                alarms.append(str(e))
    finally:
        os.write(w, b"x")
        os.close(w)
        assert wait_child(pid) == 0
    assert not alarms, f"{len(alarms)} false alarms in {OPENS} opens; the first: {alarms[0]}"
    with DiskTier(tmp_path, capacity_bytes=1 << 30) as t:
        assert t.check() == []


def _leave_free_tail(index_dir: str, seed: int = 0) -> int:
    """Commit to an extra named database of the index until LMDB leaves data.mdb shorter
    than its meta page says: the last pages were allocated and freed in one transaction
    (loose pages), so LMDB never wrote them, and they are free pages of the new meta.
    Returns the number of pages past the end of the file."""
    from kvstore.tiers.disk import lmdb_meta

    env = lmdb.open(index_dir, max_dbs=16, sync=False)
    try:
        db = env.open_db(b"scratch")
        rnd = random.Random(seed)
        keys: list[bytes] = []
        path = os.path.join(index_dir, "data.mdb")
        for _ in range(500):
            with env.begin(write=True) as txn:
                for _ in range(rnd.randint(1, 200)):
                    if keys and rnd.random() < 0.5:
                        txn.delete(keys.pop(rnd.randrange(len(keys))), db=db)
                    else:
                        keys.append(rnd.randbytes(32))
                        txn.put(keys[-1], rnd.randbytes(rnd.choice([16, 128, 3000])), db=db)
            fd = os.open(path, os.O_RDONLY)
            try:
                m = lmdb_meta.read_meta(fd, os.fstat(fd).st_size + (1 << 30))
                short = m.last_pg + 1 - os.fstat(fd).st_size // m.psize
            finally:
                os.close(fd)
            if short > 0:
                return short
    finally:
        env.close()
    raise AssertionError("LMDB left no free pages past the end of the file")


def test_pages_lmdb_never_wrote_past_the_end_are_no_damage(tmp_path):
    """LMDB does not write pages that one transaction allocated and freed again, so a
    healthy data.mdb can be shorter than its meta page's last page: the missing pages are
    all free. The store opens, reads, checks and verifies clean; a file cut into pages in
    use is still refused."""
    from kvstore.admin.verification import verify
    from kvstore.tiers.disk import guard

    ns = namespace(LAY)
    keys = chain("tail", 6)
    with DiskTier(tmp_path, capacity_bytes=1 << 30) as t:
        t.register_namespace(ns)
        t.write_blocks(writes(keys, ns))
    index = str(tmp_path / "index")
    assert _leave_free_tail(index) >= 1
    guard.before_open(index)
    assert guard.check_index(index).ok
    with DiskTier(tmp_path, capacity_bytes=1 << 30) as t:
        assert t.leading_run(keys, ns.id) == 6
        assert t.check(grace_s=0) == []
    assert verify(str(tmp_path), grace_s=0).ok
    # really cut off: pages in use are gone
    data = tmp_path / "index" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(StoreCorruptError, match="kvstore recover"):
        guard.before_open(index)
    with pytest.raises(StoreCorruptError, match="kvstore recover"):
        DiskTier(tmp_path, capacity_bytes=1 << 30).leading_run(keys, ns.id)
