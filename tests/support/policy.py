"""What the policy tests share: a one-layer layout and blocks whose bytes name their key."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from kvstore import KVLayout

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float16, block_tokens=2)
BN = LAY.block_nbytes

chain_st = st.lists(st.integers(0, 3), min_size=1, max_size=6)  # a path in a small tree
#: what :func:`drive` replays: requests of chains and evictions
ops_st = st.lists(st.tuples(st.sampled_from(["request", "evict"]), chain_st), max_size=60)
#: calls on a simulator-only policy (replay/lhd.py, replay/lrb.py): (call, key, keys touched)
sim_ops_st = st.lists(st.tuples(st.sampled_from(["insert", "touch", "evict", "drop"]),
                                st.integers(0, 30), st.integers(1, 5)), max_size=300)


def kv_for(keys):
    """Blocks for ``keys``, each filled with its key's first two bytes."""
    out = torch.empty(LAY.batch_shape(len(keys)), dtype=torch.int16)
    for i, k in enumerate(keys):
        out[i] = int.from_bytes(k[:2], "little") - 2**15
    return out.view(torch.float16)


def drive(policy, ops, slots=6, door=None):
    """The store's calls for fetch-then-put of each chain in ``ops`` (``("request", path)``
    or ``("evict", _)``), leaf-first eviction, checking after each step that the policy
    lists exactly the held blocks, at most ``slots``, prefix-closed; returns its order after
    each step. With ``door`` (an admission), new blocks go through it and a full tier evicts
    to make room; without, a full tier stops the put."""
    parent, kids, trace = {}, {}, []

    def evict_one() -> bool:
        for k in policy.victims():
            if not kids.get(k):
                policy.remove(k, for_room=True)
                if door is not None:
                    door.evicted(k)
                p = parent.pop(k)
                if p is not None:
                    kids[p] -= 1
                return True
        return False

    for op, path in ops:
        keys = [tuple(path[: i + 1]) for i in range(len(path))]
        if op == "evict" and parent:
            evict_one()
        elif op == "request":
            n = 0
            while n < len(keys) and keys[n] in parent:
                n += 1
            if n:
                policy.touch(keys[n - 1::-1])
            if door is not None:
                policy.touch(keys[::-1])
            for i in range(n, len(keys)):
                if len(parent) >= slots and (door is None or not evict_one()):
                    break
                if i and keys[i - 1] not in parent:
                    break  # its parent went for room: the rest is unreachable
                p = keys[i - 1] if i else None
                parent[keys[i]] = p
                if p is not None:
                    kids[p] = kids.get(p, 0) + 1
                if door is None:
                    policy.insert(keys[i])
                else:
                    policy.insert(keys[i], probation=not door.admit(keys[i]))
            policy.touch(keys[::-1])
        held = set(parent)
        assert len(held) <= slots
        assert set(policy.victims()) == held and len(policy.order()) == len(held)
        for k in held:  # prefix-closed
            assert k[:-1] == () or k[:-1] in held
        trace.append(tuple(policy.order()))
    return trace


def drive_sim(p, ops, victim, check) -> None:
    """Replay :data:`sim_ops_st`'s calls on a simulator-only policy ``p``: an evict or drop
    removes ``victim(p, held, first)`` (``first``: ``p.peek()`` to evict, the smallest held
    key to drop; None: nothing); after every call ``p.order()`` is every held key once and
    ``p.peek()`` its first, and ``check(p, held)`` runs."""
    held: set[int] = set()
    for op, k, n in ops:
        if op == "insert" and k not in held:
            p.insert(k)
            held.add(k)
        elif op == "touch":
            p.touch([k + i for i in range(n)])
        elif op in ("evict", "drop") and held:
            first = p.peek() if op == "evict" else min(held)
            assert first in held
            v = victim(p, held, first)
            if v is not None:
                p.remove(v, for_room=op == "evict")
                held.discard(v)
        order = p.order()
        assert sorted(order) == sorted(held) and len(p) == len(held)
        assert p.peek() == (order[0] if order else None)
        check(p, held)
