"""Client processes against one daemon: one killed mid-put, eight working concurrently."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch
from conftest import wait_until

from kvstore import KVLayout, connect

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_tokens=4)
_PRELUDE = textwrap.dedent("""
    import hashlib, json, os, random, sys, time
    import torch
    from kvstore import KVLayout, connect
    LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16, block_tokens=4)

    def block(key):  # every block's bytes are a function of its key: checkable anywhere
        raw = hashlib.shake_256(key).digest(LAYOUT.block_nbytes)
        return torch.frombuffer(bytearray(raw), dtype=LAYOUT.dtype).view(LAYOUT.block_shape)
""")


def _spawn(code, *args):
    return subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(code), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


_until = wait_until


_MID_PUT = """
    import kvstore.client as kc
    c = connect(sys.argv[1], layout=LAYOUT, model_id="crash", device="cpu")
    held = c.block_keys(list(range(1000, 1008)))
    c.put(held, torch.stack([block(k) for k in held])).wait()
    c.pin(held)  # pins this process holds when it dies

    def write_half_then_hang(self, slab, kv, positions, slots):
        slab[slots[0]].fill_(0x55)  # a partial write into a granted slot
        print("GRANTED", flush=True)
        time.sleep(600)

    kc.Client._write_slots = write_half_then_hang
    keys = c.block_keys(list(range(32)))
    c.put(keys, torch.stack([block(k) for k in keys]))
"""


def test_client_killed_mid_put_leaves_no_partial_block_and_no_leaked_slot(serve):
    d = serve("--cpu-capacity", "64KiB", "--disk-capacity", "0")
    proc = _spawn(_MID_PUT, d.socket_path)
    try:
        assert proc.stdout.readline().strip() == "GRANTED", proc.stderr.read()
        c = connect(d.socket_path, layout=LAYOUT, model_id="crash", device="cpu")
        srv = c.server_stats()
        assert srv.grants == 1 and srv.granted_blocks == 8 and srv.pinned_blocks == 2
        keys = c.block_keys(list(range(32)))
        assert c.lookup(keys) == 0  # granted, not committed: invisible
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert _until(lambda: c.server_stats().grants == 0)
        srv, st = c.server_stats(), c.stats()
        assert srv.leases == srv.grants == srv.pinned_blocks == 0 and st.pinned_blocks == 0
        assert srv.free_warm_slots + st.tier("warm").blocks == srv.warm_slots  # no slot leaked
        assert st.blocks == 2 and st.put_dropped == 8
        assert c.lookup(keys) == 0  # no partial block became visible
        kv = torch.stack([_block(k) for k in keys])
        assert c.put(keys, kv).wait() == 8  # the same keys can be stored again
        assert torch.equal(c.fetch(keys).wait().view(torch.uint8), kv.view(torch.uint8))
        c.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _block(key):
    import hashlib

    raw = hashlib.shake_256(key).digest(LAYOUT.block_nbytes)
    return torch.frombuffer(bytearray(raw), dtype=LAYOUT.dtype).view(LAYOUT.block_shape)


_WORKERS = """
# one interpreter imports torch once, then forks the client processes (each connects after
# the fork: its own pid, socket, lease table and mapping of the slab)
def work(sock, wid, rounds):
    torch.set_num_threads(1)
    rng = random.Random(wid)
    c = connect(sock, layout=LAYOUT, model_id="shared", device="cpu", timeout=60)
    res = dict(errors=[], fetched=0, checked=0, stored=0, lookups=0)
    for i in range(rounds):
        try:
            # 24 prompts shared by every worker, each a 2-block system prefix + 6 own blocks
            p = rng.randrange(24)
            toks = [7] * 8 + [p * 1000 + j for j in range(24)]
            keys = c.block_keys(toks, salt="tenant-" + str(p % 2))
            op = rng.random()
            n = c.lookup(keys)
            res["lookups"] += 1
            if op < 0.45:
                got = c.fetch(keys).wait()
                for b in range(got.shape[0]):
                    if not torch.equal(got[b].view(torch.uint8), block(keys[b]).view(torch.uint8)):
                        res["errors"].append(f"block {b} of prompt {p} differs")
                res["fetched"] += got.shape[0]
                res["checked"] += got.shape[0]
            elif op < 0.8:
                m = c.lookup(keys)
                kv = torch.stack([block(k) for k in keys[m:]]) if m < len(keys) else None
                if kv is not None:
                    res["stored"] += c.put(keys[m:], kv).wait()
            elif op < 0.9:
                with c.pin(keys) as r:
                    out = torch.empty(LAYOUT.batch_shape(len(keys)), dtype=LAYOUT.dtype)
                    got = c.fetch(keys[: len(r)], out=out).wait()
                    if got.shape[0] != len(r):
                        res["errors"].append(f"pinned {len(r)} blocks but fetched {got.shape[0]}")
                    for b in range(got.shape[0]):
                        if not torch.equal(got[b].view(torch.uint8), block(keys[b]).view(torch.uint8)):
                            res["errors"].append("pinned block differs")
                    res["checked"] += got.shape[0]
            elif op < 0.97:
                c.prefetch(keys).wait()
                c.stats()
            else:
                c.evict(keys[-1:])
        except Exception as e:
            res["errors"].append(f"{type(e).__name__}: {e}")
    res["connected"] = c.connected
    c.close()
    return res

sock, nproc, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
children = []
for wid in range(nproc):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = work(sock, wid, rounds)
        except BaseException as e:
            out = dict(errors=[f"worker crashed: {e!r}"])
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    children.append((pid, r))
for pid, r in children:
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    _, status = os.waitpid(pid, 0)
    res = json.loads(b"".join(chunks) or b'{"errors": ["no result"]}')
    res["pid"], res["status"] = pid, status
    print(json.dumps(res), flush=True)
"""


def test_eight_client_processes_concurrently(serve):
    # 24 prompts x 8 blocks (2 shared) >> 64 warm slots: constant eviction under the clients
    d = serve("--cpu-capacity", str(64 * LAYOUT.block_nbytes), "--disk-capacity", "0")
    t0 = time.monotonic()
    launcher = _spawn(_WORKERS, d.socket_path, 8, 150)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    results = [json.loads(line) for line in out.strip().splitlines()]
    assert len(results) == 8 and len({r["pid"] for r in results}) == 8
    assert all(r["status"] == 0 for r in results), err
    wall = time.monotonic() - t0
    errors = [e for r in results for e in r["errors"]]
    assert not errors, errors[:10]
    assert all(r["connected"] for r in results)
    assert sum(r["checked"] for r in results) > 500 and sum(r["stored"] for r in results) > 100
    with connect(d.socket_path, layout=LAYOUT, model_id="shared", device="cpu") as c:
        srv, st = c.server_stats(), c.stats()
        assert srv.errors == 0
        assert srv.leases == srv.grants == srv.pinned_blocks == 0 and st.pinned_blocks == 0
        assert srv.free_warm_slots + st.tier("warm").blocks == srv.warm_slots == 64
        assert st.fetches > 0 and st.tier("warm").evictions > 0
    assert wall < 80
