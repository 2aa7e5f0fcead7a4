"""Adversarial reliability pass, round 3: attacks on the public API (``open_store`` and its
``Store``, the daemon and ``kvstore.connect``, the ``kvstore`` CLI) that the other suites do
not make.

Every attack checks the promise: a fetch returns exactly the bytes put under its keys or
fewer blocks (a counted miss), never other bytes; bad input raises a specific
``kvstore.errors`` class and loses nothing; what a ``flush`` vouched for survives a crash;
the daemon keeps serving whatever a client sends; nothing waits without a bound.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TESTS, bit_equal, fetch_exact, keyed_kv, run_bounded
from support.attacks import BN, LAY, T, attack_store, close_amid, stop_all, vouched_chains

from kvstore import KVLayout, connect, open_store
from kvstore.cli import main as cli_main
from kvstore.errors import (
    ConfigError,
    KeyFormatError,
    KVStoreError,
    NamespaceMismatchError,
    NotDurableError,
    StoreClosedError,
    StoreCorruptError,
    TensorMismatchError,
    TokenError,
)

MODEL = "attacks/round3"


def opened(path, *, model=MODEL, **kw):
    return attack_store(path, model=model, **kw)


def chain(s, i: int, n: int = 6, salt=None):
    return s.block_keys([i * 100_000 + t for t in range(n * T)], salt=salt)


# -- tensors and keys the caller should not have passed ---------------------------------------
def test_nan_inf_and_odd_bit_patterns_are_stored_as_is(tmp_path):
    """KV is bytes: NaNs (with payloads), infinities, -0.0 and denormals come back bit-exact
    from memory and, after a reopen, from disk."""
    with opened(tmp_path) as s:
        keys = chain(s, 1, 4)
        kv = keyed_kv(LAY, keys).clone()
        flat = kv.view(torch.int16).reshape(-1)
        specials = [0x7FC0, 0x7FC1, -1, 0x7F80, -0x80 & 0xFFFF, -0x8000, 0x0001, 0x7FFF]
        for i, v in enumerate(specials):
            flat[i * 7] = v if v < 0x8000 else v - 0x10000
        assert s.put(keys, kv).wait() == 4
        assert bit_equal(s.fetch(keys).wait(), kv)
        s.flush()
    with opened(tmp_path) as s:
        got = s.fetch(keys).wait()
        assert got.shape[0] == 4 and bit_equal(got, kv)


@pytest.mark.parametrize("how", ["permuted", "expanded", "strided", "offset_view"])
def test_non_contiguous_kv_is_stored_by_value(tmp_path, how):
    """Views that are not contiguous (a permutation, a stride-0 expand, every other row, an
    offset into a bigger tensor) are stored as the values they show, in memory and on disk."""
    with opened(tmp_path) as s:
        keys = chain(s, 2, 4)
        good = keyed_kv(LAY, keys)
        if how == "permuted":
            kv = good.transpose(3, 4).contiguous().transpose(3, 4)
        elif how == "expanded":
            kv = good[:1].expand(4, *LAY.block_shape)
            good = kv.contiguous()
        elif how == "strided":
            big = torch.stack([good, torch.zeros_like(good)], dim=1).reshape(8, *LAY.block_shape)
            kv = big[::2]
        else:
            big = torch.cat([torch.zeros_like(good[:3]), good])
            kv = big[3:]
        assert bit_equal(kv, good)
        assert s.put(keys, kv).wait() == 4
        assert bit_equal(s.fetch(keys).wait(), good)
        s.flush()
    with opened(tmp_path) as s:
        got = s.fetch(keys).wait()
        assert got.shape[0] == 4 and bit_equal(got, good)


def test_empty_key_lists_are_no_ops():
    with opened(None) as s:
        assert s.lookup([]) == 0
        assert s.fetch([]).wait().shape == (0, *LAY.block_shape)
        assert s.put([], torch.empty(LAY.batch_shape(0), dtype=LAY.dtype)).wait() == 0
        assert s.prefetch([]).wait() == 0
        assert s.evict([]) == 0
        with s.pin([]):
            pass
        assert s.unpin([]) == 0
        with s.borrow_blocks([]) as b:
            assert len(b) == 0
        st = s.stats()
        assert st.blocks == 0 and st.put_blocks == 0


_BAD_PUTS = {
    "key str": (lambda k: ["x" * 32], None, KeyFormatError),
    "key int": (lambda k: [7], None, KeyFormatError),
    "key None": (lambda k: [None], None, KeyFormatError),
    "key 31 bytes": (lambda k: [k[0][:31]], None, KeyFormatError),
    "key 33 bytes": (lambda k: [k[0] + b"x"], None, KeyFormatError),
    "one bad key among good": (lambda k: [k[0], b"short", k[2]], None, KeyFormatError),
    "kv float32": (None, lambda kv: kv.float(), TensorMismatchError),
    "kv int16 view": (None, lambda kv: kv.view(torch.int16), TensorMismatchError),
    "kv numpy": (None, lambda kv: kv.float().numpy(), TensorMismatchError),
    "kv list": (None, lambda kv: kv.tolist(), TensorMismatchError),
    "kv meta": (None, lambda kv: torch.empty_like(kv, device="meta"), TensorMismatchError),
    "kv one block short": (None, lambda kv: kv[:-1], TensorMismatchError),
    "kv one block extra": (None, lambda kv: torch.cat([kv, kv[:1]]), TensorMismatchError),
    "kv 5-d": (None, lambda kv: kv[0], TensorMismatchError),
    "kv heads swapped": (None, lambda kv: kv.transpose(4, 5), TensorMismatchError),
    "kv flat bytes": (None, lambda kv: kv.reshape(3, -1), TensorMismatchError),
}


@pytest.mark.parametrize("case", sorted(_BAD_PUTS))
def test_bad_puts_raise_a_specific_error_and_lose_nothing(tmp_path, case):
    bad_keys, bad_kv, err = _BAD_PUTS[case]
    with opened(tmp_path) as s:
        held = chain(s, 3, 3)
        assert s.put(held, keyed_kv(LAY, held)).wait() == 3
        keys = chain(s, 4, 3)
        kv = keyed_kv(LAY, keys)
        before = s.stats()
        with pytest.raises(err) as ei:
            s.put(bad_keys(keys) if bad_keys else keys, bad_kv(kv) if bad_kv else kv)
        assert isinstance(ei.value, KVStoreError)
        after = s.stats()
        assert (after.puts, after.blocks) == (before.puts, before.blocks)
        assert s.lookup(keys) == 0
        assert fetch_exact(s, held) == 3
        assert s.put(keys, kv).wait() == 3  # still usable
        s.flush()
    with opened(tmp_path) as s:
        assert fetch_exact(s, held) == 3 and fetch_exact(s, keys) == 3


@pytest.mark.parametrize("keys", [
    pytest.param(lambda k: {bytes(x): 1 for x in k}, id="dict"),
    pytest.param(lambda k: (bytes(x) for x in k), id="generator"),
    pytest.param(lambda k: b"".join(k), id="joined bytes"),
    pytest.param(lambda k: torch.zeros(len(k), 32, dtype=torch.uint8), id="tensor"),
])
def test_keys_that_are_not_a_sequence_of_keys_are_refused_everywhere(keys):
    """Not a list of keys at all: a ``TypeError`` (tests/store/test_store.py's contract for
    the wrong container) from every call taking keys, and nothing is stored."""
    with opened(None) as s:
        good = chain(s, 5, 2)
        bad = keys(good)
        kv = keyed_kv(LAY, good)
        for call in (lambda: s.lookup(bad), lambda: s.fetch(bad), lambda: s.put(bad, kv),
                     lambda: s.evict(bad), lambda: s.pin(bad), lambda: s.prefetch(bad)):
            with pytest.raises((TypeError, KVStoreError)):
                call()
        assert s.stats().blocks == 0


def test_keys_of_another_store_and_bad_tokens_and_salts():
    with opened(None) as a, opened(None, model="attacks/other") as b:
        theirs = chain(b, 6, 2)
        with pytest.raises(NamespaceMismatchError):
            a.put(theirs, keyed_kv(LAY, theirs))
        with pytest.raises(NamespaceMismatchError):
            a.fetch(theirs)
        for tokens in ([1, -1, 2, 3], [0.5] * 4, [2**32] * 4, ["1"] * 4, [None] * 4, [1, 2, 3, 4.0]):
            with pytest.raises((TokenError, TypeError)):
                a.block_keys(tokens)
        for salt in (1, 1.5, ["a"], object()):
            with pytest.raises(TokenError):
                a.block_keys(list(range(8)), salt=salt)
        assert a.stats().blocks == 0


def test_calls_after_close_raise_store_closed():
    s = opened(None)
    keys = chain(s, 7, 2)
    kv = keyed_kv(LAY, keys)
    s.put(keys, kv).wait()
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.lookup(keys), lambda: s.fetch(keys), lambda: s.put(keys, kv),
                 lambda: s.evict(keys), lambda: s.pin(keys), lambda: s.flush(),
                 lambda: s.stats(), lambda: s.prefetch(keys), lambda: s.block_keys([1] * 8),
                 lambda: s.borrow_blocks(keys), lambda: s.grant_put(keys),
                 lambda: s.lease_warm(keys), lambda: s.lease_into(keys, lambda i: [])):
        with pytest.raises(StoreClosedError):
            call()
    assert s.unpin(keys) == 0  # documented: a no-op once closed


# -- salts --------------------------------------------------------------------------------------
def test_same_tokens_under_different_salts_never_hit_each_other(tmp_path):
    """Per-request salts isolate tenants within one namespace, in memory and on disk: each
    salt's put is invisible under every other salt, and each gets its own bytes."""
    salts = ["tenant-a", "tenant-b", b"tenant-a\x00", "tenant-a ", "\u00e9", "e\u0301", b"\xff"]
    with opened(tmp_path) as s:
        chains = {repr(salt): chain(s, 8, 3, salt=salt) for salt in salts}
        unsalted = chain(s, 8, 3)
        for keys in chains.values():
            assert s.lookup(keys) == 0
            assert s.put(keys, keyed_kv(LAY, keys)).wait() == 3
        assert s.lookup(unsalted) == 0
        assert len({bytes(k[0]) for k in chains.values()}) == len(salts)
        s.flush()
    with opened(tmp_path) as s:
        assert s.lookup(unsalted) == 0
        for keys in chains.values():
            assert fetch_exact(s, keys) == 3


# -- threads and close --------------------------------------------------------------------------
def test_threads_hammer_one_store_then_it_is_closed_under_them(tmp_path):
    """Six threads put, fetch, evict (every tier), flush, pin and borrow overlapping chains
    through tiny tiers while the main thread closes the store: every fetch is exact, every
    failure is StoreClosedError, nothing hangs, and the reopened store serves exact bytes."""
    s = opened(tmp_path, warm=16, hot=4)
    chains = [chain(s, 10 + c) for c in range(12)]
    wrong: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            ks = rng.choice(chains)
            op = rng.random()
            try:
                if op < 0.35:
                    s.put(ks, keyed_kv(LAY, ks)).wait(20)
                elif op < 0.7:
                    got = s.fetch(ks).wait(20)
                    if not bit_equal(got, keyed_kv(LAY, ks[:got.shape[0]])):
                        wrong.append(got.shape[0])
                elif op < 0.8:
                    s.evict(ks[rng.randrange(len(ks)):], tier=rng.choice([None, "hot", "warm", "disk"]))
                elif op < 0.85:
                    s.flush(20)
                elif op < 0.9:
                    with s.pin(ks):
                        s.lookup(ks)
                elif op < 0.95:
                    with s.borrow_blocks(ks) as b:
                        if not bit_equal(b.blocks, keyed_kv(LAY, ks[:len(b)])):
                            wrong.append(-len(b))
                else:
                    s.lookup(ks)
            except StoreClosedError:
                return
            except BaseException as e:  # reported below
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(6)]
    close_amid(s, threads, stop, after=1.0)
    assert not errors, errors
    assert not wrong, wrong
    with opened(tmp_path, warm=8) as s:
        for ks in chains:
            fetch_exact(s, ks)
        assert s.stats().damaged == 0


def test_close_while_a_disk_read_is_in_flight(tmp_path, monkeypatch):
    """A fetch whose disk read is slow, and close() from another thread meanwhile: the fetch
    ends with its exact blocks, a miss or StoreClosedError; close returns."""
    from kvstore.tiers.disk.bound import BoundDisk

    with opened(tmp_path) as s:
        keys = chain(s, 20, 8)
        s.put(keys, keyed_kv(LAY, keys)).wait()
    entered = threading.Event()
    real = BoundDisk.read

    def slow_read(self, *a, **kw):
        entered.set()
        time.sleep(0.5)
        return real(self, *a, **kw)

    monkeypatch.setattr(BoundDisk, "read", slow_read)
    s = opened(tmp_path)
    t = s.fetch(keys)
    assert entered.wait(10)
    run_bounded(s.close, 30)
    try:
        got = t.wait(20)
        assert bit_equal(got, keyed_kv(LAY, keys[:got.shape[0]]))
    except StoreClosedError:
        pass


def test_puts_never_block_on_a_stuck_disk_and_flush_times_out(tmp_path, monkeypatch):
    """A disk that does not answer: puts return at once (overflowing, then dropping), a flush
    with a timeout raises TimeoutError instead of waiting, and once the disk answers every
    block is served exactly."""
    from kvstore.tiers.disk.bound import BoundDisk

    gate = threading.Event()
    for name in ("stage", "commit", "write"):
        real = getattr(BoundDisk, name)

        def stuck(self, *a, _real=real, **kw):
            gate.wait(60)
            return _real(self, *a, **kw)

        monkeypatch.setattr(BoundDisk, name, stuck)
    s = opened(tmp_path, warm=8)
    try:
        chains = [chain(s, 30 + i, 4) for i in range(10)]
        t0 = time.monotonic()
        for ks in chains:
            s.put(ks, keyed_kv(LAY, ks))
        assert time.monotonic() - t0 < 5
        with pytest.raises(TimeoutError):
            s.flush(timeout=0.3)
        for ks in chains:
            fetch_exact(s, ks)
    finally:
        gate.set()
        run_bounded(s.close, 60)
    with opened(tmp_path) as s:
        for ks in chains:
            fetch_exact(s, ks)


def test_two_stores_on_one_path_in_one_process_survive_each_others_close(tmp_path):
    """One LMDB environment per path per process: closing one store must not close it under
    the other (which keeps reading, writing and flushing)."""
    a, b = opened(tmp_path), opened(tmp_path)
    try:
        ka = chain(a, 40)
        a.put(ka, keyed_kv(LAY, ka)).wait()
        a.flush()
        a.close()
        b.evict(tier="warm")
        assert fetch_exact(b, ka) == len(ka)
        kb = chain(b, 41)
        assert b.put(kb, keyed_kv(LAY, kb)).wait() == len(kb)
        b.flush()
    finally:
        a.close()
        b.close()
    with opened(tmp_path, model=MODEL) as c:
        assert fetch_exact(c, ka) == len(ka) and fetch_exact(c, kb) == len(kb)


# -- damaged files between runs -----------------------------------------------------------------
def _segments(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.safetensors"))


def _filled(path: Path, n_chains: int = 4, blocks: int = 6, **kw) -> list:
    """A store at ``path`` holding ``n_chains`` chains, one segment per chain (flushed)."""
    with opened(path, **kw) as s:
        chains = [chain(s, 50 + i, blocks) for i in range(n_chains)]
        for ks in chains:
            assert s.put(ks, keyed_kv(LAY, ks)).wait() == blocks
            s.flush()
    return chains


@pytest.mark.parametrize("how", ["fifo", "directory", "dev_zero", "empty", "sparse_huge",
                                 "swapped"])
def test_a_segment_replaced_by_something_else_is_a_miss_never_a_hang(tmp_path, how):
    """A segment file turned into a FIFO, a directory, a link to /dev/zero, an empty file, a
    1 TiB sparse file, or swapped with another segment: every fetch returns its exact
    blocks or fewer, within a bound, and a fresh open serves the other segments."""
    chains = _filled(tmp_path)
    segs = _segments(tmp_path)
    assert len(segs) == len(chains)
    victim = segs[1]
    if how == "fifo":
        victim.unlink()
        os.mkfifo(victim)
    elif how == "directory":
        victim.unlink()
        victim.mkdir()
    elif how == "dev_zero":
        victim.unlink()
        victim.symlink_to("/dev/zero")
    elif how == "empty":
        victim.write_bytes(b"")
    elif how == "sparse_huge":
        with open(victim, "r+b") as f:
            f.truncate(1 << 40)
    else:
        a, b = victim.read_bytes(), segs[2].read_bytes()
        victim.write_bytes(b)
        segs[2].write_bytes(a)

    def fetch_all():
        with opened(tmp_path, warm=16) as s:
            return [fetch_exact(s, ks) for ks in chains], s.stats().damaged

    got, damaged = run_bounded(fetch_all, 60)
    assert got[0] == len(chains[0]) and got[3] == len(chains[3])
    if how != "sparse_huge":  # bytes past the end: the blocks are still whole
        assert got[1] == 0 and damaged >= 1
    # the damaged entries were dropped: the next open misses them at once, serves the rest
    got2, _ = run_bounded(fetch_all, 60)
    assert got2[0] == len(chains[0]) and got2[3] == len(chains[3])


def test_export_with_a_fifo_segment_ends_and_leaves_its_blocks_out(tmp_path):
    """``kvstore export`` opens segments itself: a FIFO in a segment's place is damaged
    blocks left out of the pack, not an export blocked forever on the open (it was)."""
    chains = _filled(tmp_path)
    victim = _segments(tmp_path)[1]
    victim.unlink()
    os.mkfifo(victim)
    pack = tmp_path / "out.kvpack"
    rc = run_bounded(lambda: cli_main(["export", "--store", str(tmp_path), "--namespace", MODEL,
                                       "-o", str(pack), "--format", "json"]), 60)
    assert rc == 0 and pack.stat().st_size > 0
    assert all(len(ks) == 6 for ks in chains)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_random_byte_flips_across_every_segment_are_misses_or_exact(tmp_path, codec):
    """Bytes flipped at random offsets of every segment (headers, payloads, padding): each
    chain comes back as a prefix of exact blocks; damage is counted, nothing raises."""
    chains = _filled(tmp_path, n_chains=6, disk_codec=codec)
    rng = random.Random(3)
    for seg in _segments(tmp_path):
        raw = bytearray(seg.read_bytes())
        for _ in range(3):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        seg.write_bytes(bytes(raw))
    with opened(tmp_path, warm=16, disk_codec=codec) as s:
        served = [fetch_exact(s, ks) for ks in chains]
        assert sum(served) < sum(map(len, chains))  # some flip hit a payload
        assert s.stats().damaged >= 1
        for ks, n in zip(chains, served, strict=True):
            assert s.lookup(ks) == n  # what was found damaged is gone, the rest is held


def test_a_truncated_segment_tail_keeps_the_blocks_before_the_cut(tmp_path):
    chains = _filled(tmp_path, n_chains=2, blocks=8)
    seg = _segments(tmp_path)[0]
    size = seg.stat().st_size
    os.truncate(seg, size - 3 * BN - 5)  # the last 3 blocks, and a bit of the 4th from the end
    with opened(tmp_path, warm=16) as s:
        n = fetch_exact(s, chains[0])
        assert 1 <= n <= 5
        assert fetch_exact(s, chains[1]) == 8


def test_garbage_over_the_index_is_store_corrupt_then_recover_restores_exact_bytes(tmp_path):
    """Random bytes written over the middle of the LMDB index between runs: opening is either
    a StoreCorruptError naming recover, or a store that serves exact bytes; ``kvstore
    recover`` brings every block back, exact."""
    chains = _filled(tmp_path, n_chains=5)
    data = tmp_path / "index" / "data.mdb"
    raw = bytearray(data.read_bytes())
    rng = random.Random(11)
    for off in range(0, len(raw), 4096):  # every page, meta pages included
        for _ in range(8):
            raw[off + rng.randrange(min(4096, len(raw) - off))] = rng.randrange(256)
    data.write_bytes(bytes(raw))

    def first_open():
        try:
            with opened(tmp_path, warm=16) as s:
                return [fetch_exact(s, ks) for ks in chains]
        except StoreCorruptError as e:
            assert "kvstore recover" in str(e)
            return None

    run_bounded(first_open, 60)
    assert cli_main(["recover", "--store", str(tmp_path), "--force"]) in (0, 1)
    with opened(tmp_path, warm=16) as s:
        assert [fetch_exact(s, ks) for ks in chains] == [len(ks) for ks in chains]


# -- a disk that fills up -----------------------------------------------------------------------
def test_enospc_from_the_os_at_random_never_gets_a_lost_block_vouched(tmp_path, monkeypatch):
    """Every few ``os.writev``/``os.fsync`` calls fail with ENOSPC (a disk at the edge of
    full): puts never raise, a flush either returns (then every chain put before it is on
    disk) or raises NotDurableError; once the disk recovers, a flush vouches for what memory
    still holds, and a reopen finds every vouched chain with exact bytes."""
    rng = random.Random(5)
    failing = threading.Event()
    for name in ("writev", "fsync"):
        real = getattr(os, name)

        def flaky(*a, _real=real):
            if failing.is_set() and rng.random() < 0.3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _real(*a)

        monkeypatch.setattr(os, name, flaky)
    vouched: list = []
    refused = 0
    with opened(tmp_path, warm=256) as s:
        since: list = []
        failing.set()
        for i in range(40):
            ks = chain(s, 100 + i, 4)
            s.put(ks, keyed_kv(LAY, ks))
            since.append(ks)
            if i % 4 == 3:
                try:
                    s.flush(timeout=30)
                    vouched += since
                except NotDurableError as e:
                    refused += 1
                    assert e.blocks > 0 and e.reason
                since = []
        assert refused > 0, "the disk never refused: the attack did not attack"
        failing.clear()
        s.flush(timeout=30)  # 256 warm slots hold every block: all of them now
        vouched += since
        for ks in vouched:
            assert fetch_exact(s, ks) == len(ks)
    monkeypatch.undo()
    with opened(tmp_path, warm=16) as s:
        for ks in vouched:
            assert fetch_exact(s, ks) == len(ks)
            s.evict(ks, tier="warm")
        assert s.stats().damaged == 0


def test_a_disk_budget_of_a_few_blocks_trims_but_never_serves_wrong_bytes(tmp_path):
    """``disk_capacity`` of 8 blocks under 40 chains of 4: puts and flushes never raise, the
    disk stays within its budget, and whatever survives is exact."""
    with opened(tmp_path, warm=8, disk=8 * BN) as s:
        chains = [chain(s, 200 + i, 4) for i in range(40)]
        for ks in chains:
            s.put(ks, keyed_kv(LAY, ks))
            s.flush()
        disk = s.stats().tier("disk")
        assert disk.used_bytes <= 8 * BN
    with opened(tmp_path, warm=8, disk=8 * BN) as s:
        held = [fetch_exact(s, ks) for ks in chains]
        assert 0 < sum(held) <= 8
        assert held[-1] == 4  # the newest chain is the last to go


def test_a_capacity_below_one_block_is_a_config_error():
    for kw in ({"cpu_capacity": BN - 1, "gpu_capacity": 0},
               {"cpu_capacity": 4 * BN, "gpu_capacity": BN - 1},
               {"cpu_capacity": "-1MiB", "gpu_capacity": 0},
               {"cpu_capacity": "lots", "gpu_capacity": 0}):
        with pytest.raises(ConfigError):
            open_store(None, layout=LAY, model_id=MODEL, device="cpu", **kw)


# -- processes ----------------------------------------------------------------------------------
_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from conftest import keyed_kv
from kvstore import KVLayout, open_store
LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
path, base, mode = sys.argv[2], int(sys.argv[3]), sys.argv[4]
s = open_store(path, layout=LAY, model_id="attacks/round3", device="cpu", gpu_capacity=0,
               cpu_capacity=32 * LAY.block_nbytes)
def chain(i):
    return s.block_keys([i * 100_000 + t for t in range(6 * 4)])
i = base
while True:
    ks = chain(i)
    s.put(ks, keyed_kv(LAY, ks))
    if mode == "mixed" and i % 2:
        other = chain(base - 1000 + i % 50) if base >= 1000 else chain(1000 + i % 50)
        got = s.fetch(other).wait(20)
        if not torch.equal(got.view(torch.uint8), keyed_kv(LAY, other[:got.shape[0]]).view(torch.uint8)):
            print("WRONG", i, flush=True)
        s.evict(other[3:], tier="disk")
    if i % 3 == 2:
        s.flush()
        sys.stdout.write(f"flushed {i}\n")
        sys.stdout.flush()
    i += 1
    if mode == "mixed" and i >= base + 60:
        s.close()
        print("done", flush=True)
        break
"""


def _child(path, base: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(TESTS), str(path), str(base), mode],
                            stdout=subprocess.PIPE, text=True, cwd=REPO)


@pytest.mark.slow
def test_sigkill_at_random_moments_of_put_and_flush_loses_nothing_vouched(tmp_path):
    """A writer process killed -9 at a random moment (mid-put, mid-flush, mid-commit), four
    times over: each reopen serves every chain a flush had vouched for, and every block any
    chain returns (vouched or not) is exact."""
    rng = random.Random(9)
    vouched: set[int] = set()
    base = 0
    for _ in range(4):
        p = _child(tmp_path, base, "kill")
        first = p.stdout.readline()
        assert first.startswith("flushed"), first
        time.sleep(rng.uniform(0.0, 0.4))
        p.send_signal(signal.SIGKILL)
        out = first + p.stdout.read()
        p.wait(30)
        flushed = vouched_chains(out.splitlines())
        vouched |= set(range(base, max(flushed) + 1))
        tried = range(base, max(flushed) + 6)
        with opened(tmp_path, warm=16) as s:
            for i in sorted(vouched | set(tried)):
                ks = s.block_keys([i * 100_000 + t for t in range(6 * T)])
                n = fetch_exact(s, ks)
                assert i not in vouched or n == 6, f"chain {i} was flushed, then lost"
                s.evict(ks, tier="warm")
            assert s.stats().damaged == 0
        base = max(flushed) + 100


@pytest.mark.slow
def test_two_processes_write_read_and_evict_one_store_at_once(tmp_path):
    """Two engines on one store path, each putting its own chains, fetching the other's and
    evicting parts of them from disk: neither ever gets wrong bytes or crashes, and a
    third open afterwards serves exact bytes."""
    with opened(tmp_path) as s:  # both start from a store with chains 1000..1049 on disk
        for i in range(1000, 1050):
            ks = s.block_keys([i * 100_000 + t for t in range(6 * T)])
            s.put(ks, keyed_kv(LAY, ks))
    a, b = _child(tmp_path, 0, "mixed"), _child(tmp_path, 2000, "mixed")
    outs = [p.communicate(timeout=120)[0] for p in (a, b)]
    assert [p.returncode for p in (a, b)] == [0, 0], outs
    assert all("done" in o and "WRONG" not in o for o in outs), outs
    with opened(tmp_path, warm=16) as s:
        for i in [*range(0, 60), *range(1000, 1050), *range(2000, 2060)]:
            ks = s.block_keys([i * 100_000 + t for t in range(6 * T)])
            fetch_exact(s, ks)
            s.evict(ks, tier="warm")
        assert s.stats().damaged == 0


# -- the daemon and its clients -----------------------------------------------------------------
def _raw(sock_path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock_path))
    return s


def _raw_call(s: socket.socket, op: str, rid: int, args) -> list | None:
    from kvstore.wire.codec import CodecLimits, pack, unpack
    from kvstore.wire.framing import encode_frame, recv_frame

    s.sendall(encode_frame(pack([op, rid, args])))
    body = recv_frame(s, 1 << 20)
    return None if body is None else unpack(body, CodecLimits.for_frames(1 << 20, 1 << 16))


_HELLO_MUTATIONS = {
    "dtype unknown": (3, "nonsense"), "dtype int": (3, 5), "dtype bool": (3, "bool"),
    "three kv planes": (4, [2, 3, 4, 2, 8]), "zero layers": (4, [0, 2, 4, 2, 8]),
    "huge block": (4, [1 << 20, 2, 1 << 20, 1 << 20, 1 << 20]), "shape of str": (4, ["a"] * 5),
    "shape too short": (4, [2, 2]), "tp rank >= size": (5, [3, 2]), "tp negative": (5, [-1, 2]),
    "warm negative": (8, -100), "warm one byte": (8, 1), "warm float": (8, 1.5),
    "salt policy unknown": (7, "weird"), "model empty": (1, ""), "model bytes": (1, b"abc"),
    "model 100k chars": (1, "x" * 100_000), "extras nested": (6, {"a": [1]}),
    "extras bytes key": (6, {b"a": 1}), "extras NaN": (6, {"a": float("nan")}),
    "revision None": (2, None), "client huge": (9, "c" * 10_000), "args a map": (None, {"a": 1}),
    "args too short": (None, [1, "m"]),
}


def test_hostile_hellos_are_refused_with_codes_and_the_daemon_serves_on(serve):
    """Hellos with every field wrong (types, ranges, sizes, a block of petabytes): each gets
    an error reply with a code other than INTERNAL, and a good client is served throughout."""
    from kvstore.wire import messages as m
    from kvstore.wire import protocol
    from kvstore.wire.errors import ErrorCode

    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "16MiB")
    with connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as c:
        keys = chain(c, 300, 4)
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 4
        base = protocol.make_hello(LAY, MODEL + "/hello").to_wire()  # never opened
        for name, (i, v) in _HELLO_MUTATIONS.items():
            args = v if i is None else [*base[:i], v, *base[i + 1:]]
            with _raw(d.socket_path) as s:
                r = _raw_call(s, "hello", 1, args)
            assert r is not None and r[1] == m.ERROR, (name, r)
            assert r[2][0] != ErrorCode.INTERNAL, (name, r)
            assert fetch_exact(c, keys) == 4, name
        assert c.server_stats().namespaces == 1  # none of them opened a namespace
    assert "Traceback" not in d.log()


def test_a_connection_flood_and_half_frames_do_not_starve_a_client(serve):
    """Three times --max-connections, the accepted ones holding half a frame or announcing a
    1 GiB frame: the flood beyond the limit is refused (LIMIT), the connected client keeps
    getting exact bytes at once, and once the flood is gone new clients connect."""
    from kvstore.wire.codec import CodecLimits, unpack
    from kvstore.wire.errors import ErrorCode
    from kvstore.wire.framing import recv_frame

    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "0", "--max-connections", "8")
    with connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as c:
        keys = chain(c, 301, 4)
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 4
        flood = [_raw(d.socket_path) for _ in range(24)]
        try:
            refused, accepted = 0, []
            for s in flood:
                s.settimeout(0.3)
                try:
                    body = recv_frame(s, 1 << 20)
                except (TimeoutError, OSError):
                    accepted.append(s)  # no refusal: the daemon waits for its hello
                    continue
                assert body is not None, "closed without a word"
                reply = unpack(body, CodecLimits.for_frames(1 << 20, 16))
                assert reply[2][0] == ErrorCode.LIMIT, reply
                refused += 1
            assert refused >= 24 - 8 and accepted
            for i, s in enumerate(accepted):
                s.sendall(struct.pack(">I", 1000) + b"\x93" * 10 if i % 2 else struct.pack(">I", 1 << 30))
            t0 = time.monotonic()
            for _ in range(20):
                assert fetch_exact(c, keys) == 4
                assert c.lookup(keys) == 4
            assert time.monotonic() - t0 < 5
        finally:
            for s in flood:
                s.close()

        def reconnect():
            while True:  # the flood's slots free as the daemon sees them close
                with connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu",
                             timeout=10) as c2:
                    if c2.ping():
                        return fetch_exact(c2, keys)
                time.sleep(0.1)

        assert run_bounded(reconnect, 20) == 4
        assert c.ping()
    assert "Traceback" not in d.log()


def test_a_frozen_daemon_bounds_every_client_call(serve):
    """The daemon stopped (SIGSTOP: alive, accepting, never answering): lookup, fetch, put and
    a flush with a timeout all return within a bound as misses, the flush raising
    PutsLostError for the committed puts it cannot confirm; once the daemon runs again the
    client reconnects and every block is exact."""
    from kvstore.errors import PutsLostError

    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "16MiB")
    c = connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=1)
    try:
        keys, more = chain(c, 302, 4), chain(c, 303, 4)
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 4
        d.signal(signal.SIGSTOP)
        try:
            with pytest.raises(PutsLostError) as ei:
                run_bounded(lambda: c.flush(timeout=1), 15)
            assert ei.value.blocks == 4
            assert run_bounded(lambda: c.lookup(keys), 10) == 0
            assert run_bounded(lambda: c.fetch(keys).wait(10), 10).shape[0] == 0
            assert run_bounded(lambda: c.put(more, keyed_kv(LAY, more)).wait(10), 10) == 0
        finally:
            d.signal(signal.SIGCONT)
        deadline = time.monotonic() + 20
        while not c.ping():
            assert time.monotonic() < deadline, "the client never reconnected"
            time.sleep(0.1)
        assert fetch_exact(c, keys) == 4
        c.flush(timeout=10)  # the same daemon instance: nothing was lost
    finally:
        run_bounded(c.close, 30)


@pytest.mark.slow
def test_client_threads_across_a_daemon_kill_and_restart(serve, tmp_path):
    """Four threads share one client while the daemon is killed -9 and started again: every
    fetch is exact (or a miss), no call raises, close returns, and the restarted daemon
    serves exact bytes from disk."""
    args = ("--cpu-capacity", "16KiB", "--disk-capacity", "16MiB")
    d = serve(*args)
    c = connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=2)
    chains = [chain(c, 310 + i) for i in range(8)]
    for ks in chains:
        c.put(ks, keyed_kv(LAY, ks)).wait()
    c.flush()
    stop = threading.Event()
    wrong: list[int] = []
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            ks = rng.choice(chains)
            try:
                r = rng.random()
                if r < 0.45:
                    got = c.fetch(ks).wait(20)
                    if not bit_equal(got, keyed_kv(LAY, ks[:got.shape[0]])):
                        wrong.append(got.shape[0])
                elif r < 0.75:
                    c.put(ks, keyed_kv(LAY, ks)).wait(20)
                elif r < 0.85:
                    c.evict(ks[4:], tier="warm")
                else:
                    c.lookup(ks)
            except StoreClosedError:
                return
            except BaseException as e:  # reported below
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    d.signal(signal.SIGKILL)
    d.wait()
    time.sleep(0.5)
    d2 = serve(*args)
    time.sleep(1.5)
    stop_all(threads, stop, "a client thread hung")
    run_bounded(c.close, 30)
    assert not errors, errors
    assert not wrong, wrong
    with connect(d2.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as c2:
        for ks in chains:  # flushed before the kill: on disk
            assert fetch_exact(c2, ks) == len(ks)


# -- the zero-copy API misused ------------------------------------------------------------------
def _fill_grant(s, grant, keys) -> None:
    rows = keyed_kv(LAY, keys).reshape(len(keys), -1).view(torch.uint8)
    for p, slot in zip(grant.positions, grant.slots, strict=True):
        s.warm_slab[slot].copy_(rows[p])


@pytest.mark.parametrize("misuse", ["abort_after_commit", "abort_twice", "commit_after_abort",
                                    "commit_twice", "another_stores_grant"])
def test_a_grant_is_used_once_and_only_by_its_store(misuse):
    """``grant_put``/``commit_put``/``abort_put`` (the public ZeroCopy API) called out of
    order: a grant aborted after its commit (or twice) gave its slots back while they held
    live blocks, and a grant committed after its abort (or by another store) mapped keys onto
    slots other blocks had taken: the next put's bytes were then served under the first
    keys. Now a grant counts once, in its own store; the rest is a no-op (commit: 0)."""
    with opened(None, warm=8) as s, opened(None, warm=8, model="attacks/other") as o:
        a = chain(s, 400, 4)
        g = s.grant_put(a)
        assert len(g.slots) == 4
        _fill_grant(s, g, a)
        if misuse == "abort_after_commit":
            assert s.commit_put(g) == 4
            s.abort_put(g)
        elif misuse == "abort_twice":
            s.abort_put(g)
            s.abort_put(g)
            assert s.put(a, keyed_kv(LAY, a)).wait() == 4
        elif misuse == "commit_after_abort":
            s.abort_put(g)
        elif misuse == "commit_twice":
            assert s.commit_put(g) == 4
            assert s.commit_put(g) == 0
        else:
            theirs = chain(o, 401, 4)
            go = o.grant_put(theirs)
            assert s.commit_put(go) == 0  # not s's: nothing of it becomes visible in s
            s.abort_put(go)  # nor does it free s's slots
            assert s.lookup([bytes(k) for k in theirs]) == 0
            assert o.commit_put(go) == 4
            assert s.commit_put(g) == 4
        b = chain(s, 402, 4)
        assert s.put(b, keyed_kv(LAY, b)).wait() == 4  # takes any slot given back
        if misuse == "commit_after_abort":
            assert s.commit_put(g) == 0
            assert s.lookup(a) == 0
        else:
            assert fetch_exact(s, a) == 4
        assert fetch_exact(s, b) == 4
        for junk in (None, "grant", object()):
            assert s.commit_put(junk) == 0
            s.abort_put(junk)
        assert s.stats().pinned_blocks == 0


def test_borrowed_and_pinned_blocks_survive_evict_and_churn():
    """A borrowed run (a view of the slab) and pins released too often: evict() and a tier's
    worth of other puts never move or overwrite the borrowed blocks until release."""
    with opened(None, warm=8) as s:
        keys = chain(s, 410, 4)
        s.put(keys, keyed_kv(LAY, keys)).wait()
        with s.borrow_blocks(keys) as b:
            assert len(b) == 4
            r = s.pin(keys)
            r.release()
            r.release()  # a receipt unpins once
            with s.pin(keys):
                pass
            assert s.evict() == 0 and s.evict(keys) == 0
            for i in range(6):
                other = chain(s, 411 + i, 4)
                s.put(other, keyed_kv(LAY, other)).wait()
                s.evict(other)
            assert bit_equal(b.blocks, keyed_kv(LAY, keys))
        b.release()  # idempotent
        assert s.stats().pinned_blocks == 0
        assert s.evict(keys) == 4


@pytest.mark.parametrize("bad", ["float ids", "str ids", "None ids", "huge ids", "empty layer"])
def test_paged_calls_refuse_block_ids_that_are_not_page_numbers(bad):
    with opened(None) as s:
        keys = chain(s, 420, 4)
        s.put(keys, keyed_kv(LAY, keys)).wait()
        pages = [torch.zeros(2, 8, T, 2, 8, dtype=LAY.dtype) for _ in range(LAY.num_layers)]
        ids: object = [0, 1, 2, 3]
        if bad == "float ids":
            ids = [0.7, 1.2, 2.9, 3.1]
        elif bad == "str ids":
            ids = "0123"
        elif bad == "None ids":
            ids = None
        elif bad == "huge ids":
            ids = [2**70] * 4
        else:
            pages = [() for _ in pages]
        with pytest.raises(TensorMismatchError):
            s.load_into(keys, pages, ids).wait()
        with pytest.raises(TensorMismatchError):
            s.save_from(pages, ids, chain(s, 421, 4)).wait()
        assert all(torch.count_nonzero(p) == 0 for p in pages if isinstance(p, torch.Tensor))


@pytest.mark.parametrize("bad", ["short", "long", "read-only", "float32", "strided", "none",
                                 "meta"])
def test_lease_into_bad_destinations_raise_and_count_no_damage(tmp_path, bad):
    """``lease_into`` with destinations that cannot take a block: a TensorMismatchError for
    the caller, not a silent miss counted as disk damage (operators alert on ``damaged``);
    nothing stays pinned and the blocks are still served."""
    keys = _filled(tmp_path, n_chains=1)[0]
    with opened(tmp_path, warm=16) as s:
        def into(i):
            return {
                "short": lambda: [torch.empty(BN - 1, dtype=torch.uint8)],
                "long": lambda: [torch.empty(BN + 64, dtype=torch.uint8)],
                "read-only": lambda: [memoryview(bytes(BN))],
                "float32": lambda: [torch.empty(BN // 4, dtype=torch.float32)],
                "strided": lambda: [torch.empty(2 * BN, dtype=torch.uint8)[::2]],
                "none": lambda: None,
                "meta": lambda: [torch.empty(BN, dtype=torch.uint8, device="meta")],
            }[bad]()

        with pytest.raises(TensorMismatchError):
            s.lease_into(keys, into, fill=False)
        st = s.stats()
        assert st.damaged == 0 and st.pinned_blocks == 0
        bufs = [torch.empty(BN, dtype=torch.uint8) for _ in keys]
        lease = s.lease_into(keys, lambda i: [bufs[i]], fill=False)
        assert lease.n == len(keys) and not lease.pinned
        want = keyed_kv(LAY, keys).reshape(len(keys), -1).view(torch.uint8)
        assert all(torch.equal(b, w) for b, w in zip(bufs, want, strict=True))


def test_segments_and_index_directories_removed_under_an_open_store(tmp_path):
    """``rm -rf segments/`` under an open store: its blocks become counted misses, puts stay
    in memory and flush says NotDurableError. ``rm -rf index/`` under an open store: the
    next open is a StoreCorruptError naming recover, and recover brings back every segment
    written since."""
    import shutil

    s = opened(tmp_path, warm=16)
    try:
        lost = chain(s, 500)
        s.put(lost, keyed_kv(LAY, lost)).wait()
        s.flush()
        shutil.rmtree(tmp_path / "segments")
        s.evict(tier="warm")
        assert fetch_exact(s, lost) == 0 and s.stats().damaged > 0
        mem = chain(s, 501)
        assert s.put(mem, keyed_kv(LAY, mem)).wait() == len(mem)
        with pytest.raises(NotDurableError):
            s.flush()
        assert fetch_exact(s, mem) == len(mem)
    finally:
        run_bounded(s.close, 30)  # logs the blocks it could not write, never raises
    with opened(tmp_path, warm=16) as s:
        kept = chain(s, 502)
        s.put(kept, keyed_kv(LAY, kept)).wait()
        s.flush()
        shutil.rmtree(tmp_path / "index")
        later = chain(s, 503)
        s.put(later, keyed_kv(LAY, later)).wait()
        s.flush()
    with pytest.raises(StoreCorruptError, match="kvstore recover"):
        opened(tmp_path)
    assert cli_main(["recover", "--store", str(tmp_path)]) == 0
    with opened(tmp_path, warm=16) as s:
        assert fetch_exact(s, kept) == len(kept) and fetch_exact(s, later) == len(later)
        assert fetch_exact(s, lost) == 0 and fetch_exact(s, mem) == 0


def test_clients_of_other_layouts_under_one_model_id_never_share_blocks(serve):
    """Two layouts with the same block size and model id (heads x head_dim swapped): each
    client gets its own namespace, the other's raw keys miss, and each gets its own bytes."""
    other = KVLayout(num_layers=2, num_kv_heads=4, head_dim=4, dtype=torch.bfloat16,
                     block_tokens=4)
    assert other.block_nbytes == BN
    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "16MiB")
    with connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as a, \
            connect(d.socket_path, layout=other, model_id=MODEL, device="cpu", timeout=10) as b:
        assert a.namespace_id != b.namespace_id
        ka = chain(a, 510, 4)
        assert a.put(ka, keyed_kv(LAY, ka)).wait() == 4
        raw = [bytes(k) for k in ka]
        assert b.lookup(raw) == 0 and b.fetch(raw).wait().shape[0] == 0
        junk = torch.zeros(other.batch_shape(4), dtype=other.dtype)
        assert b.put(raw, junk).wait() == 4  # b's own blocks under the same bytes of key
        a.evict(ka, tier="warm")
        a.flush()
        b.flush()
        assert fetch_exact(a, ka) == 4
        assert bit_equal(b.fetch(raw).wait(), junk)


def test_load_into_with_a_damaged_block_mid_chain_writes_only_the_loaded_pages(tmp_path):
    """A chain on disk whose second block's payload is flipped: load_into loads the first
    block exactly, counts the damage, and never writes the pages of the damaged block or of
    any block after it (the engine recomputes those)."""
    keys = _filled(tmp_path, n_chains=1, blocks=4)[0]
    want = keyed_kv(LAY, keys)
    second = bytes(want[1].contiguous().view(torch.uint8).reshape(-1).numpy())
    for seg in _segments(tmp_path):
        raw = bytearray(seg.read_bytes())
        off = bytes(raw).find(second)
        if off >= 0:
            raw[off + 10] ^= 0xFF
            seg.write_bytes(bytes(raw))
    with opened(tmp_path, warm=16) as s:
        pages = [torch.full((2, 8, T, 2, 8), 7.0, dtype=LAY.dtype) for _ in range(LAY.num_layers)]
        ids = [5, 0, 7, 2]  # out of order on purpose
        assert s.load_into(keys, pages, ids).wait(20) == 1
        for layer, p in enumerate(pages):
            assert bit_equal(p[:, 5], want[0, layer])
            for untouched in (0, 7, 2, 1, 3, 4, 6):
                assert bool((p[:, untouched] == 7.0).all()), (layer, untouched)
        assert s.stats().damaged == 1


# -- admin commands next to a running engine ----------------------------------------------------
def test_import_and_verify_fix_next_to_an_engine_reading_the_store(tmp_path):
    """An engine has the store open and keeps fetching while (1) ``kvstore import`` publishes
    a pack of other chains into it and (2) ``kvstore verify --fix -y`` repairs a segment whose
    header was garbled (rewriting its intact blocks elsewhere): every fetch is exact, the
    imported chains are hits at the engine's next lookup, the repaired blocks stay hits."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    imported = _filled(src, n_chains=3)
    pack = tmp_path / "p.kvpack"
    assert cli_main(["export", "--store", str(src), "--namespace", MODEL, "-o", str(pack)]) == 0
    own = _filled(dst, n_chains=3)
    seg = _segments(dst)[0]
    raw = bytearray(seg.read_bytes())
    raw[8:16] = b"\x00garbled"  # the JSON header's first bytes: the payloads stay whole
    seg.write_bytes(bytes(raw))
    assert cli_main(["verify", "--store", str(dst)]) == 1  # bad_header found
    stop = threading.Event()
    wrong: list[str] = []

    with opened(dst, warm=8) as s:
        def reader():
            while not stop.is_set():
                for ks in own + imported:
                    got = s.fetch(ks).wait(20)
                    if not bit_equal(got, keyed_kv(LAY, ks[:got.shape[0]])):
                        wrong.append("wrong")
                    s.evict(ks, tier="warm")

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        try:
            assert cli_main(["import", str(pack), "--store", str(dst), "--model", MODEL,
                             "--layout", "bfloat16 L2 P2 T4 H2 D8"]) == 0
            assert cli_main(["verify", "--store", str(dst), "--fix", "-y", "--grace", "0"]) in (0, 1)
        finally:
            stop.set()
            t.join(60)
        assert not t.is_alive() and not wrong
        for ks in own + imported:
            assert fetch_exact(s, ks) == len(ks)
    assert cli_main(["verify", "--store", str(dst)]) == 0


def test_a_daemon_starting_in_another_pid_namespace_leaves_a_live_daemons_memory(
        serve, tmp_path, monkeypatch):
    """Two daemons (two stores) sharing one shared-memory directory from two pid namespaces
    (two containers of a pod sharing /dev/shm): to the second, the first one's pid looks
    dead. Its start-up clean-up removed the first daemon's live shared-memory directory, so
    the first could open no namespace any more and its new clients failed with 'no kvstore
    daemon answers'. Now a daemon holds a lock on its directory, and only an unlocked one of
    a dead pid is removed."""
    from kvstore.daemon import security

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    a = serve("--cpu-capacity", "1MiB", "--disk-capacity", "0", "--shm-dir", str(shm),
              path=tmp_path / "a", socket=tmp_path / "runa" / "k.sock")
    with connect(a.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as c:
        keys = chain(c, 520, 4)
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 4
    dead = shm / f"{security.SHM_PREFIX}999999-gone"  # a daemon that died for real
    dead.mkdir()
    monkeypatch.setattr(security, "_pid_alive", lambda pid: False)  # as seen from elsewhere
    removed = security.remove_stale_shm(shm)
    assert removed == [dead]
    assert [p.name for p in shm.iterdir()] and all(p.is_dir() for p in shm.iterdir())
    with connect(a.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=10) as c:
        assert fetch_exact(c, keys) == 4  # maps the slab afresh: still there
    with connect(a.socket_path, layout=LAY, model_id=MODEL + "/2", device="cpu", timeout=10) as c:
        k2 = chain(c, 521, 4)  # a new namespace: a new slab in the same directory
        assert c.put(k2, keyed_kv(LAY, k2)).wait() == 4


def test_a_store_path_that_is_a_file_is_refused_and_left_alone(tmp_path):
    """``open_store`` on a regular file (or a path under one, or a device): a ConfigError
    naming it. Before, the file's mode was tightened to 0600 (the store's file-mode walk)
    and the error was a DiskError 'File exists' or a bare NotADirectoryError."""
    f = tmp_path / "notes.txt"
    f.write_text("not a store")
    f.chmod(0o644)
    for p in (f, f / "sub" / "store", Path("/dev/null")):
        with pytest.raises(ConfigError, match="not a directory"):
            opened(p)
    assert f.stat().st_mode & 0o777 == 0o644 and f.read_text() == "not a store"
    assert not (tmp_path / "segments").exists()


@pytest.mark.parametrize("call", ["evict", "prefetch"])
def test_evict_and_prefetch_against_a_frozen_daemon_return_within_a_bound(serve, call):
    d = serve("--cpu-capacity", "1MiB", "--disk-capacity", "16MiB")
    c = connect(d.socket_path, layout=LAY, model_id=MODEL, device="cpu", timeout=1)
    try:
        keys = chain(c, 530, 4)
        assert c.put(keys, keyed_kv(LAY, keys)).wait() == 4
        d.signal(signal.SIGSTOP)
        try:
            fn = (lambda: c.evict(keys)) if call == "evict" else (lambda: c.prefetch(keys).wait(5))
            run_bounded(fn, 5)  # 5x the client's timeout
        finally:
            d.signal(signal.SIGCONT)
    finally:
        run_bounded(c.close, 60)
