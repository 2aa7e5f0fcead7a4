"""Adversarial reliability pass, round 4: what round 3 left (``fetch(out=)`` rows past the
run, tokens that are not one prompt of ints, the client's message when only the daemon's
shared memory is gone), clock jumps against the disk tier's ``prune`` grace period, and
processes and signals. The Redis tier's attacks are in tests/tiers/remote/test_remote_attacks.py.

Every attack checks the promise: a fetch returns exactly the bytes put under its keys or
fewer blocks (a counted miss), never other bytes; bad input raises a specific
``kvstore.errors`` class and loses nothing; nothing waits without a bound.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import bit_equal, keyed_kv

from kvstore import KVLayout, connect, open_store
from kvstore.errors import DaemonUnavailableError, TokenError
from kvstore.keys import tokens_to_u32le

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
BN = LAY.block_nbytes  # 512 B
T = LAY.block_tokens
MODEL = "attacks/round4"


def opened(path, *, warm=64, hot=0, model=MODEL, disk="64MiB", **kw):
    return open_store(path, layout=LAY, model_id=model, device="cpu", gpu_capacity=hot * BN,
                      cpu_capacity=warm * BN, disk_capacity=disk, **kw)


def chain(s, i: int, n: int = 6):
    return s.block_keys([i * 100_000 + t for t in range(n * T)])


def fetch_exact(s, keys, timeout: float = 20) -> int:
    """Fetch ``keys``; the blocks returned must be exactly their own keys' bytes."""
    got = s.fetch(keys).wait(timeout)
    n = got.shape[0]
    assert bit_equal(got, keyed_kv(LAY, keys[:n])), "wrong KV served"
    return n


def run_bounded(fn, timeout: float):
    """``fn()`` in a thread; fails the test (instead of hanging it) past ``timeout``."""
    box: dict[str, object] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for more than {timeout} s"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def _segments(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.safetensors"))


def _flip_block(seg: Path, block: int) -> None:
    """Flip a payload byte of the ``block``-th block of a one-chain segment."""
    raw = bytearray(seg.read_bytes())
    head = struct.unpack("<Q", raw[:8])[0]
    raw[8 + head + block * BN + 10] ^= 0xFF
    seg.write_bytes(bytes(raw))


# -- fetch(keys, out=...): rows past the returned run ---------------------------------------
@pytest.mark.parametrize("bad", [0, 1, 3])
def test_fetch_into_out_leaves_rows_past_the_run_untouched_when_a_disk_block_is_damaged(
        tmp_path, bad):
    """A damaged disk block in the middle of ``fetch(keys, out=buf)``: the result is
    ``buf[:n]`` with the exact bytes, and ``buf[n:]`` still holds what the caller had there.
    Before, the disk reads landed straight in ``buf``: the damaged block's bytes and the
    (good) blocks after it overwrote the caller's rows past ``n``."""
    with opened(tmp_path) as s:
        keys = chain(s, 1, 5)
        assert s.put(keys, keyed_kv(LAY, keys)).wait() == 5
        s.flush()
    _flip_block(_segments(tmp_path)[0], bad)
    with opened(tmp_path) as s:
        mine = torch.full(LAY.batch_shape(6), 3.25, dtype=LAY.dtype)
        out = mine.clone()
        got = s.fetch(keys, out=out).wait(20)
        n = got.shape[0]
        assert n == bad and s.stats().damaged == 1
        assert got.data_ptr() == out.data_ptr() or n == 0
        assert bit_equal(out[:n], keyed_kv(LAY, keys[:n]))
        assert bit_equal(out[n:], mine[n:]), "the caller's rows past the run were overwritten"


def test_fetch_into_out_with_a_short_lookup_run_writes_only_the_run(tmp_path):
    """Blocks in memory, then on disk, then a miss: ``out`` rows at and after the miss
    (and rows past ``len(keys)``) keep the caller's bytes."""
    with opened(tmp_path, warm=8) as s:
        keys = chain(s, 2, 6)
        assert s.put(keys[:4], keyed_kv(LAY, keys[:4])).wait() == 4
        s.flush()
        s.evict(keys[2:4], tier="warm")
        mine = torch.full(LAY.batch_shape(8), -7.0, dtype=LAY.dtype)
        out = mine.clone()
        n = s.fetch(keys, out=out[:6]).wait(20).shape[0]
        assert n == 4
        assert bit_equal(out[:4], keyed_kv(LAY, keys[:4])) and bit_equal(out[4:], mine[4:])


# -- tokens that are not one prompt of ints ------------------------------------------------
@pytest.mark.parametrize("tokens", [
    [True, False] * 8,
    [1, 2, 3, True],
    (False,) * 4,
    torch.arange(16).reshape(2, 8),
    np.arange(16).reshape(4, 4),
    torch.arange(16).reshape(8, 2).t(),
    torch.tensor(7),
    np.int64(7),
], ids=["bools", "one_bool", "bool_tuple", "torch_2d", "numpy_2d", "torch_2d_t", "torch_0d",
        "numpy_scalar"])
def test_bools_and_batches_of_tokens_are_refused_with_token_error(tokens):
    """``True`` is ``1`` to Python and a ``[batch, seq]`` tensor flattens into one long
    prompt: both used to key silently (a batch of prompts became one prompt's chain, hitting
    nothing or the wrong prefix). Now a TokenError says what to pass, from the native and
    the pure-Python paths alike (the daemon's client calls the same function)."""
    with opened(None) as s, pytest.raises(TokenError, match="bool|1-D|one prompt"):
        s.block_keys(tokens)
    with pytest.raises(TokenError, match="bool|1-D|one prompt"):
        tokens_to_u32le(tokens)


@pytest.mark.parametrize("tokens", [
    list(range(16)), tuple(range(16)), range(16), iter(range(16)), torch.arange(16),
    torch.arange(16, dtype=torch.int32).reshape(1, 16), np.arange(16, dtype=np.uint16),
    np.arange(16).reshape(1, 16), [np.int64(t) for t in range(16)], torch.arange(32)[::2] // 2,
], ids=["list", "tuple", "range", "iter", "torch", "torch_one_row", "numpy_u16",
        "numpy_one_row", "numpy_scalars", "torch_strided"])
def test_every_valid_token_container_keys_the_same(tokens):
    """What was valid stays valid and keys identically: lists, tuples, ranges, iterators,
    1-D torch/numpy integer arrays, one-row ``[1, n]`` arrays (a tokenizer's output)."""
    with opened(None) as s:
        assert s.block_keys(tokens) == s.block_keys(list(range(16)))


# -- the daemon's shared memory gone ---------------------------------------------------------
def test_a_daemon_whose_shared_memory_was_removed_is_named_as_such(serve, tmp_path):
    """The daemon answers, but the slab file its hello names is gone from /dev/shm (a
    clean-up, systemd's RemoveIPC) or truncated: ``connect`` said "no kvstore daemon answers
    at ... (No such file or directory)", sending the user after a daemon that is running.
    Now the message names the shared memory, why it may be gone and what to do; a truncated
    file is the same error (it was a SizeError escaping the reconnect path)."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "0", "--shm-dir", str(shm))
    with connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as c:
        keys = chain(c, 3, 2)
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 2
    slabs = [p for p in shm.rglob("*") if p.is_file() and not p.name.endswith(".keys")
             and p.stat().st_size >= 1 << 20]
    assert len(slabs) == 1, list(shm.rglob("*"))
    os.truncate(slabs[0], 4096)
    for _ in range(2):
        with pytest.raises(DaemonUnavailableError, match="answered, but its shared memory") as e:
            connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10)
        assert "restart the daemon" in str(e.value) and str(slabs[0]) in str(e.value)
        slabs[0].unlink(missing_ok=True)
    assert d.proc.poll() is None and d.answers()
    with connect(d.socket_path, layout=LAY, model_id=MODEL + "/other", device="cpu",
                 timeout=10) as c:  # the daemon's other namespaces serve on
        keys = chain(c, 4, 2)
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 2 and fetch_exact(c, keys) == 2
