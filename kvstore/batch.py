"""Batched prefix sharing: plan a batch so that each shared prefix is prefilled once.

In the spirit of BatchLLM (Zheng et al., arXiv 2412.03594): instead of leaving prefix reuse to
whatever an LRU cache happens to hold when a request arrives, look at the whole batch first.

1. **Prefix tree.** Every prompt's full blocks are keyed by content (the store's chained block
   keys); the keys of all prompts form a tree whose root-to-node paths are the block prefixes
   that occur in the batch, each node counting the prompts through it.
2. **Shared prefixes.** A node that at least two prompts pass through and where they part (or
   where one of them ends) is a *shared prefix*: the longest prefix common to exactly that set
   of prompts. Those of at least ``min_shared_blocks`` blocks are the groups worth computing
   once; groups nest (a document shared by its questions, inside a system prompt shared by
   every document).
3. **Order and budget.** Prompts run in depth-first order of the tree, so each group's prompts
   run back to back and nested groups inside their parent. The first prompt of a group computes
   its prefix and puts it; the runner then *pins* the prefix until the group's last prompt, so
   LRU eviction under the cache budget cannot drop a prefix that is about to be reused. The
   pinned blocks always lie on the chain of the prompt that runs, so a budget that holds the
   longest prompt is enough for every block of the tree to be computed at most once.

:func:`plan_batch` builds a frozen :class:`BatchPlan` and, by simulating the store's memory tier
(LRU, leaf-first eviction, pins, a budget in blocks), reports the tokens the plan computes
against the naive batch (every prompt prefilled in full) and against arrival order under the
same budget. :class:`BatchRunner` executes a plan through the transformers bridge
(:class:`kvstore.integrations.transformers.PrefixCachedModel`).

The simulation assumes a cold cache and a memory-only store: blocks already cached or served
by a disk tier only lower the real count, which the runner reports next to it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.keys import block_keys as _block_keys

if TYPE_CHECKING:  # the runner's model comes from the optional transformers bridge
    from kvstore.integrations.transformers import PrefixCachedModel
    from kvstore.store import Store

__all__ = [
    "BatchPlan",
    "BatchRunResult",
    "BatchRunner",
    "PlanStep",
    "SharedPrefix",
    "plan_batch",
    "simulate",
]

_PLAN_NAMESPACE = b"kvstore-batch-plan/1".ljust(32, b"\0")


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """A prefix common to several prompts of the batch, computed once and pinned while used."""

    group: int  # index in BatchPlan.groups
    blocks: int  # length of the prefix in full blocks
    prompts: tuple[int, ...]  # prompts (batch indices) that start with it, in plan order
    parent: int  # the enclosing group, -1 if none
    saved_tokens: int  # (len(prompts) - 1) * blocks * block_tokens

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
    """An execution order for a batch, its shared prefixes, and the simulated token counts."""

    block_tokens: int
    budget_blocks: int | None  # memory budget the plan was made for (None: unlimited)
    num_prompts: int
    groups: tuple[SharedPrefix, ...]
    steps: tuple[PlanStep, ...]
    naive_tokens: int  # every prompt prefilled in full (no sharing at all)
    planned_tokens: int  # this plan, simulated under budget_blocks
    arrival_tokens: int  # prompts in arrival order with an LRU cache of the same budget

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(s.prompt for s in self.steps)

    @property
    def saved_fraction(self) -> float:
        """Share of the naive batch's tokens the plan does not compute."""
        return 1.0 - self.planned_tokens / self.naive_tokens if self.naive_tokens else 0.0


# -- prefix tree ---------------------------------------------------------------------------
class _Node:
    __slots__ = ("key", "depth", "children", "prompts", "ends")

    def __init__(self, key: bytes | None, depth: int) -> None:
        self.key = key
        self.depth = depth
        self.children: dict[bytes, _Node] = {}  # insertion order = first arrival
        self.prompts: list[int] = []  # prompts whose chain passes through (or ends at) this node
        self.ends: list[int] = []  # prompts whose chain ends here


def _build_tree(chains: Sequence[Sequence[bytes]]) -> _Node:
    root = _Node(None, 0)
    for i, chain in enumerate(chains):
        node = root
        node.prompts.append(i)
        for k in chain:
            nxt = node.children.get(k)
            if nxt is None:
                nxt = node.children[k] = _Node(k, node.depth + 1)
            nxt.prompts.append(i)
            node = nxt
        node.ends.append(i)
    return root


# -- simulation of the store's memory tier -------------------------------------------------
class _CacheModel:
    """The store's memory tier as the planner sees it: LRU, leaf-first, pins, a slot budget.

    Mirrors :class:`kvstore.store.Store` with one memory tier: a fetch touches the loaded chain
    leaf-first (so roots stay newest), a put links its first block to its parent before making
    room, evicts the oldest unpinned leaf per slot, admits fewer blocks when nothing can go and
    drops blocks whose parent is gone.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self.parent: dict[bytes, bytes | None] = {}
        self.children: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}

    def held(self, k: bytes) -> bool:
        return k in self.lru

    def lookup(self, chain: Sequence[bytes]) -> int:
        n = 0
        for k in chain:
            if k not in self.lru:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[bytes]) -> None:
        for k in reversed(keys):
            if k in self.lru:
                self.lru.move_to_end(k)

    def _link(self, k: bytes, parent: bytes | None) -> None:
        self.parent[k] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1

    def _unlink(self, k: bytes) -> None:
        p = self.parent.pop(k)
        if p is not None:
            c = self.children[p] - 1
            if c:
                self.children[p] = c
            else:
                del self.children[p]

    def _evict_one(self) -> bool:
        for k in self.lru:
            if self.pins.get(k) or self.children.get(k):
                continue
            del self.lru[k]
            self._unlink(k)
            return True
        return False

    def _room(self, n: int) -> int:
        if self.capacity is None:
            return n
        free = self.capacity - len(self.lru)
        while free < n and self._evict_one():
            free += 1
        return min(n, free)

    def put(self, chain: Sequence[bytes], first: int) -> int:
        """Put ``chain[first:]`` (the parent of ``chain[first]`` is ``chain[first-1]``)."""
        ks = chain[first:]
        prev = chain[first - 1] if first else None
        new: list[tuple[bytes, bytes | None]] = []
        for k in ks:
            if k in self.lru:
                pass
            elif prev is None or prev in self.lru or (new and new[-1][0] == prev):
                new.append((k, prev))
            else:
                break  # its prefix is gone: lookup could never reach it
            prev = k
        take = 0
        if new:
            k0, p0 = new[0]
            self._link(k0, p0)  # the parent now has a child: not a leaf while room is made
            take = self._room(len(new))
            self._unlink(k0)
            for k, p in new[:take]:
                self.lru[k] = None
                self._link(k, p)
        self.touch(ks)
        return take

    def pin(self, keys: Sequence[bytes]) -> list[bytes]:
        pinned = []
        for k in keys:
            if k not in self.lru:
                break
            self.pins[k] = self.pins.get(k, 0) + 1
            pinned.append(k)
        return pinned

    def unpin(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            c = self.pins.get(k, 0) - 1
            if c > 0:
                self.pins[k] = c
            else:
                self.pins.pop(k, None)


def _usable_blocks(length: int, block_tokens: int) -> int:
    """Blocks a prompt may load: never the last token, whose logits must be computed."""
    return max(0, (length - 1) // block_tokens)


def simulate(
    chains: Sequence[Sequence[bytes]],
    lengths: Sequence[int],
    order: Sequence[int],
    *,
    block_tokens: int,
    budget_blocks: int | None,
    pins: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    groups: Sequence[SharedPrefix] = (),
) -> list[int]:
    """Blocks reused by each step of ``order`` on a cold LRU cache of ``budget_blocks``.

    ``pins[j] = (groups pinned after step j, groups released after step j)``; a group's prefix
    is the first ``blocks`` keys of its first prompt's chain.
    """
    cache = _CacheModel(budget_blocks)
    held: dict[int, list[bytes]] = {}
    reused: list[int] = []
    for j, i in enumerate(order):
        chain = chains[i]
        limit = min(len(chain), _usable_blocks(lengths[i], block_tokens))
        n = cache.lookup(chain[:limit])
        cache.touch(chain[:n])
        cache.put(chain, n)
        reused.append(n)
        if pins is not None:
            pin_now, release_now = pins[j]
            for g in pin_now:
                held[g] = cache.pin(chains[groups[g].first][: groups[g].blocks])
            for g in release_now:
                cache.unpin(held.pop(g, []))
    return reused


# -- planning ------------------------------------------------------------------------------
def _chains_for(
    prompts: Sequence[Sequence[int]],
    block_tokens: int,
    store: Store | None,
    salt: str | bytes | None,
) -> list[list[bytes]]:
    if store is not None:
        return [list(store.block_keys(p, salt)) for p in prompts]
    return [list(_block_keys(_PLAN_NAMESPACE, list(p), block_tokens, salt=salt)) for p in prompts]


def _store_budget(store: Store) -> int:
    st = store.stats()
    return sum(t.capacity_bytes for t in st.tiers if t.name in ("hot", "warm")) // st.block_nbytes


def plan_batch(
    prompts: Sequence[Sequence[int]],
    *,
    block_tokens: int | None = None,
    store: Store | None = None,
    salt: str | bytes | None = None,
    budget_blocks: int | None = -1,
    min_shared_blocks: int = 1,
) -> BatchPlan:
    """Plan ``prompts`` (token id sequences) so that each shared prefix is prefilled once.

    With ``store``, keys and ``block_tokens`` come from it and ``budget_blocks`` defaults to its
    memory tiers' capacity; without, ``block_tokens`` defaults to 16 and the budget to
    unlimited. ``budget_blocks=None`` means unlimited. Groups shorter than
    ``min_shared_blocks`` are not pinned (their prompts still run in tree order).
    """
    if store is not None:
        if block_tokens not in (None, store.layout.block_tokens):
            raise ValueError(
                f"block_tokens={block_tokens} but the store's layout has "
                f"{store.layout.block_tokens}"
            )
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
    lengths = [len(p) for p in prompts]
    if any(n == 0 for n in lengths):
        raise ValueError("every prompt needs at least one token")
    chains = _chains_for(prompts, T, store, salt)
    root = _build_tree(chains)

    # depth-first: a node's own prompts (those whose full blocks end there) first, then its
    # children in arrival order
    order: list[int] = []
    group_nodes: list[tuple[_Node, int]] = []  # (node, parent group)
    innermost: dict[int, int] = {}
    stack: list[tuple[_Node, int]] = [(root, -1)]
    while stack:
        node, parent_group = stack.pop()
        g = parent_group
        # where the prompts through this node part (or some end): the longest prefix common
        # to exactly this set of prompts
        branching = len(node.children) + len(node.ends) >= 2
        if node.depth >= min_shared_blocks and len(node.prompts) >= 2 and branching:
            g = len(group_nodes)
            group_nodes.append((node, parent_group))
        # prompts that end here on a block boundary first: one that ran after the block was
        # cached would recompute it anyway (its last token must be computed)
        for i in sorted(node.ends, key=lambda i: lengths[i] % T != 0):
            order.append(i)
            innermost[i] = g
        for child in reversed(node.children.values()):
            stack.append((child, g))

    pos = {p: j for j, p in enumerate(order)}
    groups = tuple(
        SharedPrefix(
            group=gi, blocks=node.depth,
            prompts=tuple(sorted(node.prompts, key=pos.__getitem__)), parent=parent,
            saved_tokens=(len(node.prompts) - 1) * node.depth * T,
        )
        for gi, (node, parent) in enumerate(group_nodes)
    )
    pin_after: dict[int, list[int]] = {}
    release_after: dict[int, list[int]] = {}
    for g in groups:
        pin_after.setdefault(g.first, []).append(g.group)
        release_after.setdefault(g.last, []).append(g.group)
    pins = [(tuple(pin_after.get(i, ())), tuple(sorted(release_after.get(i, ()), reverse=True)))
            for i in order]
    reused = simulate(chains, lengths, order, block_tokens=T, budget_blocks=budget_blocks,
                      pins=pins, groups=groups)
    arrival = simulate(chains, lengths, range(len(prompts)), block_tokens=T,
                       budget_blocks=budget_blocks)
    steps = tuple(
        PlanStep(prompt=i, group=innermost[i], reuse_blocks=r, compute_tokens=lengths[i] - r * T,
                 pin_after=pins[j][0], release_after=pins[j][1])
        for j, (i, r) in enumerate(zip(order, reused, strict=True))
    )
    naive = sum(lengths)
    return BatchPlan(
        block_tokens=T, budget_blocks=budget_blocks, num_prompts=len(prompts), groups=groups,
        steps=steps, naive_tokens=naive, planned_tokens=sum(s.compute_tokens for s in steps),
        arrival_tokens=naive - T * sum(arrival),
    )


# -- running -------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class BatchRunResult:
    """What :meth:`BatchRunner.run` did; ``outputs[i]`` belongs to prompt ``i`` of the batch."""

    order: tuple[int, ...]
    outputs: tuple[Any, ...]  # PrefillResult or GenerationResult per prompt (batch order)
    prompt_tokens: int
    computed_tokens: int  # tokens the model actually computed
    reused_tokens: int
    seconds: float

    @property
    def next_tokens(self) -> tuple[int, ...]:
        return tuple(getattr(o, "prefill", o).next_token for o in self.outputs)


class BatchRunner:
    """Execute a :class:`BatchPlan` through a :class:`PrefixCachedModel`.

    Each step prefills (or, with ``max_new_tokens``, greedily generates) one prompt, waits for
    its new blocks to be stored, then pins the prefixes of the groups the step opened and
    releases the groups it closed.
    """

    def __init__(self, model: PrefixCachedModel) -> None:
        self.model = model
        self.store = model.store

    def run(
        self,
        plan: BatchPlan,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 0,
        order: str = "planned",
        salt: str | bytes | None = None,
        progress: Callable[[], object] | None = None,
    ) -> BatchRunResult:
        """Run ``prompts`` in the plan's order (``order="arrival"``: batch order, no pins;
        ``"naive"``: batch order without the cache)."""
        if len(prompts) != plan.num_prompts:
            raise ValueError(f"the plan is for {plan.num_prompts} prompts, got {len(prompts)}")
        if plan.block_tokens != self.store.layout.block_tokens:
            raise ValueError("the plan was made for another block size than the store's")
        if order not in ("planned", "arrival", "naive"):
            raise ValueError(f"order must be 'planned', 'arrival' or 'naive', got {order!r}")
        if order == "planned":
            steps: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]] = [
                (s.prompt, s.pin_after, s.release_after) for s in plan.steps]
        else:
            steps = [(i, (), ()) for i in range(plan.num_prompts)]
        use_cache = order != "naive"
        receipts: dict[int, Any] = {}
        outputs: list[Any] = [None] * plan.num_prompts
        computed = reused = 0
        t0 = time.perf_counter()
        try:
            for i, pin_now, release_now in steps:
                p = prompts[i]
                if max_new_tokens:
                    out = self.model.generate(p, max_new_tokens, salt=salt, use_cache=use_cache)
                    pre = out.prefill
                else:
                    out = pre = self.model.prefill(p, salt=salt, use_cache=use_cache)
                if pre.put is not None:
                    pre.put.wait()
                outputs[i] = out
                computed += pre.computed_tokens
                reused += pre.cached_tokens
                if pin_now or release_now:
                    keys = self.store.block_keys(p, salt)
                    for g in pin_now:
                        receipts[g] = self.store.pin(keys[: plan.groups[g].blocks])
                    for g in release_now:
                        r = receipts.pop(g, None)
                        if r is not None:
                            r.release()
                if progress is not None:
                    progress()
        finally:
            for r in receipts.values():
                r.release()
        return BatchRunResult(
            order=tuple(i for i, _, _ in steps), outputs=tuple(outputs),
            prompt_tokens=sum(len(p) for p in prompts), computed_tokens=computed,
            reused_tokens=reused, seconds=time.perf_counter() - t0,
        )
