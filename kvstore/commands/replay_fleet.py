"""``kvstore replay --engines N``: the trace through N real stores behind a router."""

from __future__ import annotations

import argparse
import sys


def plan(args: argparse.Namespace):
    from kvstore.replay.fleet_report import FleetPlan
    from kvstore.replay.report import parse_capacity
    from kvstore.tiers.policy import DEFAULT_EVICTION

    caps = tuple(parse_capacity(c) for c in args.capacity.split(",") if c.strip())
    return FleetPlan(
        engines=args.engines, capacities=caps,
        routers=tuple(r.strip() for r in args.router.split(",") if r.strip()),
        policies=tuple((args.eviction or DEFAULT_EVICTION).split(",")),
        block_tokens=args.block_tokens,
        hot=parse_capacity(args.hot) if args.hot else None,
        disk=parse_capacity(args.disk) if args.disk else None,
        speed=args.speed, path=args.workdir, imbalance=args.imbalance,
        hash_blocks=args.hash_blocks)


def run(args: argparse.Namespace, trace) -> int:
    from kvstore.commands import output as a
    from kvstore.replay.fleet_report import run_fleet_report

    fleet = plan(args)
    if args.plot:
        from kvstore.replay.plot import require_matplotlib

        require_matplotlib()
    report = a.with_progress("replay", len(trace.requests),
                             lambda tick: run_fleet_report(trace, fleet, progress=tick))
    if args.plot:
        from kvstore.replay.plot import plot_fleet

        plot_fleet(report, args.plot)
    if args.format == "json":
        a.emit_json("replay-fleet", report)
    else:
        _print(report, a, plot=args.plot)
    wrong = sum(r.wrong_blocks for row in report.rows for r in row.results)
    if wrong:
        print(f"kvstore replay: {wrong} fetched block(s) did not hold the bytes put under "
              "their key: please report this", file=sys.stderr)
        return 1
    return 0


def _print(report, a, *, plot: str | None) -> None:
    con = a.out_console()
    con.print(f"Trace {report.trace}: {report.requests:,} requests, {report.references:,} "
              f"block references, {report.unique_blocks:,} unique {report.block_tokens}-token "
              f"blocks, through {report.engines} stores (capacity per store)")
    cols = [("CAPACITY", "right"), ("EVICTION", "left"), ("ROUTER", "left"),
            ("HIT RATIO", "right"), ("VS ROUND-ROBIN", "right"), ("MAX/MEAN LOAD", "right"),
            ("EXPLOIT", "right"), ("MISPREDICTED", "right"), ("REQUESTS PER ENGINE", "left"),
            ("TOKENS COMPUTED PER ENGINE", "left"), ("SECONDS", "right")]
    rows = []
    for row in report.rows:
        rr = row.of("round-robin")
        for r in row.results:
            vs = f"{r.hit_ratio / rr.hit_ratio:.2f}x" if rr and rr.hit_ratio else "-"
            rows.append((row.capacity, row.eviction, r.router, f"{r.hit_ratio:.3f}", vs,
                         f"{r.max_over_mean:.3f}", f"{r.exploit:,}", f"{r.mispredicted:,}",
                         " ".join(f"{e.requests:,}" for e in r.per_engine),
                         " ".join(_tokens(e.tokens_computed) for e in r.per_engine),
                         f"{r.seconds:.1f}"))
    con.print(a.table(cols, rows))
    con.print("Load = input tokens an engine computed (its misses); MISPREDICTED = requests "
              "whose hit differed from the leading run the router's index told.")
    if plot:
        con.print(f"Plot written to {plot}")


def _tokens(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def add_args(p: argparse.ArgumentParser) -> None:
    from kvstore.commands.args import integer

    g = p.add_argument_group("several engines (a router in front of N stores)")
    g.add_argument("--engines", type=integer(minimum=1), metavar="N",
                   help="replay through N stores in this process, a router in front; "
                   "--capacity, --hot and --disk are then per store")
    g.add_argument("--router", default="round-robin,hash,prefix", metavar="LIST",
                   help="routing policies to compare with --engines: prefix (longest cached "
                   "prefix within a load band), round-robin, hash (first blocks) "
                   "(default all three)")
    g.add_argument("--imbalance", type=float, default=0.2, metavar="F",
                   help="the prefix router's load band: an engine more than (1+F) x the mean "
                   "load is passed over (default 0.2)")
    g.add_argument("--hash-blocks", type=integer(minimum=1), default=4, metavar="N",
                   help="leading blocks the hash router hashes (default 4)")
