"""Mooncake-format request traces: loading, and the blocks and tokens a store sees for them.

One request per line, JSON: ``timestamp`` (ms), ``input_length``, ``output_length``
(tokens) and ``hash_ids`` (prefix block ids, ``trace_block_tokens`` tokens each; equal ids
are the same prefix block). Raw tokens are not in a trace: :func:`block_tokens_of`
synthesizes them deterministically per id, so equal ids give equal token blocks and the
store's chained keys (:func:`store_keys`) follow the trace's prefix tree exactly; the
simulators run on the same keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey, block_keys

#: tokens per ``hash_ids`` block in the Mooncake traces
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(KVStoreError, ValueError):
    """A trace file cannot be read as a Mooncake-format trace."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: int | None = None  # the optional ``session`` field (synthetic families carry it)


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in timestamp order (ties keep file order)."""

    requests: tuple[Request, ...]
    source: str
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS

    @property
    def duration_ms(self) -> int:
        return self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms if self.requests else 0

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (a slice for tests and quick runs)."""
        return Trace(self.requests[:n], self.source, self.trace_block_tokens)


#: bounds of a line's integers: timestamps and lengths are used as floats (pacing, routing),
#: hash ids as uint64 (:func:`block_tokens_of`); anything past them is a damaged line
_MAX_FIELD = 1 << 63
_MAX_HASH_ID = 1 << 64


def _int_below(v: object, bound: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < bound


def _request(obj: object, where: str) -> Request:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
    try:
        ts, ids = obj["timestamp"], obj["hash_ids"]
    except KeyError as e:
        raise TraceError(f"{where}: missing field {e.args[0]!r} (a Mooncake trace line has "
                         "timestamp, input_length, output_length, hash_ids)") from None
    inp, out = obj.get("input_length", 0), obj.get("output_length", 0)
    ints = (ts, inp, out)
    if not all(_int_below(v, _MAX_FIELD) for v in ints):
        raise TraceError(f"{where}: timestamp, input_length and output_length must be "
                         "non-negative integers below 2**63")
    if not isinstance(ids, list) or not all(_int_below(h, _MAX_HASH_ID) for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers below "
                         "2**64")
    sess = obj.get("session")
    if sess is not None and not (isinstance(sess, int) and not isinstance(sess, bool)):
        raise TraceError(f"{where}: session must be an integer when given")
    return Request(ts, inp, out, tuple(ids), sess)


def iter_requests(path: str | os.PathLike[str]) -> Iterator[Request]:
    """The requests of a trace file in file order; blank lines are skipped."""
    p = Path(path)
    try:
        # surrogateescape: a byte that is not UTF-8 reaches its line, which names it
        f = p.open("r", encoding="utf-8", errors="surrogateescape")
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror or e}") from e
    with f:
        for lineno, line in enumerate(f, 1):
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as e:
                raise TraceError(f"{p}:{lineno}: not UTF-8 text (character {e.start + 1}); a "
                                 "trace is JSON lines") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{p}:{lineno}: not JSON ({e.msg})") from None
            except RecursionError:
                raise TraceError(f"{p}:{lineno}: not a trace request (JSON nested thousands "
                                 "of levels deep)") from None
            except ValueError:  # json.loads' int() of a number of 4300+ digits
                raise TraceError(f"{p}:{lineno}: not a trace request (a number with thousands "
                                 "of digits)") from None
            yield _request(obj, f"{p}:{lineno}")


def load_trace(path: str | os.PathLike[str], *, limit: int | None = None,
               trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a trace; ``limit`` keeps the first requests in timestamp order."""
    if trace_block_tokens <= 0:
        raise TraceError(f"trace_block_tokens must be positive, got {trace_block_tokens}")
    reqs = sorted(iter_requests(path), key=lambda r: r.timestamp_ms)  # stable: ties keep order
    if not reqs:
        raise TraceError(f"{path}: no requests in the trace")
    if limit is not None:
        reqs = reqs[:limit]
    return Trace(tuple(reqs), str(path), trace_block_tokens)


def block_tokens_of(ids: Sequence[int], trace_block_tokens: int) -> np.ndarray:
    """The synthesized tokens of trace blocks ``ids``: id ``h`` is the tokens
    ``h * trace_block_tokens + 0 .. trace_block_tokens - 1`` (mod 2**32)."""
    base = np.asarray(ids, dtype=np.uint64)[:, None] * np.uint64(trace_block_tokens)
    toks = base + np.arange(trace_block_tokens, dtype=np.uint64)[None, :]
    return (toks % np.uint64(2**32)).astype(np.uint32).reshape(-1)


@dataclass(frozen=True, slots=True)
class TraceFacts:
    """What a capacity share is a share of, for one store block size."""

    requests: int
    references: int  # store blocks asked for, all requests together
    unique_blocks: int
    block_tokens: int

    @property
    def unbounded_hit_ratio(self) -> float:
        """The hit ratio of a cache that never evicts: every repeat reference hits."""
        return (self.references - self.unique_blocks) / self.references if self.references else 0.0


def store_keys(trace: Trace, namespace_id: bytes, block_tokens: int) -> list[list[BlockKey]]:
    """Every request's store keys (its full ``block_tokens``-token blocks), in replay order:
    trace blocks are cut or joined into store blocks, as the store would key them."""
    tb = trace.trace_block_tokens
    return [list(block_keys(namespace_id, block_tokens_of(r.hash_ids, tb), block_tokens))
            if r.hash_ids else [] for r in trace.requests]


def facts(blocks: Sequence[Sequence[Hashable]], block_tokens: int) -> TraceFacts:
    seen: set[Hashable] = set()
    refs = 0
    for b in blocks:
        refs += len(b)
        seen.update(b)
    return TraceFacts(len(blocks), refs, len(seen), block_tokens)
