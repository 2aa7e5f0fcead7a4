"""Per-put hints: what an engine knows about a request that an eviction order may use.

A hint never changes what is stored or returned, only where the put's new blocks start in the
memory tiers' eviction order (:mod:`kvstore.tiers.admission`): a wrong hint costs hits, never
correctness. Torch-free: the daemon's wire path and clients use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["MAX_PRIORITY", "MAX_SESSION_CHARS", "MIN_PRIORITY", "PutHint", "check_hint", "hint_of"]

#: the priority range (negative: background work, evicted first; positive: kept as if used)
MIN_PRIORITY = -1
MAX_PRIORITY = 3
#: longest session id accepted (a cache salt, a conversation id, a user id)
MAX_SESSION_CHARS = 256


@dataclass(frozen=True, slots=True)
class PutHint:
    """What a put's request is, for the eviction order.

    ``session``: the conversation (or agent run, or batch job) the request belongs to. A
    session whose request *branches* off its previous one instead of extending it (a batch job's
    next prompt, the next question on a document) has its new blocks start on probation, at
    the victim end: such blocks are rarely asked for again, while a conversation's next turn
    re-sends everything the previous one stored. ``priority``: ``-1`` background work (a batch
    job, an offline scan): the new blocks start on probation; ``0`` the default; ``1..3`` the
    new blocks start as if used that many times (under the reuse-ranking policies, ``adaptive``
    and ``reuse``; ``lru`` ignores it).
    """

    session: str | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        s = self.session
        if s is not None and (not isinstance(s, str) or not s or len(s) > MAX_SESSION_CHARS):
            raise ConfigError(f"PutHint.session must be None or a non-empty str of at most "
                              f"{MAX_SESSION_CHARS} characters, got {s!r:.60}")
        p = self.priority
        if isinstance(p, bool) or not isinstance(p, int) or not MIN_PRIORITY <= p <= MAX_PRIORITY:
            raise ConfigError(f"PutHint.priority must be an int in [{MIN_PRIORITY}, "
                              f"{MAX_PRIORITY}] (-1 background, 0 default, 1-3 keep longer), "
                              f"got {p!r:.60}")


def hint_of(session: str | None, priority: int) -> PutHint | None:
    """The hint of a put carried as two plain fields (a wire message, a vLLM save run): None
    when both are at their defaults."""
    if session is None and not priority:
        return None
    return PutHint(session, priority)


def check_hint(hint: object) -> None:
    """A put's ``hint`` is None or a :class:`PutHint` (else :class:`ConfigError`)."""
    if hint is not None and not isinstance(hint, PutHint):
        raise ConfigError(f"hint must be None or a kvstore.PutHint, got {type(hint).__name__}")
