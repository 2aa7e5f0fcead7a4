"""Issue 13 (A): damage to the LMDB index never crashes the process and never yields wrong KV.

A store with a few chains is written through ``open_store``; then its ``index/data.mdb`` is
damaged — truncated (50 %, 10 %, one page, random lengths), pages zeroed, over a thousand
random bit flips, two block records' locations swapped — and each damaged copy is probed in a
forked child (so that a SIGBUS or SIGABRT fails the test instead of killing pytest): open the
store, ``lookup`` + ``fetch`` every chain, close, then ``kvstore verify --store S``. Every
child must exit normally; every fetched block must hold exactly its key's bytes; the only
errors allowed are :class:`StoreCorruptError` (naming ``kvstore recover``) and misses.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import struct
import time
from pathlib import Path

import lmdb
import pytest
import torch
from conftest import bit_equal, keyed_kv

from kvstore import FormatVersionError, KVLayout, StoreCorruptError, open_store
from kvstore.tiers.disk import guard
from kvstore.tiers.disk import index as di

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
BN = LAY.block_nbytes
N_CHAINS, N_BLOCKS = 4, 6
#: random bit-flip mutations (the whole file adds truncations, zeroed pages, swaps)
FLIPS = int(os.environ.get("KVSTORE_DAMAGE_FLIPS", "1000"))
SEED = int(os.environ.get("KVSTORE_DAMAGE_SEED", "1313"))
PARALLEL = 2


def opened(path):
    return open_store(path, layout=LAY, model_id="damage/test", device="cpu", gpu_capacity=0,
                      cpu_capacity=64 * BN, disk_capacity="64MiB")


def chains(s):
    return [s.block_keys([c * 1000 + t for t in range(N_BLOCKS * LAY.block_tokens)])
            for c in range(N_CHAINS)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A closed store: 4 chains of 6 blocks, each chain put and flushed on its own (several
    segments and transactions), one chain deleted and put again (free pages in the file)."""
    root = tmp_path_factory.mktemp("damage")
    base = root / "base"
    with opened(base) as s:
        for ks in chains(s):
            assert s.put(ks, keyed_kv(LAY, ks)).wait() == N_BLOCKS
            s.flush()
        s.lookup(chains(s)[0])  # touches: access-time updates at close
    data = (base / "index" / "data.mdb").read_bytes()
    assert guard.check_index(str(base / "index")).ok
    return root, base, data


# -- the probe (runs in a forked child) ------------------------------------------------------

_PARSER = None


def _probe(path: str) -> dict:
    """Open, lookup + fetch every chain, close, ``kvstore verify``; what happened."""
    out = {"open": "ok", "ok": 0, "miss": 0, "corrupt": 0, "wrong": 0, "errors": []}
    try:
        s = opened(path)
    except StoreCorruptError as e:
        out["open"] = "corrupt"
        out["msg_ok"] = "kvstore recover --store" in str(e)
        s = None
    except FormatVersionError as e:  # a flip in the version record that names a (plausible)
        out["open"] = "format"      # other release: refused as such, also a clean refusal
        out["format"] = str(e)[:200]
        s = None
    if s is not None:
        try:
            for ks in chains(s):
                try:
                    n = s.lookup(ks)
                    got = s.fetch(ks).wait()
                except StoreCorruptError as e:
                    out["corrupt"] += 1
                    out.setdefault("msg_ok", "kvstore recover --store" in str(e))
                    continue
                m = got.shape[0]
                out["lookup_gt_fetch"] = out.get("lookup_gt_fetch", 0) + (n > m)
                if not bit_equal(got, keyed_kv(LAY, ks[:m])):
                    out["wrong"] += 1
                out["ok"] += m
                out["miss"] += len(ks) - m
        except Exception as e:  # reported, the test fails on it
            out["errors"].append(f"{type(e).__name__}: {e}"[:300])
        finally:
            try:
                s.close()
            except StoreCorruptError:
                out["corrupt"] += 1
            except Exception as e:
                out["errors"].append(f"close: {type(e).__name__}: {e}"[:300])
    args = _PARSER.parse_args(["verify", "--store", path])
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = args.func(args)
    except Exception as e:
        out["errors"].append(f"verify: {type(e).__name__}: {e}"[:300])
        rc = -1
    out["verify"] = rc
    if rc == 2:
        msg = err.getvalue()
        out["verify_msg_ok"] = "kvstore recover --store" in msg or (
            out["open"] == "format" and "format version" in msg)
        out["verify_msg"] = err.getvalue()[-300:]
    return out


def _child(root: Path, base: Path, batch: list[tuple[int, str, bytes]], wfd: int) -> None:
    """Probe a batch of mutations, one JSON line each (written before the next starts, so
    the parent knows which one a signal interrupted)."""
    import gc

    gc.disable()
    torch.set_num_threads(1)
    for i, _what, data in batch:
        path = root / f"m{i}"  # a path of its own: nothing carries over between mutations
        try:
            _prepare(path, base, data)
            res = _probe(str(path))
        except BaseException as e:  # anything escaping is a failure
            res = {"errors": [f"escaped: {type(e).__name__}: {e}"[:300]]}
        res["i"] = i
        os.write(wfd, json.dumps(res).encode() + b"\n")
        shutil.rmtree(path, ignore_errors=True)
    os.close(wfd)
    os._exit(0)


def _prepare(slot: Path, base: Path, data: bytes) -> None:
    shutil.rmtree(slot, ignore_errors=True)
    (slot / "index").mkdir(parents=True)
    (slot / "segments").mkdir()
    for f in (base / "segments").iterdir():
        os.link(f, slot / "segments" / f.name)  # segments are only read (and never rewritten)
    (slot / "index" / "data.mdb").write_bytes(data)


BATCH = 25


def run_mutations(root: Path, base: Path, mutations: list[tuple[str, bytes]]) -> list[dict]:
    """Probe every ``(description, data.mdb bytes)`` in forked children (``BATCH`` mutations
    per child, ``PARALLEL`` children at a time). A mutation whose child was killed by a
    signal is reported as ``{"signal": n}``; the rest of its batch goes to a new child."""
    import gc

    global _PARSER
    from kvstore.cli import build_parser

    _PARSER = build_parser()
    warm = root / "warm"  # imports and lazy set-up before forking, on an undamaged copy
    _prepare(warm, base, (base / "index" / "data.mdb").read_bytes())
    assert _probe(str(warm))["ok"] == N_CHAINS * N_BLOCKS
    work = root / "work"
    work.mkdir(exist_ok=True)
    results: list[dict] = [{} for _ in mutations]
    numbered = [(i, w, d) for i, (w, d) in enumerate(mutations)]
    queue = [numbered[j:j + BATCH] for j in range(0, len(numbered), BATCH)]
    running: dict[int, tuple[list[tuple[int, str, bytes]], int]] = {}
    gc.collect()
    gc.freeze()  # children do not copy-on-write the parent's objects through the collector
    try:
        while queue or running:
            while queue and len(running) < PARALLEL:
                batch = queue.pop()
                rfd, wfd = os.pipe()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child
                    os.close(rfd)
                    _child(work, base, batch, wfd)
                os.close(wfd)
                running[pid] = (batch, rfd)
            pid, status = os.waitpid(-1, 0)
            if pid not in running:
                continue
            batch, rfd = running.pop(pid)
            chunks = []
            while b := os.read(rfd, 1 << 16):
                chunks.append(b)
            os.close(rfd)
            done = set()
            for line in b"".join(chunks).splitlines():
                r = json.loads(line)
                results[r["i"]] = r
                done.add(r["i"])
            left = [m for m in batch if m[0] not in done]
            if left:
                i = left[0][0]
                if os.WIFSIGNALED(status):
                    results[i] = {"signal": os.WTERMSIG(status)}
                else:
                    results[i] = {"errors": [f"child exit status {os.WEXITSTATUS(status)}"]}
                if left[1:]:
                    queue.append(left[1:])
    finally:
        gc.unfreeze()
    for i, (what, _d) in enumerate(mutations):
        results[i]["what"] = what
    return results


def _assert_sound(results: list[dict]) -> dict[str, int]:
    """No signal, no escaped exception, no wrong byte; corruption messages name recover."""
    kinds: dict[str, int] = {}
    bad = []
    for r in results:
        if "signal" in r:
            bad.append(f"{r['what']}: killed by {signal.Signals(r['signal']).name}")
            continue
        if r.get("errors"):
            bad.append(f"{r['what']}: {r['errors']}")
        if r.get("wrong"):
            bad.append(f"{r['what']}: {r['wrong']} chain(s) fetched wrong bytes")
        if r.get("msg_ok") is False or r.get("verify_msg_ok") is False:
            bad.append(f"{r['what']}: error does not name kvstore recover: "
                       f"{r.get('verify_msg', '')}")
        if r.get("verify") not in (0, 1, 2):
            bad.append(f"{r['what']}: verify exit status {r.get('verify')}")
        if r.get("open") in ("corrupt", "format"):
            k = "refused at open"
        elif r.get("corrupt"):
            k = "refused later"
        elif r.get("miss"):
            k = "opened, some misses"
        else:
            k = "opened, all blocks"
        kinds[k] = kinds.get(k, 0) + 1
    assert not bad, "\n".join(bad[:20]) + f"\n({len(bad)} failures)"
    return kinds


def _pages(data: bytes, psize: int = 4096) -> int:
    return len(data) // psize


# -- the tests -------------------------------------------------------------------------------

def test_truncated_and_zeroed_index(pristine):
    root, base, data = pristine
    ps = 4096
    n = _pages(data)
    muts = [("truncate 50%", data[: len(data) // 2]), ("truncate 10%", data[: len(data) // 10]),
            ("truncate to one page", data[:ps]), ("truncate to one page less", data[:-ps]),
            ("truncate to 100 bytes", data[:100])]
    rnd = random.Random(13)
    for _ in range(12):
        cut = rnd.randrange(1, len(data))
        muts.append((f"truncate at {cut}", data[:cut]))
    for pg in range(n):
        muts.append((f"zero page {pg}", data[: pg * ps] + bytes(ps) + data[(pg + 1) * ps:]))
    for _ in range(10):
        a = rnd.randrange(n)
        b = min(n, a + rnd.randint(2, 6))
        muts.append((f"zero pages {a}..{b - 1}", data[: a * ps] + bytes((b - a) * ps) + data[b * ps:]))
    t0 = time.perf_counter()
    results = run_mutations(root, base, muts)
    kinds = _assert_sound(results)
    print(f"\n{len(muts)} truncations / zeroed pages in {time.perf_counter() - t0:.1f} s: {kinds}")
    # every truncation is caught before LMDB maps the file (it was a SIGBUS)
    for r in results:
        if r["what"].startswith("truncate"):
            assert r["open"] == "corrupt" and r["verify"] == 2, r


def _flip_targets(data: bytes, psize: int = 4096) -> list[int]:
    """Byte offsets where LMDB keeps structure or data: page headers, node pointers and the
    node area of every page (flips in a page's free gap are harmless and rarer here)."""
    out = []
    for pg in range(len(data) // psize):
        base = pg * psize
        _pgno, _pad, flags, lower, upper = struct.unpack_from("<QHHHH", data, base)
        if pg < 2 or flags & 0x04:  # meta pages, overflow: everything counts
            out.extend(range(base, base + (200 if pg < 2 else psize)))
            continue
        if not 16 <= lower <= upper <= psize:
            continue
        out.extend(range(base, base + lower))
        out.extend(range(base + upper, base + psize))
    return out


def test_random_bit_flips(pristine):
    root, base, data = pristine
    rnd = random.Random(SEED)
    targets = _flip_targets(data)
    muts = []
    for i in range(FLIPS):
        b = bytearray(data)
        nflip = rnd.choice((1, 1, 1, 2, 3, 8))
        where = []
        for _ in range(nflip):
            pos = rnd.choice(targets) if i % 4 else rnd.randrange(len(b))
            bit = rnd.randrange(8)
            b[pos] ^= 1 << bit
            where.append(f"{pos}:{bit}")
        muts.append((f"flip {' '.join(where)}", bytes(b)))
    t0 = time.perf_counter()
    results = run_mutations(root, base, muts)
    kinds = _assert_sound(results)
    dt = time.perf_counter() - t0
    print(f"\n{len(muts)} bit-flip mutations in {dt:.1f} s ({dt / len(muts) * 1e3:.0f} ms each, "
          f"{PARALLEL} at a time): {kinds}")
    # the harness saw both outcomes: damage refused, and damage that reads on correctly
    assert kinds.get("refused at open", 0) > 0 and kinds.get("opened, all blocks", 0) > 0


def _block_items(index: Path) -> list[tuple[bytes, bytes]]:
    env = lmdb.open(str(index), max_dbs=10, subdir=True, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return list(txn.cursor(db=env.open_db(di.DB_BLOCKS, txn=txn, create=False)))
    finally:
        env.close()


def test_swapped_records_are_misses_never_the_other_block(pristine, tmp_path):
    _root, base, _data = pristine
    store = tmp_path / "swap"
    shutil.copytree(base, store)
    ns = _block_items(store / "index")[0][0][:32]  # LMDB key: namespace id ‖ block key
    with opened(store) as s:
        cs = chains(s)
    # the third block of chain 0 and the fourth of chain 1 trade places and checksums
    a, b = ns + cs[0][2], ns + cs[1][3]
    env = lmdb.open(str(store / "index"), max_dbs=10, subdir=True)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(di.DB_BLOCKS, txn=txn, create=False)
            ra, rb = bytearray(txn.get(a, db=db)), bytearray(txn.get(b, db=db))
            ra[8:48], rb[8:48] = rb[8:48], ra[8:48]
            txn.put(a, bytes(ra), db=db)
            txn.put(b, bytes(rb), db=db)
    finally:
        env.close()
    with opened(store) as s:
        got = [s.fetch(ks).wait() for ks in chains(s)]
        damaged = s.stats().damaged
    for ks, g in zip(cs, got, strict=True):
        assert bit_equal(g, keyed_kv(LAY, ks[: g.shape[0]]))
    assert [g.shape[0] for g in got] == [2, 3, N_BLOCKS, N_BLOCKS]  # a counted miss each
    assert damaged == 2
    # kvstore verify also refuses both, never passes them
    from kvstore.cli import main

    out = io.StringIO()
    shutil.copytree(base, tmp_path / "swap2")
    env = lmdb.open(str(tmp_path / "swap2" / "index"), max_dbs=10, subdir=True)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(di.DB_BLOCKS, txn=txn, create=False)
            ra, rb = bytearray(txn.get(a, db=db)), bytearray(txn.get(b, db=db))
            ra[8:48], rb[8:48] = rb[8:48], ra[8:48]
            txn.put(a, bytes(ra), db=db)
            txn.put(b, bytes(rb), db=db)
    finally:
        env.close()
    with contextlib.redirect_stdout(out):
        rc = main(["verify", "--store", str(tmp_path / "swap2"), "--format", "json"])
    res = json.loads(out.getvalue())
    assert rc == 1
    assert {f["key"] for f in res["findings"] if f["kind"] == "checksum_mismatch"} == {
        cs[0][2].hex(), cs[1][3].hex()}


def test_truncated_index_cli_exit_status(pristine, tmp_path):
    """The issue's reproduction, literally: ``kvstore verify`` on a half-length data.mdb was
    a Bus error (exit 135); now exit 2 with a message naming recover, and open_store raises
    StoreCorruptError."""
    import subprocess
    import sys

    _root, base, data = pristine
    store = tmp_path / "cut"
    shutil.copytree(base, store)
    os.truncate(store / "index" / "data.mdb", len(data) // 2)
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "verify", "--store", str(store)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert f"kvstore recover --store {store}" in p.stderr
    with pytest.raises(StoreCorruptError, match="kvstore recover"):
        opened(store)
    assert os.path.getsize(store / "index" / "data.mdb") == len(data) // 2  # untouched


def test_meta_page_checks(pristine, tmp_path):
    _root, _base, data = pristine
    p = tmp_path / "data.mdb"

    def damage(b: bytes) -> str:
        p.write_bytes(b)
        with pytest.raises(guard.IndexDamage) as ei:
            guard.validate_file(str(p))
        return str(ei.value)

    b = bytearray(data)
    b[16] ^= 0xFF  # magic of meta 0
    assert "magic" in damage(bytes(b))
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        cur = guard.read_meta(fd)
    finally:
        os.close(fd)
    b = bytearray(data)
    off = cur.slot * 4096 + 16 + 24 + 96  # mm_last_pg of the current meta
    struct.pack_into("<Q", b, off, cur.last_pg + 1000)
    assert "cut off" in damage(bytes(b))
    b = bytearray(data)
    struct.pack_into("<Q", b, cur.slot * 4096 + 16 + 24 + 48 + 40, cur.last_pg + 5)  # main root
    assert "root" in damage(bytes(b))
    p.write_bytes(data)
    assert guard.validate_file(str(p)).databases["blocks"] == N_CHAINS * N_BLOCKS


def test_records_with_absurd_sizes_are_record_errors():
    rec = di.Rec(0, 0, 1, 736, 16, 16, 1, 1, 1, bytes(32), None)
    raw = bytearray(di.encode_record(rec))
    assert di.decode_record(bytes(raw)) == rec
    for off, val in ((24, 1 << 53), (32, 9007199254757376), (8, 0), (16, 1 << 60)):
        b = bytearray(raw)
        struct.pack_into("<Q", b, off, val)
        with pytest.raises(di.RecordError):
            di.decode_record(bytes(b))
    b = bytearray(raw)
    b[3] = 1  # reserved byte
    with pytest.raises(di.RecordError):
        di.decode_record(bytes(b))
    b = bytearray(raw)
    b[100] = 7  # a parent key without the parent flag
    with pytest.raises(di.RecordError):
        di.decode_record(bytes(b))
    with pytest.raises(di.RecordError):  # more data bytes than file bytes
        di.decode_seginfo(di.SEGINFO.pack(1, 1, 10, 20, 5, 0))
    with pytest.raises(di.RecordError):  # padding not zero
        di.decode_seginfo(b"\x01\x01" + di.SEGINFO.pack(1, 1, 20, 10, 5, 0)[2:])
    with pytest.raises(di.RecordError):
        di.decode_totals(b"\0" * 47)


def test_dropping_a_record_with_huge_sizes_commits(pristine, tmp_path):
    """A record whose (flipped) sizes exceed its segment's accounting can still be dropped:
    the derived counters are clamped, never a struct.error."""
    _root, base, _data = pristine
    store = tmp_path / "huge"
    shutil.copytree(base, store)
    items = _block_items(store / "index")
    k, v = items[0]
    r = di.decode_record(v)
    big = r._replace(stored_nbytes=1 << 29, raw_nbytes=1 << 29)
    env = lmdb.open(str(store / "index"), max_dbs=10, subdir=True)
    try:
        with env.begin(write=True) as txn:
            txn.put(k, di.encode_record(big), db=env.open_db(di.DB_BLOCKS, txn=txn, create=False))
    finally:
        env.close()
    from kvstore.tiers.disk import DiskTier

    t = DiskTier(store, capacity_bytes=1 << 30)
    try:
        assert t.delete([k[32:]]) == 1 and t.get_record(k[32:]) is None
        st = t.stats()
        assert st.stored_bytes >= 0 and st.blocks == N_CHAINS * N_BLOCKS - 1
    finally:
        t.close()


def test_namespace_record_ids_match_namespace_ids():
    """The index checks each namespace record against its key without importing
    ``kvstore.namespace`` (torch); both must hash alike."""
    from kvstore.namespace import Namespace

    for ns in (Namespace.create("m", LAY),
               Namespace.create("org/model-x", KVLayout(num_layers=3, num_kv_heads=4, head_dim=16,
                                                        dtype=torch.float16, block_tokens=8,
                                                        kv_planes=1),
                                model_revision="abc", tp_rank=1, tp_size=2,
                                extras={"quant": "fp8", "n": 3})):
        lay = ns.layout
        fields = (ns.model_id, ns.model_revision, "bfloat16" if lay.dtype == torch.bfloat16
                  else "float16", lay.num_layers, lay.kv_planes, lay.block_tokens,
                  lay.num_kv_heads, lay.head_dim, ns.tp_rank, ns.tp_size, ns.format_version,
                  tuple(ns.extras))
        assert di.decode_namespace(di.encode_namespace(fields)) == fields
        assert di.namespace_record_id(fields) == ns.id
        assert di.namespace_record_id((*fields[:1], fields[1] + "x", *fields[2:])) != ns.id
