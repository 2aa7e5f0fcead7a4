"""Batch requests and their results: the typed form of one JSONL line in and one line out.

A request line is a JSON object::

    {"custom_id": "q1", "prompt": "text" | "token_ids": [1, 2, 3], "max_tokens": 16,
     "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 7,
     "stop": "\\n\\n" | ["a", "b"], "stop_token_ids": [13], "ignore_eos": false}

``custom_id`` and exactly one of ``prompt`` (text, needs a tokenizer) or ``token_ids`` are
required; everything else has the default shown (``temperature`` 0 is greedy). Unknown fields
are refused, so a misspelt ``temprature`` cannot silently run greedy. :func:`parse_request`
turns a line into a :class:`BatchRequest` or a :class:`LineError` naming the line and what to
change (:mod:`.jobs` reads and writes the files).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FIELDS",
    "BatchRequest",
    "Completion",
    "LineError",
    "SamplingParams",
    "parse_request",
    "request_digest",
]

#: every field a request line may have
FIELDS = ("custom_id", "prompt", "token_ids", "max_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stop_token_ids", "ignore_eos")
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request decodes: greedy when ``temperature`` is 0, else sampled with its own
    generator seeded by ``seed`` (reproducible whatever else is in the batch)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings (need a tokenizer); not part of the text
    stop_token_ids: tuple[int, ...] = ()  # stop tokens, kept in token_ids
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # parse_request checks a job's lines; these are the Python API's: before, max_tokens=0
        # still generated one token, a negative temperature sampled the least likely tokens
        # and a NaN one failed half way through the job, after other requests had finished
        t, bad = self.temperature, None
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            bad = f"max_tokens must be a whole number >= 1, got {self.max_tokens!r}"
        elif not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            bad = f"temperature must be a finite number >= 0, got {t!r}"
        elif not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            bad = f"top_p must be in (0, 1], got {self.top_p!r}"
        elif isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad = f"top_k must be a whole number >= 0 (0: off), got {self.top_k!r}"
        elif self.seed is not None and not (isinstance(self.seed, int)
                                            and -(2**63) <= self.seed < 2**64):
            bad = f"seed must be a whole number in [-2**63, 2**64) or None, got {self.seed!r}"
        if bad is not None:
            raise ValueError(bad)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One request of a batch job."""

    custom_id: str
    token_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    prompt: str | None = None  # the text, when the line gave text
    line: int = 0  # 1-based line of the input file (0: not from a file)


@dataclass(frozen=True, slots=True)
class Completion:
    """What an engine produced for one request."""

    custom_id: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS, a stop token or string) or "length"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens this request did not compute (shared prefix, store)
    text: str | None = None  # decoded (special tokens skipped, cut before a stop string)
    stop_reason: str | int | None = None  # the stop string or token id that ended it


@dataclass(frozen=True, slots=True)
class LineError:
    """A request line that cannot run, and why."""

    line: int
    custom_id: str | None
    message: str


class _Bad(Exception):
    pass


def _int(obj: Mapping[str, Any], name: str, default: int | None, lo: int | None = None,
         hi: int | None = None, bounds: str = "") -> int | None:
    v = obj.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(f"{name} must be a whole number, got {json.dumps(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _Bad(f"{name} must be {bounds or f'>= {lo}'}, got {v}")
    return v


def _float(obj: Mapping[str, Any], name: str, default: float, lo: float, hi: float,
           lo_open: bool = False) -> float:
    v = obj.get(name, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Bad(f"{name} must be a number, got {json.dumps(v)}")
    if isinstance(v, int) and not -1e300 < v < 1e300:  # no float holds it: math would raise
        raise _Bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got a number "
                   f"of {len(str(abs(v)))} digits")
    if not math.isfinite(v):
        raise _Bad(f"{name} must be a number, got {json.dumps(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _Bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}")
    return float(v)


def _token_list(v: Any, name: str, vocab: int | None) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _Bad(f"{name} must be a list of token ids (whole numbers)")
    bad = next((t for t in v if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise _Bad(f"{name} has token id {bad}, outside the vocabulary [0, {vocab})"
                   if vocab is not None else f"{name} has a negative token id {bad}")
    return tuple(v)


def _stops(obj: Mapping[str, Any], has_tokenizer: bool) -> tuple[str, ...]:
    stop = obj.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _Bad("stop must be a non-empty string or a list of them")
    if not has_tokenizer:
        raise _Bad("stop strings need a tokenizer, and the model has none: use stop_token_ids")
    return tuple(stops)


def _params(obj: Mapping[str, Any], *, vocab: int | None, has_tokenizer: bool) -> SamplingParams:
    stop_ids = obj.get("stop_token_ids", [])
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _Bad(f"ignore_eos must be true or false, got {json.dumps(ignore_eos)}")
    return SamplingParams(
        max_tokens=_int(obj, "max_tokens", DEFAULT_MAX_TOKENS, 1) or DEFAULT_MAX_TOKENS,
        temperature=_float(obj, "temperature", 0.0, 0.0, 100.0),
        top_p=_float(obj, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int(obj, "top_k", 0, 0) or 0,
        # what a torch.Generator takes (-2**63 .. 2**64 - 1); past it the engine raised mid-job
        seed=_int(obj, "seed", None, -(2**63), 2**64 - 1, "in [-2**63, 2**64)"),
        stop=_stops(obj, has_tokenizer),
        stop_token_ids=_token_list(stop_ids, "stop_token_ids", vocab),
        ignore_eos=ignore_eos,
    )


def _tokenized(text: str, tokenize: Callable[[str], Sequence[int]],
               vocab: int | None) -> tuple[int, ...]:
    """``text``'s token ids. Before, a tokenizer raising (a lone surrogate, ``"\\ud800"``,
    is valid JSON) stopped the whole job with a traceback, and ids past the model's
    vocabulary (a tokenizer with more words than the model) made the engine refuse the job."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as u:
        raise _Bad(f"the prompt cannot be tokenized: it has half of a UTF-16 surrogate pair "
                   f"(a JSON escape like \\ud800) at character {u.start + 1}: write the "
                   "character itself, or both halves of its pair") from None
    try:
        ids = tuple(int(t) for t in tokenize(text))
    except Exception as e:  # the tokenizer's own error, whatever its type
        raise _Bad(f"the prompt cannot be tokenized ({type(e).__name__}: {e})") from None
    bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
    if bad is not None:
        raise _Bad(f"the tokenizer gave token id {bad}, outside the model's vocabulary "
                   f"[0, {vocab}): the model directory's tokenizer does not match its model")
    return ids


def _prompt(obj: Mapping[str, Any], tokenize: Callable[[str], Sequence[int]] | None,
            vocab: int | None) -> tuple[tuple[int, ...], str | None]:
    if ("prompt" in obj) == ("token_ids" in obj):
        raise _Bad("give exactly one of prompt (text) or token_ids")
    if "token_ids" in obj:
        ids = _token_list(obj["token_ids"], "token_ids", vocab)
        text = None
    else:
        text = obj["prompt"]
        if not isinstance(text, str):
            raise _Bad("prompt must be a string (or send token_ids)")
        if tokenize is None:
            raise _Bad("prompt text needs a tokenizer, and the model has none: send token_ids")
        ids = _tokenized(text, tokenize, vocab) if text else ()
    if not ids:
        raise _Bad("the prompt is empty: it needs at least one token")
    return ids, text


def parse_request(
    text: str,
    line: int,
    *,
    tokenize: Callable[[str], Sequence[int]] | None = None,
    vocab: int | None = None,
    context: int | None = None,
) -> BatchRequest | LineError:
    """One input line as a request, or the reason it cannot run.

    ``tokenize``: text -> token ids (None: the model has no tokenizer); ``vocab``: token ids
    must be below it; ``context``: the model's context length (a prompt must leave room for
    one new token).
    """
    try:
        obj = json.loads(text)
    except ValueError as e:
        if "integer string conversion" in str(e):  # Python's advice is no use to a job's author
            return LineError(line, None, "not valid JSON here: an integer of more than 4,300 "
                             "digits (no token id, count or seed is that long)")
        return LineError(line, None, f"not valid JSON ({e})")
    except RecursionError:
        return LineError(line, None, "not valid JSON (nested thousands of levels deep)")
    if not isinstance(obj, dict):
        return LineError(line, None, "a request must be a JSON object")
    cid = obj.get("custom_id")
    cid = cid if isinstance(cid, str) and cid else None
    try:
        if "custom_id" not in obj:
            raise _Bad("custom_id is missing (a non-empty string is required)")
        if cid is None:  # before: "is missing" for a custom_id of 5 or ""
            got = json.dumps(obj["custom_id"])
            raise _Bad("custom_id must be a non-empty string, got "
                       + (got if len(got) <= 40 else got[:37] + "..."))
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            raise _Bad(f"unknown field {', '.join(map(repr, unknown))} (known: {', '.join(FIELDS)})")
        ids, prompt = _prompt(obj, tokenize, vocab)
        params = _params(obj, vocab=vocab, has_tokenizer=tokenize is not None)
        if context is not None and len(ids) >= context:
            raise _Bad(f"the prompt has {len(ids)} tokens; the model's context is {context} "
                       "(it must leave room for one new token): shorten the prompt")
    except _Bad as e:
        return LineError(line, cid, str(e))
    return BatchRequest(custom_id=cid, token_ids=ids, params=params, prompt=prompt, line=line)


def request_digest(r: BatchRequest, job: str = "") -> str:
    """A digest of what decides a request's result (tokens, parameters and ``job``: the model
    and engine), for resuming."""
    p = r.params
    doc = [job, list(r.token_ids), p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed,
           list(p.stop), list(p.stop_token_ids), p.ignore_eos]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]
