"""What the attack rounds (tests/test_attacks_round*.py) share: a small layout and a store
opened on it with a few warm slots, so that eviction and the disk are in play at once."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Sequence

import torch

from kvstore import KVLayout, open_store

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_tokens=4)
BN = LAY.block_nbytes  # 512 B
T = LAY.block_tokens


def attack_store(path, *, model: str, warm: int = 64, hot: int = 0, disk: str = "64MiB", **kw):
    """A store on ``LAY``: ``warm`` / ``hot`` slots of memory, ``disk`` of disk."""
    return open_store(path, layout=LAY, model_id=model, device="cpu", gpu_capacity=hot * BN,
                      cpu_capacity=warm * BN, disk_capacity=disk, **kw)


def vouched_chains(lines: Iterable[str]) -> list[int]:
    """The chain numbers a killed writer reported as flushed: whole ``flushed N`` lines only.

    A writer killed -9 can leave its last line cut short ("flushed" with no number, when its
    stdout is unbuffered, as under ``PYTHONUNBUFFERED``); a line it never finished vouched for
    nothing, so it is skipped rather than parsed."""
    return [int(m.group(1)) for x in lines if (m := re.fullmatch(r"flushed (\d+)\n?", x))]


def close_amid(store, threads: Sequence[threading.Thread], stop: threading.Event, *,
               after: float) -> None:
    """Start ``threads`` (calls on ``store``), close the store ``after`` seconds into them, then
    set ``stop`` and join them: each must end, none may hang across the close."""
    from conftest import run_bounded

    for t in threads:
        t.start()
    time.sleep(after)
    run_bounded(store.close, 30)
    stop_all(threads, stop, "a call hung across close")


def stop_all(threads: Sequence[threading.Thread], stop: threading.Event, hung: str) -> None:
    """Set ``stop`` and join ``threads``; one still running after 30 s fails with ``hung``."""
    stop.set()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), hung
