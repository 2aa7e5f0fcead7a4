"""A batch job's memory: the store's warm tier sized from the job, and the peak RSS.

A store opened with :func:`kvstore.open_store`'s defaults has a 4 GiB warm tier, and the
store faults its slab in at open (in the background, so that the first copies run at memcpy
speed): a batch job on a tiny model then held 4-5 GB of RSS for a prefix cache of a few MiB.
:func:`warm_capacity` sizes the warm tier from what the job can put there, its shared
prefixes' full blocks (each counted once), with headroom, within a floor and a cap;
``kvstore batch run --cpu-capacity`` overrides it.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.integrations.batch.engines.schedule import schedule
from kvstore.integrations.batch.plan import plan_batch
from kvstore.sizes import format_size

__all__ = ["DEFAULT_CAP", "HEADROOM", "MIN_BLOCKS", "WarmSizing", "check_capacity",
           "peak_rss", "prefix_blocks", "warm_capacity"]

#: the most a job-sized warm tier asks for: open_store's default warm tier
DEFAULT_CAP = 4 << 30
#: room beyond the job's own prefix blocks (blocks a store already held, partial puts)
HEADROOM = 1.25
#: the least a job-sized warm tier holds, in blocks (a job without shared prefixes)
MIN_BLOCKS = 16


@dataclass(frozen=True, slots=True)
class WarmSizing:
    """The store's warm tier for a job: ``capacity`` bytes, where it came from."""

    capacity: int
    source: str  # "job" (sized from it) or "--cpu-capacity"
    prefix_blocks: int  # full blocks of the job's shared prefixes
    block_nbytes: int
    capped: bool = False  # the job's blocks (with headroom) were more than the cap

    @property
    def blocks(self) -> int:
        """Blocks the warm tier holds."""
        return self.capacity // self.block_nbytes


def prefix_blocks(prompts: Sequence[Sequence[int]], block_tokens: int) -> int:
    """Full blocks of ``prompts``' shared prefixes, each counted once: what a token-batched
    engine loads from a store and puts there (its rows' own suffixes are never put)."""
    if len(prompts) < 2:
        return 0
    plan = plan_batch(prompts, block_tokens=block_tokens, budget_blocks=None)
    nodes = schedule(plan, [len(p) for p in prompts]).nodes
    full = [n.prefix_len // block_tokens for n in nodes]
    # a node's prefix extends its parent's: only the blocks past the parent's are its own
    return sum(b - (full[n.parent] if n.parent >= 0 else 0)
               for n, b in zip(nodes, full, strict=True))


def warm_capacity(prompts: Sequence[Sequence[int]], *, block_tokens: int, block_nbytes: int,
                  cap: int = DEFAULT_CAP) -> WarmSizing:
    """The warm tier for a job: its prefix blocks x :data:`HEADROOM`, at least
    :data:`MIN_BLOCKS` blocks, at most ``cap`` bytes (never below one block)."""
    if block_nbytes < 1:
        raise ValueError("block_nbytes must be >= 1")
    n = prefix_blocks(prompts, block_tokens)
    want = max(MIN_BLOCKS, math.ceil(n * HEADROOM)) * block_nbytes
    most = max(block_nbytes, cap // block_nbytes * block_nbytes)
    return WarmSizing(capacity=min(want, most), source="job", prefix_blocks=n,
                      block_nbytes=block_nbytes, capped=want > most)


def check_capacity(nbytes: int, block_nbytes: int, *, what: str = "--cpu-capacity",
                   layout: object = None) -> None:
    """Refuse a warm tier of ``nbytes`` that cannot hold one block, saying what to give."""
    if nbytes < block_nbytes:
        shape = f": {layout}" if layout is not None else ""
        raise ConfigError(
            f"{what} {format_size(nbytes)} is smaller than one block of this model "
            f"({format_size(block_nbytes)}{shape}); give at least {format_size(block_nbytes)} "
            f"(--cpu-capacity {block_nbytes}), or leave {what} out to size it from the job")


def peak_rss() -> int:
    """This process's peak resident set size so far, in bytes (``getrusage``'s
    ``ru_maxrss``: KiB on Linux, bytes on macOS). Child processes are not counted."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)
