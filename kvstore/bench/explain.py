"""Benchmark section ``explain``: ``kvstore explain`` of a 128k-token prompt on a store of
10,000 blocks (goal < 1 s), beside a plain lookup of the same prompt measured in the same run.

The store mixes what explain has to tell apart: the prompt's first 6,000 blocks (hits), 1,000
evicted (their tombstones), the rest never stored; the prompt's first 2,000 blocks under a
second namespace (another model: found and named); 2,000 blocks of another prompt. Blocks
are 1 KiB: explain reads no payload (without ``--verify``), so the block size does not
change what it does. Rows: the library call against the 1 s budget, and against
``block_keys`` + the disk tier's ``leading_run`` (what a lookup costs); the note has the
whole ``kvstore explain`` command (a fresh process: interpreter start and imports included).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from kvstore.bench import BenchOptions, BenchRow, time_row
from kvstore.layout import KVLayout
from kvstore.namespace import Namespace

SECTION = "explain"
_TOKENS = 131072
_HITS, _EVICTED, _OTHER_NS, _OTHER_PROMPT = 6000, 1000, 2000, 2000


def _write(t, ns: Namespace, keys: list[bytes]) -> None:
    from kvstore.tiers.disk import DiskWrite

    data = torch.zeros((len(keys), ns.layout.block_nbytes), dtype=torch.uint8)
    t.write_blocks([DiskWrite(k, keys[i - 1] if i else None, ns.id, data[i])
                    for i, k in enumerate(keys)])


def _build(store: str, layout: KVLayout, tokens: list[int]) -> Namespace:
    from kvstore.keys import block_keys
    from kvstore.tiers.disk import DiskTier
    from kvstore.tiers.disk import tombstones as tomb

    a = Namespace.create("bench/explain", layout)
    b = Namespace.create("bench/explain-other", layout)
    t = DiskTier(store, capacity_bytes=1 << 40)
    try:
        for ns in (a, b):
            t.register_namespace(ns)
        keys = list(block_keys(a.id, tokens, layout.block_tokens))
        _write(t, a, keys[:_HITS])
        # the trace the disk tier's eviction leaves (docs/format.md "Tombstones")
        tomb.record_on(t, [(a.id + k, 0) for k in keys[_HITS:_HITS + _EVICTED]],
                       tomb.Reason.EVICTED, tomb.TierCode.DISK)
        _write(t, b, list(block_keys(b.id, tokens, layout.block_tokens))[:_OTHER_NS])
        other = [t_ + 7 for t_ in tokens[: _OTHER_PROMPT * layout.block_tokens]]
        _write(t, a, list(block_keys(a.id, other, layout.block_tokens)))
        assert t.stats().blocks == _HITS + _OTHER_NS + _OTHER_PROMPT
    finally:
        t.close()
    return a


def _cli(store: str, prompt: str, ns: Namespace) -> float:
    from kvstore.child import env, kvstore_argv

    t0 = time.perf_counter()
    out = subprocess.run(kvstore_argv("explain", "--store", store, "--namespace",
                                      ns.id.hex(), "--tokens-file", prompt, "--format", "json"),
                         capture_output=True, text=True, env=env(), check=True).stdout
    dt = time.perf_counter() - t0
    assert json.loads(out)["lookup_blocks"] == _HITS
    return dt


def run(opts: BenchOptions) -> list[BenchRow]:
    from kvstore.admin.explain import Status, explain
    from kvstore.keys import block_keys
    from kvstore.tiers.disk import DiskTier

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
                      block_tokens=16)  # 1 KiB blocks
    tokens = [(i * 7919) % 128000 for i in range(_TOKENS)]
    base = tempfile.mkdtemp(prefix="kvstore-bench-explain-", dir=opts.workdir)
    reps = 3 if opts.quick else 7
    try:
        store = os.path.join(base, "store")
        ns = _build(store, layout, tokens)
        prompt = os.path.join(base, "prompt.json")
        with open(prompt, "w") as f:
            json.dump(tokens, f)
        ours, peer, cli = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            e = explain(store, tokens, namespace=ns.id.hex())
            ours.append(time.perf_counter() - t0)
            counts = {s: sum(b.status is s for b in e.per_block) for s in Status}
            assert counts[Status.HIT] == _HITS and counts[Status.EVICTED] == _EVICTED
            t0 = time.perf_counter()
            t = DiskTier(store, capacity_bytes=0, readonly=True)
            n = t.leading_run(list(block_keys(ns.id, tokens, layout.block_tokens)), ns.id)
            t.close()
            peer.append(time.perf_counter() - t0)
            assert n == _HITS
            if len(cli) < 3:
                cli.append(_cli(store, prompt, ns))
        med, ref, cmd = (statistics.median(x) for x in (ours, peer, cli))
        note = (f"{_TOKENS} tokens = {_TOKENS // 16} blocks; store of 10,000 blocks, 2 "
                f"namespaces; median of {reps}; the whole command (fresh process, JSON out): "
                f"{cmd:.2f} s")
        return [
            time_row(SECTION, "explain (library call)", med, "budget: 1 s", 1.0, unit="ms",
                     goal=1.0, note=note),
            time_row(SECTION, "explain (library call)", med,
                     "lookup of the prompt (keys + leading_run)", ref, unit="ms",
                     note="for information: explain answers for every block, a lookup only "
                     "counts the leading run"),
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
