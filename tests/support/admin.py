"""Helpers for the admin tests: block contents derived from the key, so that any process can
tell whether a block's bytes are right; stores built through :func:`kvstore.open_store`; and a
worker process that reads and writes a store in a loop while admin commands run
(``python -m support.admin worker ...``, with ``tests/`` on ``sys.path`` or as the working
directory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvstore.layout import KVLayout


def small_layout(head_dim: int = 16) -> KVLayout:
    """L2 P2 T4 H2 D16 bfloat16: 1 KiB blocks."""
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16,
                    block_tokens=4)


def block_bytes(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes every block stored under ``key`` holds in these tests."""
    seed = int.from_bytes(hashlib.sha256(b"kvstore-admin-test" + bytes(key)).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def kv_for(keys: Sequence[bytes], layout: KVLayout) -> torch.Tensor:
    """``[n, L, P, T, H, D]`` holding :func:`block_bytes` of each key."""
    nb = layout.block_nbytes
    buf = np.empty((len(keys), nb), dtype=np.uint8)
    for i, k in enumerate(keys):
        buf[i] = block_bytes(k, nb)
    t = torch.from_numpy(buf)
    return t.view(layout.dtype).reshape(layout.batch_shape(len(keys)))


def prompt_tokens(i: int, n_blocks: int, block_tokens: int, *, shared: int = 2,
                  groups: int = 3, salt: int = 0) -> list[int]:
    """Prompt ``i``: ``shared`` blocks common to its group (``i % groups``), then its own."""
    g = i % groups
    shared = min(shared, n_blocks)
    head = [salt * 10_000_000 + 1000 * g + j for j in range(shared * block_tokens)]
    tail = [salt * 10_000_000 + 1_000_000 + 1000 * i + j
            for j in range((n_blocks - shared) * block_tokens)]
    return head + tail


def open_test_store(path: str | os.PathLike[str], model_id: str, layout: KVLayout | None = None,
                    *, warm_blocks: int = 64, **kw):  # a Store
    from kvstore.store import open_store

    lay = layout or small_layout()
    return open_store(path, layout=lay, model_id=model_id, device="cpu", gpu_capacity=0,
                      cpu_capacity=warm_blocks * lay.block_nbytes,
                      disk_capacity=kw.pop("disk_capacity", "1GiB"), **kw)


def build_store(path: str | os.PathLike[str], model_id: str, *, prompts: int = 6,
                blocks: int = 4, layout: KVLayout | None = None, salt: int = 0,
                flush_each: bool = False, **kw) -> list[list[bytes]]:
    """Put ``prompts`` prompts of ``blocks`` blocks into the store at ``path`` (created if
    needed) for ``model_id``; returns each prompt's key chain. ``flush_each`` writes one
    segment per prompt."""
    lay = layout or small_layout()
    chains = []
    with open_test_store(path, model_id, lay, **kw) as s:
        for i in range(prompts):
            keys = s.block_keys(prompt_tokens(i, blocks, lay.block_tokens, salt=salt))
            s.put(keys, kv_for(keys, lay)).wait()
            if flush_each:
                s.flush()
            chains.append([bytes(k) for k in keys])
    return chains


def check_disk_bytes(path: str | os.PathLike[str]) -> tuple[int, list[bytes]]:
    """Read every block on disk (read-only); returns (blocks that are bit-exact, keys that
    are not or could not be read)."""
    from kvstore.tiers.disk import DiskTier, ReadStatus

    t = DiskTier(path, capacity_bytes=0, readonly=True)
    try:
        ok, bad = 0, []
        for r in list(t.records()):
            dst = torch.empty(r.raw_nbytes, dtype=torch.uint8)
            st = t.read_into(r.key, dst)
            if st is ReadStatus.MISSING and t.get_record(r.key) is None:
                continue  # removed meanwhile
            if st is ReadStatus.OK and np.array_equal(dst.numpy(), block_bytes(r.key, r.raw_nbytes)):
                ok += 1
            else:
                bad.append(r.key)
        return ok, bad
    finally:
        t.close()


# -- the concurrent worker ---------------------------------------------------------------------

def _worker(args: argparse.Namespace) -> int:
    lay = small_layout()
    nb = lay.block_nbytes
    put_keys: set[str] = set()
    fetched = mismatches = iterations = short = 0
    t_end = time.monotonic() + args.max_seconds
    with open_test_store(args.store, args.model, lay, warm_blocks=args.warm_blocks) as s:
        chains = [s.block_keys(prompt_tokens(i, args.blocks, lay.block_tokens, salt=args.salt))
                  for i in range(args.prompts)]
        ready = False
        while time.monotonic() < t_end:
            keys = chains[iterations % len(chains)]
            n = s.lookup(keys)
            if n:
                out = s.fetch(keys[:n]).wait()
                got = out.contiguous().view(torch.uint8).reshape(out.shape[0], nb).numpy()
                short += n - out.shape[0]
                for j in range(out.shape[0]):
                    fetched += 1
                    if not np.array_equal(got[j], block_bytes(keys[j], nb)):
                        mismatches += 1
                        print(f"worker: block {bytes(keys[j]).hex()} has wrong bytes",
                              file=sys.stderr)
            s.put(keys, kv_for(keys, lay)).wait()
            put_keys.update(bytes(k).hex() for k in keys)
            iterations += 1
            if iterations % len(chains) == 0:
                s.flush()
                s.evict(tier="warm")  # next round reads from disk
                if not ready and args.ready:
                    with open(args.ready, "w") as f:
                        f.write("ready")
                    ready = True
            if args.stop and os.path.exists(args.stop) and ready:
                break
        s.flush()
        st = s.stats()
    res = {"iterations": iterations, "fetched": fetched, "mismatches": mismatches,
           "short": short, "damaged": st.damaged, "put_keys": sorted(put_keys)}
    with open(args.out, "w") as f:
        json.dump(res, f)
    return 0 if mismatches == 0 else 1


#: ``kvstore ARGS`` in a fresh interpreter that fails (exit 99) if the command imported torch
_CLI_WITHOUT_TORCH = (
    "import sys, time\n"
    "t = time.perf_counter()\n"
    "from kvstore.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "sys.stdout.flush()\n"
    "print(f'seconds {time.perf_counter() - t:.3f}', file=sys.stderr)\n"
    "sys.exit(99 if 'torch' in sys.modules else rc)\n"
)


def cli_without_torch(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``kvstore ARGS`` in a subprocess; exit status 99 means it imported torch. Also
    returns the seconds it took in-process (imports included, interpreter start not)."""
    from kvstore.child import env

    p = subprocess.run([sys.executable, "-c", _CLI_WITHOUT_TORCH, *args], capture_output=True,
                       text=True, timeout=120, env=env(), stdin=subprocess.DEVNULL)
    lines = p.stderr.splitlines()
    took = float(lines[-1].split()[1]) if lines and lines[-1].startswith("seconds ") else -1.0
    return p, took


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m support.admin")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="put/fetch in a loop, checking every fetched byte")
    w.add_argument("--store", required=True)
    w.add_argument("--model", default="worker/model")
    w.add_argument("--prompts", type=int, default=8)
    w.add_argument("--blocks", type=int, default=5)
    w.add_argument("--salt", type=int, default=1)
    w.add_argument("--warm-blocks", type=int, default=12)
    w.add_argument("--max-seconds", type=float, default=30.0)
    w.add_argument("--ready", help="file created once every prompt is on disk")
    w.add_argument("--stop", help="stop once this file exists")
    w.add_argument("--out", required=True, help="JSON result file")
    args = p.parse_args(argv)
    return _worker(args)


if __name__ == "__main__":
    sys.exit(main())
