"""The Mooncake conversation trace as the serve section's second workload: where it is
(``$KVSTORE_TRACE`` or ``../shared/traces``), a window of it converted to vLLM's
``timed_trace`` input (:func:`convert_trace`), and the block-level prefix reuse within that
window (:func:`trace_reuse`)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.bench.serve_scale import BLOCK, Scale


def trace_source() -> Path | None:
    env = os.environ.get("KVSTORE_TRACE")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for d in (here.parents[2].parent / "shared" / "traces", here.parents[2] / "shared" / "traces"):
        if (d / "mooncake_conversation.jsonl").exists():
            return d / "mooncake_conversation.jsonl"
    return None


def convert_trace(src: Path, dst: Path, scale: Scale, start: int = 0) -> list[int]:
    """Write ``scale.trace_requests`` requests of the Mooncake trace from line ``start`` as
    ``timed_trace`` input: each 512-token hash block becomes ``trace_chunk`` tokens (input and
    output lengths scaled alike; at most ``trace_max_chunks`` blocks and ``trace_max_output``
    tokens out), timestamps in seconds from the first request times ``trace_time_scale``.
    Returns the prompt lengths."""
    ratio = scale.trace_chunk / 512
    rows: list[dict[str, Any]] = []
    with open(src) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if len(rows) >= scale.trace_requests:
                break
            rows.append(json.loads(line))
    if not rows:
        raise ValueError(f"{src}: no request from line {start}")
    t0 = float(rows[0]["timestamp"])
    lengths = []
    with open(dst, "w") as out:
        for r in rows:
            ids = list(r["hash_ids"])[: scale.trace_max_chunks]
            n = max(1, min(math.ceil(int(r["input_length"]) * ratio), len(ids) * scale.trace_chunk))
            n = min(n, scale.max_model_len - scale.trace_max_output - 1)
            o = max(1, min(round(int(r["output_length"]) * ratio), scale.trace_max_output))
            ts = (float(r["timestamp"]) - t0) / 1000.0 * scale.trace_time_scale
            out.write(json.dumps({"timestamp": round(ts, 3), "input_length": n,
                                  "output_length": o, "hash_ids": ids}) + "\n")
            lengths.append(n)
    return lengths


def trace_reuse(lengths_and_ids: Sequence[tuple[int, Sequence[int]]], chunk: int) -> float:
    """Block-level prefix reuse within the window (unbounded cache): the share of whole
    ``BLOCK``-token blocks that an earlier request in the window already had."""
    seen: set[tuple[int, ...]] = set()
    hit = tot = 0
    for n, ids in lengths_and_ids:
        per = chunk // BLOCK
        blocks = [tuple(ids[: i // per + 1]) + (i % per,) for i in range(n // BLOCK)]
        run = True
        for b in blocks:
            tot += 1
            if run and b in seen:
                hit += 1
            else:
                run = False
        seen.update(blocks)
    return hit / tot if tot else 0.0
