"""From a plan to the work of a token-batched engine: prefix nodes and packed batches.

Each shared prefix of the plan becomes a :class:`PrefixNode` of its token-level length
(:attr:`SharedPrefix.shared_tokens`); a nested prefix that adds nothing to its parent's is
folded into it. Every prompt then runs as one *row*: its suffix after its innermost node's
prefix. :func:`pack` cuts the rows, in plan order, into :class:`Batch` es of at most
``max_tokens`` suffix tokens and ``max_rows`` rows, holding at most ``max_prefix_tokens`` of
shared prefix at a time, so several small groups share one forward (token batching) and a
large group spans several.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.integrations.batch.plan import BatchPlan

__all__ = ["Batch", "PrefixNode", "Row", "Schedule", "pack", "schedule"]


@dataclass(frozen=True, slots=True)
class PrefixNode:
    """A shared prefix computed once: ``prefix_len`` tokens of prompt ``source``."""

    node: int
    parent: int  # -1: none
    prefix_len: int
    source: int  # a prompt that starts with the prefix
    rows: int  # prompts whose suffix starts right after it
    children: int  # nodes whose prefix extends it


@dataclass(frozen=True, slots=True)
class Row:
    """One prompt as the engine runs it: its suffix after ``node``'s prefix (-1: the whole).
    ``long``: its tokens take longrope's long factors (:mod:`.rope`)."""

    prompt: int
    node: int
    prefix_len: int
    long: bool = False


@dataclass(frozen=True, slots=True)
class Schedule:
    nodes: tuple[PrefixNode, ...]  # parents before children
    rows: tuple[Row, ...]  # plan order


@dataclass(frozen=True, slots=True)
class Batch:
    """Rows that prefill together and then decode together (sorted by node)."""

    rows: tuple[Row, ...]
    nodes: tuple[int, ...]  # the prefix nodes the rows attend to


def schedule(plan: BatchPlan, lengths: Sequence[int]) -> Schedule:
    """The prefix nodes and rows of ``plan`` (for prompts of ``lengths``)."""
    node_of_group: list[int] = []
    found: list[tuple[int, int, int]] = []  # (parent node, prefix_len, source)
    for g in plan.groups:
        parent = node_of_group[g.parent] if g.parent >= 0 else -1
        parent_len = found[parent][1] if parent >= 0 else 0
        if g.shared_tokens <= parent_len:  # adds nothing: the parent's rows take its prompts
            node_of_group.append(parent)
            continue
        node_of_group.append(len(found))
        found.append((parent, g.shared_tokens, g.first))
    rows = tuple(
        Row(prompt=s.prompt, node=node_of_group[s.group] if s.group >= 0 else -1,
            prefix_len=found[node_of_group[s.group]][1]
            if s.group >= 0 and node_of_group[s.group] >= 0 else 0)
        for s in plan.steps
    )
    n_rows = [0] * len(found)
    n_children = [0] * len(found)
    for r in rows:
        if r.node >= 0:
            n_rows[r.node] += 1
    for parent, _, _ in found:
        if parent >= 0:
            n_children[parent] += 1
    if any(r.prefix_len >= lengths[r.prompt] for r in rows):
        raise ValueError("a prefix node covers a whole prompt: the plan is not for these prompts")
    nodes = tuple(PrefixNode(node=i, parent=p, prefix_len=n, source=src, rows=n_rows[i],
                             children=n_children[i]) for i, (p, n, src) in enumerate(found))
    return Schedule(nodes=nodes, rows=rows)


def pack(sched: Schedule, lengths: Sequence[int], *, max_tokens: int, max_rows: int,
         max_prefix_tokens: int) -> Iterator[Batch]:
    """The rows of ``sched`` in plan order, cut into batches (each at least one row)."""
    if max_tokens < 1 or max_rows < 1:
        raise ValueError("max_tokens and max_rows must be >= 1")
    rows: list[Row] = []
    nodes: dict[int, None] = {}
    tokens = prefix = 0
    for r in sched.rows:
        n = lengths[r.prompt] - r.prefix_len
        new_prefix = r.prefix_len if r.node >= 0 and r.node not in nodes else 0
        # a row adding no prefix (its node's is in the batch, or it has none) fits any prefix
        # budget: checking it too cut a batch per row once one prefix was over the budget
        full = (tokens + n > max_tokens or len(rows) + 1 > max_rows
                or new_prefix > 0 and prefix + new_prefix > max_prefix_tokens)
        if rows and full:
            yield _batch(rows, nodes)
            rows, nodes, tokens, prefix = [], {}, 0, 0
            new_prefix = r.prefix_len if r.node >= 0 else 0
        rows.append(r)
        if r.node >= 0:
            nodes[r.node] = None
        tokens += n
        prefix += new_prefix
    if rows:
        yield _batch(rows, nodes)


def _batch(rows: list[Row], nodes: dict[int, None]) -> Batch:
    order = {n: i for i, n in enumerate(nodes)}
    # rows of one node side by side (a forward's tokens are grouped by prefix); stable sort
    # keeps plan order within a node
    ranked = sorted(rows, key=lambda r: -1 if r.node < 0 else order[r.node])
    return Batch(rows=tuple(ranked), nodes=tuple(nodes))
