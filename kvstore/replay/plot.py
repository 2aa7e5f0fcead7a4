"""``kvstore replay --plot``: hit ratio against memory capacity, one line per policy.

Needs matplotlib (``pip install 'kvstore[plot]'``), imported only when a plot is drawn.
"""

from __future__ import annotations

import os

from kvstore.errors import KVStoreError
from kvstore.replay.fleet_report import FleetReport
from kvstore.replay.report import ReplayReport

_LABELS = {"lru": "LRU", "reuse": "reuse (default)", "belady": "Belady bound (offline)",
           "unbounded": "unbounded cache"}


class PlotUnavailableError(KVStoreError, RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib():
    """matplotlib's pyplot (file backend); :class:`PlotUnavailableError` without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'kvstore[plot]' (or pip install matplotlib)"
        ) from e
    return plt


def plot_report(report: ReplayReport, path: str | os.PathLike[str]) -> None:
    """Write the hit-ratio-vs-capacity plot of ``report`` to ``path`` (PNG, SVG, PDF by its
    suffix)."""
    plt = require_matplotlib()
    fig = report_figure(report)
    fig.savefig(os.fspath(path))
    plt.close(fig)


def _meets(rows, name: str, top: float) -> float | None:
    """The first capacity (%) where ``name`` reaches the unbounded cache's hit ratio."""
    for r in rows:
        s = r.sim(name)
        if s is not None and s.hit_ratio >= top - 1e-9:
            return 100 * r.share
    return None


def report_figure(report: ReplayReport):
    """The hit-ratio-vs-capacity figure of ``report`` (matplotlib), not yet saved.

    The unbounded cache is a flat reference line drawn beneath everything; the Belady bound is
    drawn above the policies, so it stays visible where it meets the unbounded cache (at the
    larger capacities it usually does: its label says from where)."""
    plt = require_matplotlib()
    rows = sorted(report.rows, key=lambda r: r.share)
    xs = [100 * r.share for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    colour: dict[str, str] = {}
    top = next((r.sim("unbounded").hit_ratio for r in rows if r.sim("unbounded")), None)
    if top is not None:
        ax.axhline(top, linestyle="--", color="grey", linewidth=1.5, alpha=0.7, zorder=1,
                   label=_LABELS["unbounded"])
    for name in [*report.policies, "belady"]:
        ys = [(r.sim(name).hit_ratio if r.sim(name) else float("nan")) for r in rows]
        ours = name in report.policies
        label = f"{_LABELS.get(name, name)} (simulated)" if ours else _LABELS.get(name, name)
        if not ours:
            meets = None if top is None else _meets(rows, name, top)
            if meets is not None:  # "Belady bound (offline; = unbounded from 5%)"
                label = f"{label.removesuffix(')')}; = unbounded from {meets:g}%)"
        (line,) = ax.plot(xs, ys, "-" if ours else ":", marker="o" if ours else "^",
                          markersize=6 if ours else 5, linewidth=1.5 if ours else 2.2,
                          zorder=2 if ours else 3, label=label)
        colour[name] = line.get_color()
    for name in report.policies:
        pts = [(100 * r.share, r.store(name).hit_ratio) for r in rows if r.store(name)]
        if pts:
            ax.plot(*zip(*pts, strict=True), "x", color=colour[name], markersize=10,
                    markeredgewidth=2, label=f"{_LABELS.get(name, name)} (through the store)")
    ax.set_xlabel("memory capacity, % of the trace's unique blocks")
    ax.set_ylabel("prefix hit ratio (blocks)")
    ax.set_title(f"{os.path.basename(report.trace)}: {report.requests:,} requests, "
                 f"{report.unique_blocks:,} unique {report.block_tokens}-token blocks",
                 fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_fleet(report: FleetReport, path: str | os.PathLike[str]) -> None:
    """Write the fleet plot of ``report`` to ``path``: hit ratio per router (bars, one group
    per capacity and eviction policy) and, beside it, each router's max/mean engine load."""
    plt = require_matplotlib()
    groups = [f"{r.capacity} {r.eviction}" for r in report.rows]
    width = 0.8 / max(1, len(report.routers))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4.5), dpi=120)
    for i, router in enumerate(report.routers):
        xs = [g + (i - (len(report.routers) - 1) / 2) * width for g in range(len(groups))]
        res = [row.of(router) for row in report.rows]
        ax.bar(xs, [r.hit_ratio if r else 0.0 for r in res], width, label=router)
        ax2.bar(xs, [r.max_over_mean if r else 0.0 for r in res], width, label=router)
    for a, label in ((ax, "prefix hit ratio (blocks)"), (ax2, "max / mean engine load")):
        a.set_xticks(range(len(groups)), groups, fontsize=8)
        a.set_ylabel(label)
        a.grid(alpha=0.3, axis="y")
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8)
    fig.suptitle(f"{os.path.basename(report.trace)}: {report.requests:,} requests through "
                 f"{report.engines} stores, per-engine capacity", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    plt.close(fig)
