"""Crash safety: a writer process SIGKILLed at random moments never corrupts the disk tier.

Each round forks a child that loops over write_blocks / delete / evict_to_budget / compact /
touch on the same store and acknowledges every completed call through a pipe; the parent kills
it after a random delay, then reopens the store and checks that (1) the reopen works, (2)
``check()`` finds nothing but temp files / orphan segments of the interrupted write (and
``fix`` removes them), (3) every indexed block reads back bit-exact (content is derived from
the key), (4) every block whose write_blocks had returned is still there, unless its delete or
an eviction was acknowledged or in flight. ``tools/stress_disk.py`` runs many more rounds.
"""

from __future__ import annotations

import os
import random

import pytest
from support.disk import crash_round, small_layout

ROUNDS = int(os.environ.get("KVSTORE_CRASH_ROUNDS", "24"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_sigkill_writer_rounds(tmp_path):
    layout = small_layout(head_dim=64)  # 4 KiB blocks
    rnd = random.Random(1234)
    present: set[bytes] = set()
    kinds: dict[str, int] = {}
    checked = 0
    for i in range(ROUNDS):
        res = crash_round(str(tmp_path), layout, seed=i, kill_after=rnd.uniform(0.01, 0.25),
                          baseline=present)
        present = res["present"]
        checked += res["must"]
        for k in res["findings"]:
            kinds[k] = kinds.get(k, 0) + 1
    print(f"\n{ROUNDS} kill rounds: {len(present)} blocks at the end, {checked} acknowledged "
          f"blocks verified present, interrupted-write leftovers found and fixed: {kinds}")
    assert checked > 0
