"""Choosing each sequence's next token and deciding when it stops.

Greedy rows take the arg-max (all at once). A sampled row follows transformers' own order
(temperature, then top-k, then top-p, then a multinomial draw) with its *own*
``torch.Generator`` seeded by the request's seed, so a request samples the same tokens
whatever else shares its batch; for one prompt it draws what ``model.generate(do_sample=True)``
draws after ``torch.manual_seed(seed)`` (same generator, same draws; tested).

A row stops at ``max_tokens``, at the end of the model's context, at an end-of-sequence token
(unless ``ignore_eos``), at one of its ``stop_token_ids`` (both kept in the tokens) or when its
decoded text contains one of its ``stop`` strings (the text is cut before it; tokens up to the
one that completed it are kept), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvstore.integrations.batch.requests import BatchRequest, Completion

__all__ = ["RowState", "Tokenizer", "choose_tokens", "sample_token"]


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class _Finish:
    reason: str
    stop: str | int | None
    text: str | None


class RowState:
    """One sequence being generated: its tokens so far and, once stopped, why."""

    __slots__ = ("request", "index", "prefix_len", "tokens", "generator", "finish", "max_new")

    def __init__(self, request: BatchRequest, index: int, prefix_len: int, *, context: int | None,
                 device: torch.device) -> None:
        self.request = request
        self.index = index  # in the engine's request list
        self.prefix_len = prefix_len  # prompt tokens shared with others (not computed here)
        self.tokens: list[int] = []
        p = request.params
        self.generator: torch.Generator | None = None
        if not p.greedy:
            g = torch.Generator(device=device)
            if p.seed is not None:
                g.manual_seed(p.seed)
            else:
                g.seed()
            self.generator = g
        self.finish: _Finish | None = None
        n = len(request.token_ids)
        # the last token may sit at position context - 1: context - n new tokens at most
        self.max_new = max(1, p.max_tokens if context is None else min(p.max_tokens, context - n))

    @property
    def done(self) -> bool:
        return self.finish is not None

    def add(self, token: int, eos: frozenset[int], tokenizer: Tokenizer | None) -> bool:
        """Append ``token``; True when the row has stopped."""
        self.tokens.append(token)
        p = self.request.params
        if not p.ignore_eos and token in eos:
            self.finish = _Finish("stop", None, None)
        elif token in p.stop_token_ids:
            self.finish = _Finish("stop", token, None)
        elif p.stop and tokenizer is not None:
            text = tokenizer.decode(self.tokens, skip_special_tokens=True)
            hits = [(text.find(s), s) for s in p.stop if s in text]
            if hits:
                at, s = min(hits)
                self.finish = _Finish("stop", s, text[:at])
        if self.finish is None and len(self.tokens) >= self.max_new:
            self.finish = _Finish("length", None, None)
        return self.finish is not None

    def completion(self, tokenizer: Tokenizer | None) -> Completion:
        assert self.finish is not None
        text = self.finish.text
        if text is None and tokenizer is not None:
            text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        r = self.request
        return Completion(custom_id=r.custom_id, token_ids=tuple(self.tokens),
                          finish_reason=self.finish.reason, prompt_tokens=len(r.token_ids),
                          cached_tokens=self.prefix_len, text=text, stop_reason=self.finish.stop)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                 generator: torch.Generator | None) -> int:
    """One draw from ``logits [vocab]`` after temperature, top-k and top-p (transformers'
    warpers, in their order)."""
    scores = (logits.float() / temperature).unsqueeze(0)
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator)[0, 0])


def choose_tokens(logits: torch.Tensor, rows: Sequence[RowState]) -> list[int]:
    """Next token of each row from ``logits [len(rows), vocab]``."""
    out: list[Any] = logits.argmax(dim=-1).tolist()
    for i, r in enumerate(rows):
        p = r.request.params
        if not p.greedy:
            out[i] = sample_token(logits[i], p.temperature, p.top_p, p.top_k, r.generator)
    return out
