"""Two writer processes over a small disk budget (issue 26, item 7): budget eviction in one
process and commits in the other keep every chain prefix-closed — a block is never committed
below a parent that the other process evicted meanwhile, so no block is unreachable.
"""

from __future__ import annotations

import functools
import os
import random

import pytest
import torch
from support.disk import chain, fork_call, namespace, small_layout, wait_child, writes

from kvstore.tiers.disk import DiskTier

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

LAY = small_layout(torch.bfloat16)
BN = LAY.block_nbytes



RUNS = int(os.environ.get("KVSTORE_BUDGET_RUNS", "8"))
ROUNDS = 60
CAPACITY = 6 * BN


def unreachable(t: DiskTier) -> set[bytes]:
    """Blocks whose parent is not in the index (no lookup can reach them), in one snapshot
    (``records`` reads up to 1,024 records in one transaction)."""
    recs = list(t.records())
    assert len(recs) < 1024
    have = {(r.namespace_id, r.key) for r in recs}
    return {r.key for r in recs if r.parent is not None and (r.namespace_id, r.parent) not in have}


def _budget_writer(path, w: int, seed: int, out: int) -> None:
    """Extend two shared chains from their shared prefix, evicting to a budget of 6 blocks
    after every write: the other process's eviction takes the prefix's last block (a leaf
    once its children went) while this one commits a child of it. Every write carries the
    whole chain (the prefix is skipped where present), so a block whose parent is missing is
    never a write in flight: after each write, any is counted."""
    ns = namespace(LAY)
    rnd = random.Random(seed * 2 + w)
    t = DiskTier(path, capacity_bytes=CAPACITY, max_segment_bytes=4 * BN)
    seen: set[bytes] = set()
    try:
        for i in range(ROUNDS):
            base = chain(f"shared{rnd.randrange(2)}", 2)
            ext = chain(f"ext{w}-{i}", rnd.randint(1, 2), parent=base[-1])
            t.write_blocks(writes(base, ns) + writes(ext, ns, parent=base[-1]))
            seen |= unreachable(t)
            t.evict_to_budget()
    finally:
        t.close()
        os.write(out, f"{len(seen)}\n".encode())


def test_two_writers_over_a_small_budget_leave_no_unreachable_block(tmp_path):
    """2 processes, a budget of 6 blocks, ``RUNS`` stores of 2 x 60 writes and evictions:
    no block is ever committed below a parent the other process evicted (none seen after
    any write, none at the end: ``check`` and ``verify`` find nothing)."""
    from kvstore.admin.verification import verify

    ns = namespace(LAY)
    seen, final = [], []
    for run in range(RUNS):
        path = tmp_path / f"run{run}"
        with DiskTier(path, capacity_bytes=CAPACITY) as t:
            t.register_namespace(ns)
        r, w = os.pipe()
        pids = [fork_call(functools.partial(_budget_writer, path, wr, run, w)) for wr in (0, 1)]
        assert [wait_child(p) for p in pids] == [0, 0]
        os.close(w)
        with os.fdopen(r) as f:
            seen.append(sum(int(x) for x in f.read().split()))
        with DiskTier(path, capacity_bytes=CAPACITY) as t:
            assert t.check(grace_s=0) == []
            final.append(len(unreachable(t)))
        res = verify(str(path), grace_s=0)
        assert [f.kind for f in res.findings if f.kind != "unreachable"] == []
        assert sum(f.kind == "unreachable" for f in res.findings) == final[-1]
    assert sum(seen) + sum(final) == 0, (
        f"unreachable blocks per run, seen by the writers: {seen}; at the end: {final}")


def test_a_child_is_not_committed_below_a_parent_evicted_meanwhile(tmp_path):
    """The race, in one process: a chain's next blocks are staged while their parent is on
    disk, the parent goes (another process's eviction, here a delete) before the commit:
    nothing is committed below it, the staged segment is removed. A parent that was not on
    disk when its child was staged is a write in flight (a put's earlier blocks still in
    memory): the child is committed, and reachable once the parent lands."""
    ns = namespace(LAY)
    base = chain("base", 2)
    ext = chain("ext", 3, parent=base[-1])
    with DiskTier(tmp_path, capacity_bytes=1 << 30) as t:
        t.register_namespace(ns)
        t.write_blocks(writes(base, ns))
        staged = t.stage_blocks(writes(base, ns) + writes(ext, ns, parent=base[-1]))
        assert t.delete_owned([base[-1]], ns.id) == [base[-1]]
        assert t.commit_staged([staged]) == []
        assert unreachable(t) == set()
        assert {r.key for r in t.records()} == {base[0]}
        assert len(os.listdir(tmp_path / "segments")) == 1  # the first write's segment only
        assert t.check(grace_s=0) == []
        # in flight: the child first, its parent (not on disk when the child was staged) after
        assert t.write_blocks(writes(ext, ns, parent=base[-1])) == ext
        assert unreachable(t) == {ext[0]}
        t.write_blocks(writes(base, ns))
        assert unreachable(t) == set()
        assert t.leading_run(base + ext, ns.id) == 5
