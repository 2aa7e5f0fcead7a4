#!/usr/bin/env python
"""Crash stress of the disk tier: many rounds of a writer process SIGKILLed at random moments.

    python tools/stress_disk.py --rounds 500 [--path DIR] [--seed N] [--max-delay 0.5]

Each round forks a writer on the same store (write_blocks, delete, evict_to_budget, compact,
touch, each acknowledged through a pipe), kills it with SIGKILL after a random delay, reopens
the store and verifies it (see crash_round in tests/support/disk.py). Exits non-zero on the
first violation.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

# the crash round is shared with tests/tiers/disk/test_disk_crash.py: tests/support/disk.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from support.disk import crash_round, small_layout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--path", default=None, help="store directory (default: a new temp dir)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--min-delay", type=float, default=0.005)
    ap.add_argument("--max-delay", type=float, default=0.5)
    ap.add_argument("--head-dim", type=int, default=64, help="block size knob (64 -> 4 KiB blocks)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    rnd = random.Random(seed)
    path = args.path or tempfile.mkdtemp(prefix="kvstore-stress-")
    layout = small_layout(head_dim=args.head_dim)
    print(f"stress: {args.rounds} rounds on {path}, seed {seed}, {layout.block_nbytes} B blocks")
    present: set[bytes] = set()
    kinds: dict[str, int] = {}
    verified = 0
    t0 = time.perf_counter()
    worst_reopen = 0.0
    for i in range(args.rounds):
        delay = rnd.uniform(args.min_delay, args.max_delay)
        try:
            res = crash_round(path, layout, seed=seed * 100_003 + i, kill_after=delay,
                              baseline=present)
        except AssertionError as e:
            print(f"round {i} (delay {delay:.3f} s): FAILED: {e}", file=sys.stderr)
            print(f"store left at {path} for inspection", file=sys.stderr)
            return 1
        present = res["present"]
        verified += res["must"]
        worst_reopen = max(worst_reopen, res["reopen_s"])
        for k in res["findings"]:
            kinds[k] = kinds.get(k, 0) + 1
        if (i + 1) % 50 == 0:
            print(f"  {i + 1} rounds, {len(present)} blocks, {time.perf_counter() - t0:.0f} s")
    print(f"ok: {args.rounds} rounds in {time.perf_counter() - t0:.1f} s; {verified} acknowledged "
          f"blocks verified; leftovers fixed: {kinds}; worst reopen {worst_reopen * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
