"""The disk index's reader slots of processes that died inside a read transaction: cleared by
the next write transaction, so the pages freed after them are reused (the file stays bounded)."""

from __future__ import annotations

import logging
import subprocess
import sys

from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk import tombstones as tomb

_DIES_READING = r"""
import lmdb, os, signal, sys
env = lmdb.open(sys.argv[1], max_readers=1024, max_dbs=16)  # kvstore's own settings
txn = env.begin()  # a read transaction: one reader slot, at the index's current txn...
txn.stat(env.open_db(b"blocks", txn=txn, create=False))
os.kill(os.getpid(), signal.SIGKILL)  # ...kept by a process that died with it
"""


def test_a_reader_killed_inside_a_read_no_longer_pins_the_freed_pages(tmp_path, monkeypatch,
                                                                       caplog):
    """LMDB reuses a page freed by a transaction only once no reader older than it remains,
    and it counted the slot of a process killed -9 inside a read (an engine's lookup) as such
    a reader until every process had closed the index: each commit after it took new pages
    (here ~1,340 over 200 writes; ~50 per put+flush of a store) and the file grew for as long
    as the store ran. Each write transaction now clears dead processes' slots first."""
    monkeypatch.setattr(tomb, "GENERATION", 64)  # a trace that fills fast, then churns
    t = DiskTier(tmp_path / "s", capacity_bytes=1 << 20)
    data = tmp_path / "s" / "index" / "data.mdb"

    def churn(base: int) -> None:  # 200 write transactions, each freeing pages
        for j in range(base, base + 200):
            tomb.record_on(t, [(bytes(32) + (j * 16 + x).to_bytes(32, "big"), 0)
                               for x in range(16)], tomb.Reason.EVICTED, tomb.TierCode.DISK,
                           removed_us=j)

    try:
        churn(0)
        before = data.stat().st_size
        subprocess.run([sys.executable, "-c", _DIES_READING, str(data.parent)], check=False,
                       timeout=60)
        with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
            churn(200)
        grown = data.stat().st_size - before
    finally:
        t.close()
    assert grown <= 8 * 4096, grown
    assert "cleared 1 reader slot(s) left by processes that died" in caplog.text
