"""Which new blocks of a Mooncake-format trace are ever used again, by what the store could
see when they were put (issue 18's analysis of why the 5 % goal needs a first-reuse signal).

    python tools/trace_reuse.py ../shared/traces/mooncake_conversation.jsonl

For each request: its new blocks (not seen before) and how many of them a later request uses.
Prints the share reused per bucket of output length, prompt length, hit prefix (blocks found
as a leading run) and new-block count, and the per-request distribution of that share.
"""

from __future__ import annotations

import collections
import json
import sys

BUCKETS = {
    "output tokens": (0, [1, 5, 20, 50, 100, 200, 400, 800, 2000]),
    "input tokens": (1, [1000, 2000, 4000, 8000, 16000, 32000, 64000]),
    "hit prefix (blocks)": (2, [1, 2, 5, 10, 20, 50]),
    "new blocks": (3, [1, 2, 5, 10, 20, 50, 100]),
}


def rows(path: str) -> list[tuple[int, int, int, int, int]]:
    with open(path) as f:
        reqs = [json.loads(line) for line in f]
    left = collections.Counter(b for r in reqs for b in r["hash_ids"])
    seen: set[int] = set()
    out = []
    for r in reqs:
        ids = r["hash_ids"]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        new = [b for b in dict.fromkeys(ids) if b not in seen]
        for b in ids:
            left[b] -= 1
        out.append((r["output_length"], r["input_length"], k, len(new),
                    sum(1 for b in new if left[b] > 0)))
        seen.update(ids)
    return out


def bucket(v: int, edges: list[int]) -> str:
    return next((f"<= {e}" for e in edges if v <= e), f"> {edges[-1]}")


def main(path: str) -> None:
    data = rows(path)
    for name, (i, edges) in BUCKETS.items():
        agg: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        for row in data:
            a = agg[bucket(row[i], edges)]
            a[0] += 1
            a[1] += row[3]
            a[2] += row[4]
        print(f"\n{name}: bucket, requests, new blocks, share reused")
        for label in [f"<= {e}" for e in edges] + [f"> {edges[-1]}"]:
            if label in agg:
                n, new, used = agg[label]
                print(f"  {label:>9} {n:6d} {new:8d} {used / max(new, 1):6.3f}")
    shares = collections.Counter(round(r[4] / r[3], 1) for r in data if r[3] >= 3)
    print("\nrequests with >= 3 new blocks, by share of them reused:",
          dict(sorted(shares.items())))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "../shared/traces/mooncake_conversation.jsonl")
