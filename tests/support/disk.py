"""Helpers shared by the disk tier's tests and ``tools/stress_disk.py``: deterministic block
content derived from the key, small layouts, and the kill-the-writer crash round.
``populate_fake_index`` (a large index without payload) is the disk tier's own
(:mod:`kvstore.tiers.disk.synthetic`, also used by the ``disk`` benchmark), re-exported here.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.layout import KVLayout
from kvstore.namespace import Namespace
from kvstore.tiers.disk import DiskTier, DiskWrite, ReadStatus, populate_fake_index

__all__ = [
    "CrashLog", "block_data", "chain", "crash_round", "namespace", "parse_acks",
    "populate_fake_index", "small_layout", "verify_all", "writes",
]


def small_layout(dtype: torch.dtype = torch.bfloat16, *, num_layers: int = 2, head_dim: int = 16,
                 block_tokens: int = 4) -> KVLayout:
    return KVLayout(num_layers=num_layers, num_kv_heads=2, head_dim=head_dim, dtype=dtype,
                    block_tokens=block_tokens)


def namespace(layout: KVLayout, model_id: str = "test/disk-model") -> Namespace:
    return Namespace.create(model_id, layout)


def chain(seed: bytes | str, n: int, parent: bytes | None = None) -> list[bytes]:
    """``n`` chained 32-byte keys (SHA-256), continuing from ``parent`` if given."""
    if isinstance(seed, str):
        seed = seed.encode()
    out = []
    k = parent if parent is not None else hashlib.sha256(b"root:" + seed).digest()
    for i in range(n):
        k = hashlib.sha256(k + seed + i.to_bytes(4, "little")).digest()
        out.append(k)
    return out


def block_data(key: bytes, layout: KVLayout) -> torch.Tensor:
    """Deterministic block bytes for ``key`` (normal-distributed values in the layout's dtype,
    as a 1-D uint8 tensor). numpy only, so it is safe in a forked child."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    isz = layout.itemsize
    n = layout.block_nbytes // isz
    x = rng.standard_normal(n, dtype=np.float32)
    if layout.dtype == torch.bfloat16:
        b = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    elif layout.dtype == torch.float16:
        b = x.astype(np.float16).view(np.uint8)
    elif layout.dtype == torch.float32:
        b = x.view(np.uint8)
    elif layout.dtype == torch.float64:
        b = x.astype(np.float64).view(np.uint8)
    else:
        b = rng.integers(0, 256, layout.block_nbytes, dtype=np.uint8)
    return torch.from_numpy(np.ascontiguousarray(b))


def writes(keys: Sequence[bytes], ns: Namespace, parent: bytes | None = None) -> list[DiskWrite]:
    """DiskWrite items for a chain of keys (each key's parent is the previous one)."""
    out = []
    prev = parent
    for k in keys:
        out.append(DiskWrite(k, prev, ns.id, block_data(k, ns.layout)))
        prev = k
    return out


def verify_all(tier: DiskTier, layout: KVLayout) -> tuple[int, list[bytes]]:
    """Read every indexed block back; returns (number OK, keys that were not bit-exact)."""
    dst = torch.empty(layout.block_nbytes, dtype=torch.uint8)
    bad = []
    ok = 0
    for r in list(tier.records()):
        st = tier.read_into(r.key, dst)
        if st is ReadStatus.OK and torch.equal(dst, block_data(r.key, layout)):
            ok += 1
        else:
            bad.append(r.key)
    return ok, bad


# -- crash rounds ------------------------------------------------------------------------------

@dataclass
class CrashLog:
    """What the killed child acknowledged, and what may have been in flight."""

    present: set[bytes] = field(default_factory=set)  # acked written and not acked removed
    maybe_removed_all: bool = False  # an eviction was in flight at the kill
    maybe_removed: set[bytes] = field(default_factory=set)  # a delete was in flight


def _child_loop(path: str, layout: KVLayout, wfd: int, seed: int) -> None:
    rnd = random.Random(seed)
    ns = namespace(layout)
    tier = DiskTier(path, capacity_bytes=48 * layout.block_nbytes, orphan_grace_s=0.0,
                    max_segment_bytes=4 * layout.block_nbytes,
                    codec="zstd" if seed % 3 == 0 else "none")
    tier.register_namespace(ns)

    def ack(line: str) -> None:
        data = (line + "\n").encode()
        while data:
            n = os.write(wfd, data)
            data = data[n:]

    ack("open")
    heads: list[bytes | None] = [None]
    n = 0
    while True:
        n += 1
        op = rnd.random()
        if op < 0.7:
            parent = rnd.choice(heads)
            keys = chain(f"{seed}-{n}", rnd.randint(1, 8), parent)
            done = tier.write_blocks(writes(keys, ns, parent))
            ack("W " + " ".join(k.hex() for k in done))
            heads.append(keys[-1])
            if len(heads) > 8:
                heads.pop(1)
        elif op < 0.8:
            recs = [r.key for r in tier.records()]
            victims = rnd.sample(recs, min(len(recs), rnd.randint(1, 3)))
            ack("D? " + " ".join(k.hex() for k in victims))
            tier.delete(victims)
            ack("D " + " ".join(k.hex() for k in victims))
        elif op < 0.9:
            ack("E?")
            gone = tier.evict_to_budget()
            ack("E " + " ".join(k.hex() for k in gone))
        else:
            tier.compact(threshold=0.9)
            tier.touch([r.key for r in tier.records()][:4])
            ack("C")


def parse_acks(text: str, baseline: set[bytes]) -> CrashLog:
    """Replay the child's acknowledgements over ``baseline`` (what was on disk before)."""
    log = CrashLog(present=set(baseline))
    complete = text.split("\n")[:-1]  # a line without its newline was cut by the kill
    for i, line in enumerate(complete):
        if not line:
            continue
        tag, _, rest = line.partition(" ")
        keys = [bytes.fromhex(h) for h in rest.split()] if tag in ("W", "D?", "D", "E") else []
        last = i == len(complete) - 1
        if tag == "X":
            raise AssertionError(f"writer child failed: {rest}")
        if tag == "W":
            log.present.update(keys)
        elif tag in ("D", "E"):
            log.present.difference_update(keys)
        elif tag == "D?" and last:
            log.maybe_removed.update(keys)
        elif tag == "E?" and last:
            log.maybe_removed_all = True
    return log


def crash_round(path: str, layout: KVLayout, *, seed: int, kill_after: float,
                baseline: set[bytes] | None = None) -> dict:
    """Fork a writer child on ``path``, SIGKILL it after ``kill_after`` seconds, then reopen
    and verify: the reopen works, ``check`` finds nothing but temp files / orphan segments
    (which ``fix`` removes), every indexed block reads back bit-exact, and every block whose
    ``write_blocks`` had returned (acknowledged through a pipe) is present unless a delete or
    eviction of it was acknowledged or in flight. ``baseline``: the blocks on disk before the
    round. Returns a summary with ``present`` (the new baseline); raises AssertionError."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            _child_loop(path, layout, w, seed)
        except BaseException as e:  # report, so the parent fails loudly
            import traceback

            msg = "".join(traceback.format_exception(e)).replace("\n", " | ")
            os.write(w, f"X {msg}\n".encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    time.sleep(kill_after)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    log = parse_acks(b"".join(chunks).decode(), baseline or set())
    must = set() if log.maybe_removed_all else log.present - log.maybe_removed
    t0 = time.perf_counter()
    tier = DiskTier(path, capacity_bytes=48 * layout.block_nbytes, orphan_grace_s=0.0)
    reopen_s = time.perf_counter() - t0
    try:
        findings = tier.check(grace_s=0.0)
        bad = [f for f in findings if f.kind not in ("temp_file", "orphan_segment")]
        assert not bad, f"check found corruption after a kill: {bad}"
        if findings:
            fixed = tier.check(fix=True, grace_s=0.0)
            assert all(f.fixed for f in fixed), fixed
            assert tier.check(grace_s=0.0) == [], "check still finds problems after fix"
        ok, wrong = verify_all(tier, layout)
        assert not wrong, f"{len(wrong)} indexed blocks do not read back bit-exact"
        held = {rec.key for rec in tier.records()}
        lost = must - held
        assert not lost, f"{len(lost)} acknowledged blocks are missing after the kill"
    finally:
        tier.close()
    return {"blocks": ok, "findings": [f.kind for f in findings], "must": len(must),
            "reopen_s": reopen_s, "present": held}


def fork_call(fn) -> int:
    """Run ``fn()`` in a forked child (exit 0 if it returned, 1 with the traceback printed if
    it raised); returns the child's pid for :func:`wait_child`."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait_child(pid: int, timeout: float = 120.0) -> int:
    """The exit code of child ``pid``; kills it and fails the test after ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        p, status = os.waitpid(pid, os.WNOHANG)
        if p:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("child process timed out")
