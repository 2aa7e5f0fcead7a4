"""``Router``: ``route(token_ids | keys, loads) -> Route``, over a :class:`PrefixIndex`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.events.types import BlockHash
from kvstore.keys import KeyChain, block_keys
from kvstore.namespace import Namespace
from kvstore.routing.index import PrefixIndex
from kvstore.routing.loads import LoadTracker
from kvstore.routing.policies import Policy, make_policy


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes and what the router expects it to find there."""

    engine: str
    mode: str  # "exploit", "explore", "round-robin", "hash"
    blocks: int  # full blocks in the request
    cached_blocks: int  # of them, the leading run the chosen engine holds (per the index)
    best_cached_blocks: int  # the longest leading run any candidate holds


def _as_keys(request: object) -> list[BlockHash] | None:
    """``request`` as block hashes, or ``None`` if it is token ids."""
    if isinstance(request, KeyChain):
        return request
    if isinstance(request, list) and (not request or isinstance(request[0], bytes)):
        return request  # read only, never kept: no copy (a 128k-token prompt is 8k keys)
    if isinstance(request, tuple) and (not request or isinstance(request[0], bytes)):
        return list(request)  # empty: no full block, whatever it was meant to be
    return None


class Router:
    """Routes requests among ``engines`` with ``policy`` (a :class:`Policy` or
    ``"prefix"``, ``"round-robin"``, ``"hash"``).

    ``namespace`` lets ``route`` take token ids (keyed like the engines' stores key them);
    ``live`` (e.g. ``Subscriber.live_engines``) narrows the candidates to engines in step with
    their publishers (all of ``engines`` when none is). Without ``loads``, ``route`` weighs
    the tokens it sent each engine in the last ``load_window_s`` seconds.
    """

    def __init__(self, engines: Sequence[str], index: PrefixIndex | None = None,
                 policy: Policy | str = "prefix", *, namespace: Namespace | None = None,
                 block_tokens: int | None = None,
                 live: Callable[[], Sequence[str]] | None = None,
                 load_window_s: float = 180.0) -> None:
        if not engines:
            raise ConfigError("a router needs at least one engine")
        if len(set(engines)) != len(engines):
            raise ConfigError("engine names must be unique")
        if block_tokens is None:
            block_tokens = namespace.layout.block_tokens if namespace is not None else 16
        if isinstance(policy, str):
            policy = make_policy(policy, block_tokens=block_tokens)
        if policy.uses_index and index is None:
            raise ConfigError(f"the {policy.name} policy needs a PrefixIndex")
        self.engines = tuple(engines)
        self.index = index
        self.policy = policy
        self.namespace = namespace
        self.block_tokens = block_tokens
        self.live = live
        self.tracker = LoadTracker(load_window_s)

    def keys(self, token_ids: object, salt: str | bytes | None = None) -> KeyChain:
        if self.namespace is None:
            raise ConfigError("routing token ids needs the router's namespace "
                              "(Router(..., namespace=...)); or pass block keys")
        return block_keys(self.namespace.id, token_ids, self.namespace.layout.block_tokens,
                          salt=salt)

    def candidates(self) -> tuple[str, ...]:
        if self.live is None:
            return self.engines
        alive = set(self.live())
        return tuple(e for e in self.engines if e in alive) or self.engines

    def route(self, request: object, loads: Mapping[str, float] | None = None, *,
              salt: str | bytes | None = None, now: float | None = None) -> Route:
        """The engine for ``request`` (block keys, or token ids with a namespace).

        ``loads``: each engine's current work in tokens (missing engines count 0); without it
        the router's own record of what it sent where is used, and this request is added to it.
        """
        keys = _as_keys(request)
        if keys is None:
            keys = self.keys(request, salt)
        return self.route_keys(keys, loads, now=now)

    def route_keys(self, keys: Sequence[BlockHash], loads: Mapping[str, float] | None = None,
                   *, now: float | None = None) -> Route:
        """:meth:`route` for block hashes of any kind (kvstore's keys, vLLM's integers)."""
        engines = self.candidates()
        if self.policy.uses_index and keys:
            assert self.index is not None
            cached = self.index.match(keys, engines).blocks
        else:
            cached = (0,) * len(engines)
        if loads is None:
            load = self.tracker.loads(engines, now)
        else:
            load = [float(loads.get(e, 0.0)) for e in engines]
        choice = self.policy.choose(keys, engines, cached, load)
        i = choice.index
        n = len(keys)
        if loads is None:
            self.tracker.add(engines[i], (n - cached[i]) * self.block_tokens, now)
        return Route(engines[i], choice.mode, n, cached[i], max(cached, default=0))
