"""Synthetic trace families, Mooncake format, one seed each: workloads to check that an
eviction policy is not fitted to one trace (``kvstore replay --generate FAMILY``).

Every family is deterministic per ``(requests, seed)`` and builds block ids along the prefix
tree (equal ids = equal prefixes), 512 tokens a block as Mooncake's ``hash_ids``. Arrivals
are a Poisson process of *sessions*; a session's later requests come back after its own
think time (an event queue), so sessions interleave as on a busy service. Each request
carries its session id (``session`` in the JSONL, an extra field Mooncake's loaders ignore),
what a per-put hint can use (:class:`~kvstore.hints.PutHint`).

* ``chat``: multi-turn chat with shared system prompts and documents
  (:mod:`kvstore.replay.workloads`).
* ``mooncake``: the mix the Mooncake paper describes: multi-turn conversations under a few
  shared system prompts, long documents (Zipf popularity, many read once) asked several
  questions, each a branch off the document, and one-off long prompts.
* ``rag``: a pool of documents with Zipf popularity; a request is a system prompt, one to
  three retrieved documents (most popular first) and a unique question.
* ``agentic``: tool loops: one growing context (tool system prompt, task, then a step of tool
  output and action appended per call) re-sent every few seconds, sometimes forked into a
  sub-agent or retried from an earlier step.
* ``batch``: interactive chat mixed with batch jobs: one-time scans of unique prompts under a
  shared instruction, and re-runs of a few fixed evaluation sets (the same prompts in the
  same order: a loop).
"""

from __future__ import annotations

import heapq
import json
import os
import random
from bisect import bisect
from collections.abc import Callable
from itertools import accumulate
from pathlib import Path

from kvstore.replay.trace import MOONCAKE_BLOCK_TOKENS, Request, Trace


class _Ids:
    """Block ids of a prefix tree: the same (parent, content) is the same id."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def extend(self, chain: tuple[int, ...], contents: list[object]) -> tuple[int, ...]:
        out = list(chain)
        ids = self._ids
        for c in contents:
            key = (out[-1] if out else -1, c)
            got = ids.get(key)
            if got is None:
                got = ids[key] = len(ids)
            out.append(got)
        return tuple(out)


class _Zipf:
    """Ranks ``0..n-1`` drawn with weight ``1 / (rank + 1) ** s``."""

    def __init__(self, n: int, s: float) -> None:
        self._cum = list(accumulate(1.0 / (i + 1) ** s for i in range(n)))

    def __call__(self, rng: random.Random) -> int:
        return min(bisect(self._cum, rng.random() * self._cum[-1]), len(self._cum) - 1)


class _Sessions:
    """An event queue of sessions: a new one every ``1 / rate`` seconds on average, each
    step of a live one at the time it asked for; requests in time order."""

    def __init__(self, rng: random.Random, rate_per_s: float) -> None:
        self.rng = rng
        self._rate = rate_per_s
        self._q: list[tuple[float, int, object]] = []
        self._seq = 0
        self._next_new = rng.expovariate(rate_per_s)
        self.sessions = 0

    def later(self, t: float, state: object) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, state))

    def next(self) -> tuple[float, object | None]:
        """(time, a session's state), or (time, None) for a new session."""
        if self._q and self._q[0][0] <= self._next_new:
            t, _, state = heapq.heappop(self._q)
            return t, state
        t = self._next_new
        self._next_new = t + self.rng.expovariate(self._rate)
        self.sessions += 1
        return t, None


def _req(t: float, chain: tuple[int, ...], session: int) -> Request:
    return Request(int(t * 1000), len(chain) * MOONCAKE_BLOCK_TOKENS, 0, chain, session)


def _lognormal(rng: random.Random, median: float, sigma: float = 1.0) -> float:
    return rng.lognormvariate(0.0, sigma) * median


def _geometric(rng: random.Random, mean: float) -> int:
    """1, 2, ... with the given mean."""
    n = 1
    p = 1.0 / mean
    while rng.random() > p:
        n += 1
    return n


def mooncake(requests: int = 4_000, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    ids = _Ids()
    q = _Sessions(rng, 1.6)
    sys_len = [rng.randint(3, 10) for _ in range(8)]
    sys_pick = _Zipf(8, 1.2)
    docs = 6_000
    doc_len = [rng.randint(16, 80) for _ in range(docs)]
    doc_pick = _Zipf(docs, 0.9)
    out: list[Request] = []
    uniq = 0
    while len(out) < requests:
        t, st = q.next()
        if st is None:
            sid = q.sessions
            s = sys_pick(rng)
            base = ids.extend((), [("sys", s, i) for i in range(sys_len[s])])
            kind = rng.random()
            if kind < 0.45:  # conversation: the turns accumulate
                st = ("chat", sid, base, _geometric(rng, 4.0))
            elif kind < 0.8:  # a document asked several questions, each a branch off it
                d = doc_pick(rng)
                doc = ids.extend(base, [("doc", d, i) for i in range(doc_len[d])])
                st = ("doc", sid, doc, _geometric(rng, 2.5))
            else:  # a one-off long prompt
                st = ("once", sid, base, 1)
        kind, sid, chain, left = st  # type: ignore[misc]
        uniq += 1
        if kind == "once":
            req = ids.extend(chain, [("u", uniq, i) for i in range(rng.randint(8, 60))])
        elif kind == "doc":
            req = ids.extend(chain, [("q", uniq, i) for i in range(rng.randint(1, 2))])
        else:
            req = chain = ids.extend(chain, [("t", uniq, i) for i in range(rng.randint(1, 4))])
        out.append(_req(t, req, sid))
        if left > 1:
            q.later(t + _lognormal(rng, 45.0 if kind == "chat" else 30.0),
                    (kind, sid, chain, left - 1))
    return Trace(tuple(out), f"mooncake-style synthetic (seed {seed})", MOONCAKE_BLOCK_TOKENS)


def rag(requests: int = 4_000, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    ids = _Ids()
    sys_len = [rng.randint(2, 4) for _ in range(3)]
    docs = 5_000
    doc_len = [rng.randint(3, 12) for _ in range(docs)]
    pick = _Zipf(docs, 1.0)
    out: list[Request] = []
    t = 0.0
    for n in range(requests):
        t += rng.expovariate(2.0)
        s = rng.randrange(3)
        chain = ids.extend((), [("sys", s, i) for i in range(sys_len[s])])
        k = 1 if rng.random() < 0.5 else (2 if rng.random() < 0.6 else 3)
        got = sorted({pick(rng) for _ in range(k)})  # most popular first: shared prefixes
        for d in got:
            chain = ids.extend(chain, [("doc", d, i) for i in range(doc_len[d])])
        chain = ids.extend(chain, [("q", n, i) for i in range(rng.randint(1, 2))])
        out.append(_req(t, chain, n + 1))
    return Trace(tuple(out), f"RAG synthetic (seed {seed})", MOONCAKE_BLOCK_TOKENS)


def agentic(requests: int = 4_000, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    ids = _Ids()
    q = _Sessions(rng, 1.0)
    tools = 5
    tool_len = [rng.randint(6, 16) for _ in range(tools)]
    tool_pick = _Zipf(tools, 1.0)
    out: list[Request] = []
    uniq = 0
    while len(out) < requests:
        t, st = q.next()
        if st is None:
            sid = q.sessions
            s = tool_pick(rng)
            chain = ids.extend((), [("tool", s, i) for i in range(tool_len[s])])
            chain = ids.extend(chain, [("task", sid, i) for i in range(rng.randint(2, 8))])
            st = (sid, chain, (), _geometric(rng, 12.0))
        sid, chain, history, left = st  # type: ignore[misc]
        out.append(_req(t, chain, sid))
        uniq += 1
        history = (history + (chain,))[-4:]
        r = rng.random()
        if r < 0.05 and len(history) > 1:  # a retry from an earlier step
            chain = history[-1 - rng.randint(1, len(history) - 1)]
        if left > 1 or r < 0.13:
            step = ids.extend(chain, [("step", uniq, i) for i in range(rng.randint(1, 6))])
            gap = _lognormal(rng, 5.0, 0.8)
            if left > 1:
                q.later(t + gap, (sid, step, history, left - 1))
            if 0.05 <= r < 0.13:  # a fork: a sub-agent off the same context
                sub = ids.extend(chain, [("fork", uniq, i) for i in range(rng.randint(1, 4))])
                q.later(t + _lognormal(rng, 5.0, 0.8), (sid, sub, history,
                                                        _geometric(rng, 4.0)))
    return Trace(tuple(out[:requests]), f"agentic synthetic (seed {seed})",
                 MOONCAKE_BLOCK_TOKENS)


def batch(requests: int = 4_000, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    ids = _Ids()
    q = _Sessions(rng, 0.6)
    sys_len = [rng.randint(3, 8) for _ in range(4)]
    sys_pick = _Zipf(4, 1.2)
    evals = [[rng.randint(8, 20) for _ in range(rng.randint(80, 160))] for _ in range(3)]
    out: list[Request] = []
    uniq = 0
    next_job = rng.expovariate(1 / 240.0)
    job = 0
    while len(out) < requests:
        t, st = q.next()
        if next_job <= t:  # a batch job: its prompts at 8 a second, in order
            job += 1
            jt = next_job
            sid = -job
            if rng.random() < 0.4:  # a one-time scan under a shared instruction
                head = ids.extend((), [("instr", job % 3, i) for i in range(2)])
                for n in range(rng.randint(150, 400)):
                    out.append(_req(jt, ids.extend(head, [("scan", job, n, i) for i in
                                                          range(rng.randint(6, 30))]), sid))
                    jt += 0.125
            else:  # a re-run of an evaluation set: the same prompts, the same order
                e = rng.randrange(len(evals))
                head = ids.extend((), [("eval", e, i) for i in range(3)])
                for n, length in enumerate(evals[e]):
                    out.append(_req(jt, ids.extend(head, [("item", e, n, i) for i in
                                                          range(length)]), sid))
                    jt += 0.125
            next_job = t + rng.expovariate(1 / 240.0)
        if st is None:
            sid = q.sessions
            s = sys_pick(rng)
            chain = ids.extend((), [("sys", s, i) for i in range(sys_len[s])])
            st = (sid, chain, _geometric(rng, 4.0))
        sid, chain, left = st  # type: ignore[misc]
        uniq += 1
        chain = ids.extend(chain, [("t", uniq, i) for i in range(rng.randint(1, 5))])
        out.append(_req(t, chain, sid))
        if left > 1:
            q.later(t + _lognormal(rng, 40.0), (sid, chain, left - 1))
    out.sort(key=lambda r: r.timestamp_ms)
    return Trace(tuple(out[:requests]), f"batch mix with scans, synthetic (seed {seed})",
                 MOONCAKE_BLOCK_TOKENS)


def chat(requests: int = 4_000, seed: int = 0) -> Trace:
    from kvstore.replay.workloads import ChatWorkload, chat_trace

    return chat_trace(ChatWorkload(requests=requests, seed=seed))


#: family name -> generator(requests, seed)
FAMILIES: dict[str, Callable[[int, int], Trace]] = {
    "chat": chat, "mooncake": mooncake, "rag": rag, "agentic": agentic, "batch": batch,
}


def generate(family: str, requests: int = 4_000, seed: int = 0) -> Trace:
    """``requests`` requests of ``family`` (one of :data:`FAMILIES`), deterministic per seed."""
    from kvstore.errors import ConfigError

    make = FAMILIES.get(family)
    if make is None:
        raise ConfigError(f"unknown trace family {family!r}; choose from "
                          f"{', '.join(FAMILIES)}")
    return make(requests, seed)


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """``trace`` as Mooncake-format JSON lines (with each request's ``session`` when known)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in trace.requests:
            obj: dict[str, object] = {"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                      "output_length": r.output_length,
                                      "hash_ids": list(r.hash_ids)}
            if r.session is not None:
                obj["session"] = r.session
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
