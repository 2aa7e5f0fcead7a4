"""Multi-turn chats for ``tools/vllm_bench.py chat``: the ``(answer, next message)`` lengths of
the Mooncake trace's consecutive turns (:func:`trace_chat_turns`), a workload of chats drawn
from them or of fixed lengths (:func:`chat_workload`), and the external hits each turn should
get when only the store serves it (:func:`chat_expected_hits`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.bench.serve_scale import BLOCK

#: a chat turn of the trace kept for the multi-turn run: the user's next message at most this
#: long (the trace's longer "messages" paste documents: p75 421, p90 4,400 tokens)
CHAT_MESSAGE_CAP = 512
#: answers longer than this are cut to it (the trace's p90 is 625, its longest 2,000): the
#: decode steps are most of the run's time on 2 cores
CHAT_ANSWER_CAP = 1024


def trace_chat_turns(src: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """``(answer, next message)`` token lengths of consecutive turns of one conversation in the
    Mooncake trace. Request B continues request A when B's hash ids start with all of A's whole
    512-token blocks (the longest such earlier A) and B is longer: B's new tokens are A's
    answer (A's ``output_length``) and then the user's next message (the rest). A pair whose
    rest is negative (B does not hold A's whole answer: an edit or a regeneration) is left
    out. On the trace: 3,875 follow-up turns of 12,031 requests, 3,548 kept (answers p25 148,
    p50 355, p75 495 tokens); 2,644 of them with a message of at most 512 tokens."""
    rows: list[tuple[int, int, list[int]]] = []
    with open(src) as f:
        for line in f:
            r = json.loads(line)
            rows.append((int(r["input_length"]), int(r["output_length"]), list(r["hash_ids"])))
    last: dict[tuple[int, ...], int] = {}  # A's whole blocks -> the latest such request
    out: list[tuple[int, int]] = []
    for i, (n, _, ids) in enumerate(rows):
        for k in range(len(ids), 1, -1):  # 2 blocks at least: block 0 is a shared prompt
            j = last.get(tuple(ids[:k]))
            if j is None:
                continue
            a_len, a_out, _ = rows[j]
            if a_len // 512 == k and n > a_len and n - a_len - a_out >= 0:
                out.append((a_out, n - a_len - a_out))
            break
        if n // 512 >= 2:
            last[tuple(ids[: n // 512])] = i
    return out


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """A multi-turn workload: ``answers[c][t]`` tokens generated at turn ``t`` of chat ``c``,
    then ``messages[c][t]`` tokens of the user's next message; turn 0's prompt is ``first``
    tokens, turn ``t + 1``'s is turn ``t``'s + its answer + the message."""

    first: int
    answers: tuple[tuple[int, ...], ...]
    messages: tuple[tuple[int, ...], ...]
    source: str

    def prompt_lengths(self, c: int) -> list[int]:
        out = [self.first]
        for a, m in zip(self.answers[c][:-1], self.messages[c][:-1], strict=True):
            out.append(out[-1] + a + m)
        return out

    @property
    def max_len(self) -> int:
        """The longest sequence: the last turn's prompt and its answer."""
        return max(self.prompt_lengths(c)[-1] + self.answers[c][-1]
                   for c in range(len(self.answers)))


def chat_workload(conversations: int, turns: int, first: int, *,
                  pool: Sequence[tuple[int, int]] | None = None, answer: int = 128,
                  message: int = 64, seed: int = 0, message_cap: int = CHAT_MESSAGE_CAP,
                  answer_cap: int = CHAT_ANSWER_CAP, source: str = "") -> ChatWorkload:
    """Fixed lengths (``answer``, ``message``), or, with ``pool`` (:func:`trace_chat_turns`),
    one ``(answer, message)`` pair per turn drawn with ``seed`` from the pairs whose message is
    at most ``message_cap`` tokens, answers cut to ``answer_cap`` (at least 1 token each)."""
    import random

    if pool is None:
        ans = tuple(tuple([answer] * turns) for _ in range(conversations))
        msg = tuple(tuple([message] * turns) for _ in range(conversations))
        return ChatWorkload(first, ans, msg, source or f"fixed: answers {answer}, messages {message}")
    kept = [(a, m) for a, m in pool if m <= message_cap]
    if not kept:
        raise ValueError(f"no turn with a message of at most {message_cap} tokens")
    rnd = random.Random(seed)
    drawn = [[rnd.choice(kept) for _ in range(turns)] for _ in range(conversations)]
    ans = tuple(tuple(max(1, min(a, answer_cap)) for a, _ in row) for row in drawn)
    msg = tuple(tuple(max(1, m) for _, m in row) for row in drawn)
    return ChatWorkload(first, ans, msg, source or "pool")


def chat_expected_hits(w: ChatWorkload, decode_blocks: bool, block: int = BLOCK) -> list[list[int]]:
    """The external hit tokens of every (chat, turn) when nothing but the store serves a turn
    (vLLM's own cache reset before each): turn ``t + 1`` can be served what turn ``t`` saved,
    its prompt's full blocks (prompt only), or the full blocks of its prompt and answer less
    the last answer token, whose KV is never computed (decode blocks); never the whole prompt
    (vLLM computes at least its last token)."""
    out = []
    for c in range(len(w.answers)):
        lens = w.prompt_lengths(c)
        row, stored = [], 0
        for t, n in enumerate(lens):
            row.append(min((n - 1) // block, stored) * block)
            stored = (n + w.answers[c][t] - 1) // block if decode_blocks else n // block
        out.append(row)
    return out
