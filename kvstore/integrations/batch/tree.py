"""The prefix tree of a batch: prompts' block-key chains as a tree, its shared prefixes, and
the token-level lower bound of what any execution must compute.

Each prompt's full blocks are keyed by content (the store's chained block keys); the keys of
all prompts form a tree whose root-to-node paths are the block prefixes that occur in the
batch, each node counting the prompts through it. A node that at least two prompts pass
through and where they part (or where one of them ends) is a *shared prefix*: the longest
block prefix common to exactly that set of prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["TreeWalk", "build_tree", "common_prefix_len", "unique_tokens", "walk"]


class Node:
    """One block of the tree: the prompts through it and those whose full blocks end here."""

    __slots__ = ("key", "depth", "children", "prompts", "ends")

    def __init__(self, key: bytes | None, depth: int) -> None:
        self.key = key
        self.depth = depth
        self.children: dict[bytes, Node] = {}  # insertion order = first arrival
        self.prompts: list[int] = []  # prompts whose chain passes through (or ends at) this node
        self.ends: list[int] = []  # prompts whose chain ends here


def build_tree(chains: Sequence[Sequence[bytes]]) -> Node:
    """The tree of ``chains`` (one block-key chain per prompt); the root has depth 0."""
    root = Node(None, 0)
    for i, chain in enumerate(chains):
        node = root
        node.prompts.append(i)
        for k in chain:
            nxt = node.children.get(k)
            if nxt is None:
                nxt = node.children[k] = Node(k, node.depth + 1)
            nxt.prompts.append(i)
            node = nxt
        node.ends.append(i)
    return root


@dataclass(frozen=True, slots=True)
class TreeWalk:
    """A depth-first walk: execution order, shared-prefix nodes (parents before children)."""

    order: tuple[int, ...]  # prompts, depth-first
    groups: tuple[tuple[Node, int], ...]  # (node, index of the enclosing group or -1)
    innermost: tuple[int, ...]  # innermost group of each prompt (batch index), -1 if none


def walk(root: Node, lengths: Sequence[int], block_tokens: int, min_shared_blocks: int) -> TreeWalk:
    """Depth first: a node's own prompts (whose full blocks end there) first, then its
    children in arrival order; groups of at least ``min_shared_blocks`` blocks."""
    T = block_tokens
    order: list[int] = []
    groups: list[tuple[Node, int]] = []
    innermost = [-1] * len(lengths)
    stack: list[tuple[Node, int]] = [(root, -1)]
    while stack:
        node, parent_group = stack.pop()
        g = parent_group
        # where the prompts through this node part (or some end): the longest prefix common
        # to exactly this set of prompts
        branching = len(node.children) + len(node.ends) >= 2
        if node.depth >= min_shared_blocks and len(node.prompts) >= 2 and branching:
            g = len(groups)
            groups.append((node, parent_group))
        # prompts that end here on a block boundary first: one that ran after the block was
        # cached would recompute it anyway (its last token must be computed)
        for i in sorted(node.ends, key=lambda i: lengths[i] % T != 0):
            order.append(i)
            innermost[i] = g
        for child in reversed(node.children.values()):
            stack.append((child, g))
    return TreeWalk(order=tuple(order), groups=tuple(groups), innermost=tuple(innermost))


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def unique_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens of the batch's token-level prefix tree: what any execution must compute at
    least (a token shared by several prompts' identical prefixes counted once)."""
    ps = sorted(tuple(p) for p in prompts)
    total = sum(len(p) for p in ps)
    return total - sum(common_prefix_len(a, b) for a, b in zip(ps, ps[1:], strict=False))
