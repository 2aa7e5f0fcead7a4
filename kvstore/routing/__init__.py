"""Prefix-aware routing across engines, on their KV events.

- :class:`PrefixIndex` (:mod:`~kvstore.routing.index`): which engine holds which prefix;
- :class:`Subscriber` (:mod:`~kvstore.routing.subscriber`): N publishers' event streams into
  one index, with gap detection, replay, snapshots and engines falling out when silent
  (:mod:`~kvstore.routing.feed`);
- :class:`Router` (:mod:`~kvstore.routing.router`): ``route(token_ids | keys, loads)`` with a
  policy (:mod:`~kvstore.routing.policies`): Preble's exploit/explore rule, round-robin, or
  first-blocks hashing;
- :mod:`~kvstore.routing.simulate`: the policies on a request trace, N LRU engines.

See docs/integrations.md, "Routing across engines".
"""

from kvstore.routing.feed import FeedStats
from kvstore.routing.index import Matches, PrefixIndex
from kvstore.routing.policies import FirstBlocksHash, Policy, PrefixAware, RoundRobin, make_policy
from kvstore.routing.router import Route, Router
from kvstore.routing.subscriber import EngineSpec, Subscriber

__all__ = [
    "EngineSpec", "FeedStats", "FirstBlocksHash", "Matches", "Policy", "PrefixAware",
    "PrefixIndex", "RoundRobin", "Route", "Router", "Subscriber", "make_policy",
]
