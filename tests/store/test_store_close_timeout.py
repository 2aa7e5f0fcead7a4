"""``close`` is bounded: another process holding the disk index's write lock (an engine
stopped with SIGSTOP in the middle of a commit) never hangs ``close``, the interpreter's exit
or the daemon's shutdown, and what an earlier ``flush()`` returned for stays on disk.

Regression: ``Store.close()`` joined the disk writer without a limit, and the writer waited
for LMDB's write lock for as long as the stopped process held it; so did the exit hook that
closes stores left open, and the daemon's SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import keyed_kv

from kvstore import KVLayout, open_store
from kvstore.errors import CloseTimeoutError, StoreClosedError

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_tokens=4)
OPEN = dict(layout=LAY, model_id="close/timeout", device="cpu", gpu_capacity=0,
            cpu_capacity=64 * LAY.block_nbytes, disk_capacity="64MiB")

#: a process that takes the index's write lock, says so, and waits (to be stopped)
_LOCKER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], subdir=True, max_dbs=16, lock=True)
txn = env.begin(write=True)
print("locked", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def index_locked_by_a_stopped_process(store_path):
    """A second process holds the index's write lock, stopped (SIGSTOP) while holding it;
    killed on exit (LMDB's robust mutex then frees the lock)."""
    p = subprocess.Popen([sys.executable, "-c", _LOCKER, str(store_path / "index")],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "locked"
        os.kill(p.pid, signal.SIGSTOP)
        yield p
    finally:
        p.kill()
        p.wait(10)


def test_close_gives_up_on_an_index_another_process_holds_and_keeps_what_flush_vouched_for(
        tmp_path):
    s = open_store(tmp_path, **OPEN)
    keys = s.block_keys(list(range(16 * LAY.block_tokens)))
    kv = keyed_kv(LAY, keys)
    assert s.put(keys[:8], kv[:8]).wait() == 8
    s.flush()  # vouches for these 8
    with index_locked_by_a_stopped_process(tmp_path):
        assert s.put(keys[8:], kv[8:]).wait() == 8  # the writer now waits for the lock
        t0 = time.monotonic()
        with pytest.raises(CloseTimeoutError, match="write lock") as err:
            s.close(timeout=1.0)
        assert time.monotonic() - t0 < 10
        assert err.value.path == str(tmp_path) and "flush()" in str(err.value)
        with pytest.raises(StoreClosedError):  # no new calls while it goes on closing
            s.lookup(keys)
    s.close(timeout=60)  # the lock is free: the close finishes in the background
    assert s.closed
    with open_store(tmp_path, **OPEN) as again:
        assert again.lookup(keys) >= 8
        got = again.fetch(keys[:8]).wait()
        assert torch.equal(got.view(torch.int16), kv[:8].view(torch.int16))


_SCRIPT = """
import sys, torch
import kvstore.store.lifetime as lifetime
from kvstore import KVLayout, open_store
from conftest import keyed_kv
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_tokens=4)
s = open_store(sys.argv[1], layout=LAY, model_id="close/timeout", device="cpu", gpu_capacity=0,
               cpu_capacity=64 * LAY.block_nbytes, disk_capacity="64MiB")
keys = s.block_keys(list(range(16 * LAY.block_tokens)))
kv = keyed_kv(LAY, keys)
s.put(keys[:8], kv[:8]).wait()
s.flush()
print("flushed", flush=True)
sys.stdin.readline()
s.put(keys[8:], kv[8:]).wait()
lifetime.EXIT_CLOSE_TIMEOUT_S = 1.0
print("exiting", flush=True)
"""


def test_interpreter_exit_does_not_hang_on_an_index_another_process_holds(tmp_path):
    from conftest import TESTS

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_SCRIPT), str(tmp_path)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "flushed"
        with index_locked_by_a_stopped_process(tmp_path):
            p.stdin.write("go\n")
            p.stdin.flush()
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail("the interpreter's exit hung on the index's write lock")
        assert p.returncode == 0, err
        assert "exiting" in out and "did not finish within" in err, err
    finally:
        p.kill()
        p.wait()
    with open_store(tmp_path, **OPEN) as again:
        keys = again.block_keys(list(range(16 * LAY.block_tokens)))
        assert again.lookup(keys) >= 8  # flushed before the lock was taken


def test_daemon_shutdown_does_not_hang_on_an_index_another_process_holds(tmp_path, serve):
    import kvstore

    d = serve("--shutdown-timeout", "1", "--cpu-capacity", "1MiB", "--disk-capacity", "64MiB")
    c = kvstore.connect(d.socket_path, layout=LAY, model_id="close/timeout")
    keys = c.block_keys(list(range(16 * LAY.block_tokens)))
    kv = keyed_kv(LAY, keys)
    assert c.put(keys[:8], kv[:8]).wait() == 8
    c.flush()
    with index_locked_by_a_stopped_process(d.path):
        assert c.put(keys[8:], kv[8:]).wait() == 8
        c.close()
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail("the daemon's shutdown hung on the index's write lock")
        assert time.monotonic() - t0 < 30
    assert "were not closed cleanly" in d.log()
    with open_store(d.path, **OPEN) as again:
        assert again.lookup(keys) >= 8
