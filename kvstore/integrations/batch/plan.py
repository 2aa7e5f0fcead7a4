"""Plan a batch so that each shared prefix is computed once.

In the spirit of BatchLLM (Zheng et al., arXiv 2412.03594): instead of leaving prefix reuse to
whatever an LRU cache happens to hold when a request arrives, look at the whole batch first.

1. **Prefix tree** (:mod:`.tree`) over the prompts' content block keys.
2. **Shared prefixes**: nodes where at least two prompts part (or one ends), at least
   ``min_shared_blocks`` long; they nest (a document shared by its questions, inside a system
   prompt shared by every document). Each also knows its token-level length
   (:attr:`SharedPrefix.shared_tokens`): the longest prefix its prompts have in common, which
   the token-batched engines compute once.
3. **Order and budget.** Prompts run in depth-first order of the tree, so each group's prompts
   run back to back and nested groups inside their parent. The first prompt of a group computes
   its prefix and puts it; the prompt-at-a-time runner then *pins* the prefix until the group's
   last prompt, so LRU eviction under the cache budget cannot drop a prefix about to be reused.

:func:`plan_batch` builds a frozen :class:`BatchPlan` and, by simulating the store's memory tier
(:mod:`.simulate`), reports the tokens the plan computes against the naive batch (every prompt
prefilled in full), against arrival order under the same budget, and the lower bound (the
unique tokens of the token-level prefix tree).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.integrations.batch.simulate import simulate
from kvstore.integrations.batch.tree import (
    TreeWalk,
    build_tree,
    common_prefix_len,
    unique_tokens,
    walk,
)
from kvstore.keys import block_keys as _block_keys

if TYPE_CHECKING:
    from kvstore.store import Store

__all__ = ["BatchPlan", "PlanStep", "SharedPrefix", "plan_batch"]

_PLAN_NAMESPACE = b"kvstore-batch-plan/1".ljust(32, b"\0")


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A prefix common to several prompts of the batch, computed once."""

    group: int  # index in BatchPlan.groups
    blocks: int  # length of the prefix in full blocks
    prompts: tuple[int, ...]  # prompts (batch indices) that start with it, in plan order
    parent: int  # the enclosing group, -1 if none
    saved_tokens: int  # (len(prompts) - 1) * blocks * block_tokens
    #: tokens all ``prompts`` share (>= blocks * block_tokens, capped one short of the shortest
    #: prompt, whose last token must be computed): what a token-batched engine computes once
    shared_tokens: int = 0

    @property
    def first(self) -> int:
        return self.prompts[0]

    @property
    def last(self) -> int:
        return self.prompts[-1]


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One prompt of the plan, in execution order."""

    prompt: int  # batch index
    group: int  # innermost group the prompt belongs to, -1 if none
    reuse_blocks: int  # blocks the simulation expects from the cache
    compute_tokens: int  # tokens the simulation expects the model to compute
    pin_after: tuple[int, ...] = ()  # groups whose prefix this step computed: pin them now
    release_after: tuple[int, ...] = ()  # groups whose last prompt this is: unpin them now


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """An execution order for a batch, its shared prefixes, and the simulated token counts.

    ``planned_tokens`` and ``arrival_tokens`` are those of prompt-at-a-time execution on a
    cold, memory-only store under ``budget_blocks``. With ``max_new_tokens`` the simulation
    also puts the prompt + answer blocks each generation stores (as if every prompt generated
    ``max_new_tokens``): the planned order, whose prefixes are pinned, is then exact; in
    arrival order the store may evict answer blocks in another order among themselves, so the
    real count can differ by a few blocks.
    """

    block_tokens: int
    budget_blocks: int | None  # memory budget the plan was made for (None: unlimited)
    num_prompts: int
    groups: tuple[SharedPrefix, ...]
    steps: tuple[PlanStep, ...]
    naive_tokens: int  # every prompt prefilled in full (no sharing at all)
    planned_tokens: int  # this plan, simulated under budget_blocks
    arrival_tokens: int  # prompts in arrival order with an LRU cache of the same budget
    lower_bound_tokens: int = 0  # unique tokens of the token-level prefix tree
    max_new_tokens: int = 0  # the generation length the simulation assumed

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(s.prompt for s in self.steps)

    @property
    def saved_fraction(self) -> float:
        """Share of the naive batch's tokens the plan does not compute."""
        return 1.0 - self.planned_tokens / self.naive_tokens if self.naive_tokens else 0.0


def _chains_for(prompts: Sequence[Sequence[int]], block_tokens: int, store: Store | None,
                salt: str | bytes | None) -> list[list[bytes]]:
    if store is not None:
        return [list(store.block_keys(p, salt)) for p in prompts]
    return [list(_block_keys(_PLAN_NAMESPACE, list(p), block_tokens, salt=salt)) for p in prompts]


def _store_budget(store: Store) -> int:
    st = store.stats()
    return sum(t.capacity_bytes for t in st.tiers if t.name in ("hot", "warm")) // st.block_nbytes


def _resolve(store: Store | None, block_tokens: int | None, budget_blocks: int | None,
             min_shared_blocks: int, max_new_tokens: int) -> tuple[int, int | None]:
    """Checked block size and budget (see :func:`plan_batch`)."""
    if store is not None:
        if block_tokens not in (None, store.layout.block_tokens):
            raise ValueError(f"block_tokens={block_tokens} but the store's layout has "
                             f"{store.layout.block_tokens}")
        block_tokens = store.layout.block_tokens
    T = 16 if block_tokens is None else block_tokens
    if T <= 0:
        raise ValueError(f"block_tokens must be > 0, got {T}")
    if budget_blocks == -1:
        budget_blocks = _store_budget(store) if store is not None else None
    if budget_blocks is not None and budget_blocks < 0:
        raise ValueError(f"budget_blocks must be >= 0 or None, got {budget_blocks}")
    if min_shared_blocks < 1:
        raise ValueError("min_shared_blocks must be >= 1")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return T, budget_blocks


def _groups(tw: TreeWalk, prompts: Sequence[Sequence[int]], T: int) -> tuple[SharedPrefix, ...]:
    pos = {p: j for j, p in enumerate(tw.order)}
    out = []
    for gi, (node, parent) in enumerate(tw.groups):
        members = sorted(node.prompts, key=pos.__getitem__)
        first = prompts[members[0]]
        shared = min(common_prefix_len(first, prompts[i]) for i in members[1:])
        shared = min(shared, min(len(prompts[i]) for i in members) - 1)
        out.append(SharedPrefix(
            group=gi, blocks=node.depth, prompts=tuple(members), parent=parent,
            saved_tokens=(len(node.prompts) - 1) * node.depth * T, shared_tokens=shared))
    return tuple(out)


def _pin_schedule(groups: Sequence[SharedPrefix], order: Sequence[int]
                  ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """For each step of ``order``: the groups pinned after it, and those released."""
    pin_after: dict[int, list[int]] = {}
    release_after: dict[int, list[int]] = {}
    for g in groups:
        pin_after.setdefault(g.first, []).append(g.group)
        release_after.setdefault(g.last, []).append(g.group)
    return [(tuple(pin_after.get(i, ())), tuple(sorted(release_after.get(i, ()), reverse=True)))
            for i in order]


def _answer_keys(prompt: Sequence[int], T: int, max_new_tokens: int) -> list[bytes]:
    """Stand-ins for the keys of the prompt + answer blocks a generation puts (their content
    is not known before it runs; the same prompt gives the same greedy answer)."""
    n = len(prompt)
    count = (n + max_new_tokens - 1) // T - n // T if max_new_tokens > 1 else 0
    if count <= 0:
        return []
    h = hashlib.sha256(b"kvstore-batch-answer/1" + b"".join(t.to_bytes(8, "little", signed=True)
                                                             for t in prompt)).digest()
    return [hashlib.sha256(h + j.to_bytes(4, "little")).digest() for j in range(count)]


def plan_batch(
    prompts: Sequence[Sequence[int]],
    *,
    block_tokens: int | None = None,
    store: Store | None = None,
    salt: str | bytes | None = None,
    budget_blocks: int | None = -1,
    min_shared_blocks: int = 1,
    max_new_tokens: int = 0,
) -> BatchPlan:
    """Plan ``prompts`` (token id sequences) so that each shared prefix is prefilled once.

    With ``store``, keys and ``block_tokens`` come from it and ``budget_blocks`` defaults to its
    memory tiers' capacity; without, ``block_tokens`` defaults to 16 and the budget to
    unlimited. ``budget_blocks=None`` means unlimited. Groups shorter than
    ``min_shared_blocks`` are not pinned (their prompts still run in tree order).
    ``max_new_tokens``: the runner's generation length, whose prompt + answer blocks
    (``store_generated``) the simulation puts too.
    """
    T, budget_blocks = _resolve(store, block_tokens, budget_blocks, min_shared_blocks,
                                max_new_tokens)
    lengths = [len(p) for p in prompts]
    if any(n == 0 for n in lengths):
        raise ValueError("every prompt needs at least one token")
    chains = _chains_for(prompts, T, store, salt)
    tw = walk(build_tree(chains), lengths, T, min_shared_blocks)
    groups = _groups(tw, prompts, T)
    pins = _pin_schedule(groups, tw.order)
    answers = [_answer_keys(p, T, max_new_tokens) for p in prompts] if max_new_tokens else None
    reused = simulate(chains, lengths, tw.order, block_tokens=T, budget_blocks=budget_blocks,
                      pins=pins, groups=groups, answers=answers)
    arrival = simulate(chains, lengths, range(len(prompts)), block_tokens=T,
                       budget_blocks=budget_blocks, answers=answers)
    steps = tuple(
        PlanStep(prompt=i, group=tw.innermost[i], reuse_blocks=r,
                 compute_tokens=lengths[i] - r * T, pin_after=pins[j][0],
                 release_after=pins[j][1])
        for j, (i, r) in enumerate(zip(tw.order, reused, strict=True))
    )
    naive = sum(lengths)
    return BatchPlan(
        block_tokens=T, budget_blocks=budget_blocks, num_prompts=len(prompts), groups=groups,
        steps=steps, naive_tokens=naive, planned_tokens=sum(s.compute_tokens for s in steps),
        arrival_tokens=naive - T * sum(arrival), lower_bound_tokens=unique_tokens(prompts),
        max_new_tokens=max_new_tokens,
    )
