"""Routing policies: which engine a request goes to, given what each engine holds and does.

- :class:`PrefixAware`: Preble's E2 rule (exploit / explore) with a load bound;
- :class:`RoundRobin`: the baseline that ignores caches;
- :class:`FirstBlocksHash`: rendezvous hashing of the first blocks' hashes (session
  affinity without an index: requests sharing their first blocks go to the same engine, and
  an engine leaving moves only its own share).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.errors import ConfigError
from kvstore.events.types import BlockHash

EXPLOIT, EXPLORE, ROUND_ROBIN, HASH = "exploit", "explore", "round-robin", "hash"
#: the prefix policy's load band: an engine above (1 + this) x the mean load plus the
#: request's work is passed over (0.2 measured best on the Mooncake trace through real
#: stores, at max/mean load 1.005; docs/benchmarks.md)
DEFAULT_IMBALANCE = 0.2


@dataclass(frozen=True, slots=True)
class Choice:
    index: int  # into the candidate engines
    mode: str


class Policy(Protocol):
    name: str
    uses_index: bool  # whether ``cached`` must be filled in (a match against the index)

    def choose(self, keys: Sequence[BlockHash], engines: Sequence[str], cached: Sequence[int],
               loads: Sequence[float]) -> Choice:
        """``cached[i]``: leading blocks engine ``i`` holds; ``loads[i]``: its recent work in
        tokens. ``engines`` is never empty."""


class RoundRobin:
    name = "round-robin"
    uses_index = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, keys, engines, cached, loads) -> Choice:
        i = self._next % len(engines)
        self._next = i + 1
        return Choice(i, ROUND_ROBIN)


def _hash_bytes(h: BlockHash) -> bytes:
    return h if isinstance(h, bytes) else h.to_bytes(8, "big", signed=h < 0)


class FirstBlocksHash:
    """Rendezvous (highest-random-weight) hashing of the first ``blocks`` block hashes."""

    name = "hash"
    uses_index = False

    def __init__(self, blocks: int = 4) -> None:
        if blocks < 1:
            raise ConfigError("the hash policy needs blocks >= 1")
        self.blocks = blocks

    def choose(self, keys, engines, cached, loads) -> Choice:
        return Choice(rendezvous(keys, self.blocks, engines, range(len(engines))), HASH)


def rendezvous(keys: Sequence[BlockHash], blocks: int, engines: Sequence[str],
               among: Sequence[int] | range) -> int:
    """The index (one of ``among``) of the engine with the highest rendezvous score for the
    first ``blocks`` block hashes of ``keys``: the same prompt head always gets the same
    engine, and removing an engine moves only the heads it had."""
    head = b"".join(_hash_bytes(k) for k in keys[:blocks])
    best, best_score = among[0], b""
    for i in among:
        score = hashlib.blake2b(head + engines[i].encode(), digest_size=8).digest()
        if score > best_score:
            best, best_score = i, score
    return best


class PrefixAware:
    """Preble's E2 (exploit / explore) within a load band.

    Candidates are the engines whose recent load is at most ``(1 + imbalance)`` times the
    mean plus this request's work on them (all of them when none is: the request's own work
    is the slack that keeps a nearly idle fleet from flapping). Among them the request goes
    to the one with the least work for it, i.e. the longest cached prefix, the least loaded
    on ties. It **exploits** when that prefix is longer than what is left to compute
    (Preble's test), else it **explores**. A prompt no candidate holds any of goes to its
    rendezvous **home** among the candidates (the first ``home_blocks`` block hashes, as the
    ``hash`` policy): the next prompt with the same head (a conversation's next turn after
    its blocks left, another question on the same document) finds what that engine kept of
    it, where a least-loaded choice would scatter them. Preble's own explore step minimises
    load + work instead; on the Mooncake conversation trace that loses partial hits
    (docs/integrations.md has the figures). ``block_tokens``: the tokens of work a block
    stands for (loads are in tokens).
    """

    name = "prefix"
    uses_index = True

    def __init__(self, block_tokens: int, *, imbalance: float = DEFAULT_IMBALANCE,
                 home_blocks: int = 4) -> None:
        if block_tokens < 1:
            raise ConfigError("block_tokens must be >= 1")
        if imbalance < 0:
            raise ConfigError("imbalance must be >= 0")
        if home_blocks < 1:
            raise ConfigError("home_blocks must be >= 1")
        self.block_tokens = block_tokens
        self.imbalance = imbalance
        self.home_blocks = home_blocks

    def choose(self, keys, engines, cached, loads) -> Choice:
        n = len(keys)
        bound = (1 + self.imbalance) * sum(loads) / len(loads)
        bt = self.block_tokens
        i = best = -1
        for j, w in enumerate(loads):  # the longest prefix in the band, least loaded on ties
            if w <= bound + (n - cached[j]) * bt:
                c = cached[j]
                if c > best or (c == best and w < loads[i]):
                    i, best = j, c
        if i < 0:  # nobody in the band (cannot happen with loads >= 0): all are candidates
            i = min(range(len(engines)), key=lambda j: (-cached[j], loads[j], j))
            best = cached[i]
        if best == 0 and n:  # no candidate holds any of it: its home among the candidates
            band = [j for j, w in enumerate(loads) if w <= bound + (n - cached[j]) * bt]
            i = rendezvous(keys, self.home_blocks, engines, band or range(len(engines)))
        return Choice(i, EXPLOIT if cached[i] and cached[i] > n - cached[i] else EXPLORE)


def make_policy(name: str, *, block_tokens: int = 16, hash_blocks: int = 4,
                imbalance: float = DEFAULT_IMBALANCE) -> Policy:
    """A policy by name: ``"prefix"``, ``"round-robin"`` or ``"hash"``."""
    if name == "prefix":
        return PrefixAware(block_tokens, imbalance=imbalance, home_blocks=hash_blocks)
    if name == "round-robin":
        return RoundRobin()
    if name == "hash":
        return FirstBlocksHash(hash_blocks)
    raise ConfigError(f"unknown routing policy {name!r}; choose prefix, round-robin or hash")
