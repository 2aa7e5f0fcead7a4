"""A second workload, of our own making, to check a policy is not fitted to one trace:
multi-turn chat with shared system prompts and shared documents.

Conversations arrive as a Poisson process. Each starts from one of a few system prompts
(Zipf popularity), may attach one of a pool of documents (Zipf: a few are hot, most are
read once), and runs a geometric number of turns; each turn appends the user's message and
the model's answer and comes back after a log-normal think time. Block ids follow the
prefix tree (equal ids = equal prefixes), in the Mooncake format's ``hash_ids``; each request
carries its conversation as its ``session``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.replay.trace import MOONCAKE_BLOCK_TOKENS, Request, Trace


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Shape of the synthetic chat workload (defaults: about one hour of a busy service)."""

    requests: int = 12_000
    seed: int = 0
    rate_per_s: float = 1.3  # new conversations per second
    system_prompts: int = 6
    system_blocks: tuple[int, int] = (2, 12)  # length range of a system prompt, in blocks
    documents: int = 3_000
    document_share: float = 0.35  # conversations that attach a document
    document_blocks: tuple[int, int] = (4, 40)
    mean_turns: float = 3.0
    turn_blocks: tuple[int, int] = (1, 6)  # blocks a turn (question + answer) adds
    think_median_s: float = 60.0
    zipf: float = 1.1


class _Tree:
    """Ids of prefix blocks: the same (parent, content) is the same id."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, object], int] = {}

    def extend(self, chain: list[int], contents: list[object]) -> list[int]:
        out = list(chain)
        for c in contents:
            key = (out[-1] if out else -1, c)
            got = self.ids.get(key)
            if got is None:
                got = self.ids[key] = len(self.ids)
            out.append(got)
        return out


def _zipf_index(rng: np.random.Generator, n: int, s: float) -> int:
    w = 1.0 / np.arange(1, n + 1) ** s
    return int(rng.choice(n, p=w / w.sum()))


def chat_trace(w: ChatWorkload | None = None) -> Trace:
    """The synthetic chat workload as a :class:`Trace` (deterministic per ``seed``)."""
    w = w or ChatWorkload()
    rng = np.random.default_rng(w.seed)
    tree = _Tree()
    sys_len = rng.integers(w.system_blocks[0], w.system_blocks[1] + 1, w.system_prompts)
    doc_len = rng.integers(w.document_blocks[0], w.document_blocks[1] + 1, w.documents)
    sys_w = 1.0 / np.arange(1, w.system_prompts + 1) ** w.zipf
    doc_w = 1.0 / np.arange(1, w.documents + 1) ** w.zipf
    # (time s, seq, chain, turns left, conversation)
    events: list[tuple[float, int, list[int], int, int]] = []
    t = 0.0
    seq = conv = 0
    out: list[Request] = []
    import heapq

    while len(out) < w.requests:
        t_new = t + rng.exponential(1.0 / w.rate_per_s)
        if events and events[0][0] <= t_new:
            t, _, chain, left, sid = heapq.heappop(events)
        else:
            t = t_new
            s = int(rng.choice(w.system_prompts, p=sys_w / sys_w.sum()))
            chain = tree.extend([], [("sys", s, i) for i in range(int(sys_len[s]))])
            if rng.random() < w.document_share:
                d = int(rng.choice(w.documents, p=doc_w / doc_w.sum()))
                chain = tree.extend(chain, [("doc", d, i) for i in range(int(doc_len[d]))])
            left = int(rng.geometric(1.0 / w.mean_turns))
            conv += 1
            sid = conv
        seq += 1
        add = int(rng.integers(w.turn_blocks[0], w.turn_blocks[1] + 1))
        chain = tree.extend(chain, [("turn", seq, i) for i in range(add)])
        n_tok = len(chain) * MOONCAKE_BLOCK_TOKENS
        out.append(Request(int(t * 1000), n_tok, 0, tuple(chain), sid))
        if left > 1:
            think = float(rng.lognormal(np.log(w.think_median_s), 1.0))
            heapq.heappush(events, (t + think, seq, chain, left - 1, sid))
    return Trace(tuple(out), f"synthetic chat (seed {w.seed})", MOONCAKE_BLOCK_TOKENS)
