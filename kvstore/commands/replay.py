"""``kvstore replay``: a request trace through a real store, beside LRU, the farthest-next-use
bound and the unbounded cache computed on the same trace (``docs/cli.md``).

Exit status: 0 replayed; 1 some fetched block did not hold the bytes put under its key
(never expected: a bug to report); 2 usage error (unreadable trace, bad capacity, no
matplotlib for ``--plot``).
"""

from __future__ import annotations

import argparse
import sys

_EPILOG = """\
examples:
  kvstore replay ../shared/traces/mooncake_conversation.jsonl --plot hit_ratio.png
  kvstore replay trace.jsonl --capacity 1%,2%,5% --limit 2000 --format json
  kvstore replay trace.jsonl --capacity 5% --disk 20% --hot 1% --eviction reuse
  kvstore replay trace.jsonl --simulate-only --eviction lru,reuse --admission always,second-hit
  kvstore replay --chat 12000 --capacity 2%,5%,10%   # the synthetic multi-turn chat workload
  kvstore replay --generate rag --requests 4000 --seed 7 --simulate-only
  kvstore replay --generate agentic --save-trace agentic.jsonl --simulate-only
  kvstore replay trace.jsonl --engines 4 --capacity 2%,5% --router prefix,round-robin,hash
capacities: a share of the trace's unique blocks (5%) or a size (64MiB) of the warm tier;
the simulators model one memory tier of that size. With --engines N the trace runs through
N stores in this process behind a router fed by their KV events; capacities are per store.
"""


def _trace(args: argparse.Namespace):
    from kvstore.errors import ConfigError

    given = (args.trace is not None) + (args.chat is not None) + (args.generate is not None)
    if given != 1:
        raise ConfigError("give a trace file, or --generate FAMILY (or --chat N) for a "
                          "synthetic one")
    if args.generate is not None:
        from kvstore.replay.families import generate, write_trace

        trace = generate(args.generate, args.requests, args.seed)
        if args.save_trace:
            write_trace(trace, args.save_trace)
        return trace
    if args.chat is not None:
        from kvstore.replay.workloads import ChatWorkload, chat_trace

        return chat_trace(ChatWorkload(requests=args.chat, seed=args.seed))
    from kvstore.replay.trace import load_trace

    return load_trace(args.trace, limit=args.limit, trace_block_tokens=args.trace_block_tokens)


def _plan(args: argparse.Namespace):
    from kvstore.replay.report import ReplayPlan, parse_capacity

    caps = tuple(parse_capacity(c) for c in args.capacity.split(",") if c.strip())
    return ReplayPlan(
        capacities=caps, policies=tuple((args.eviction or "lru,adaptive").split(",")),
        baselines=tuple(b for b in (args.baselines or "arc,s3fifo").split(",")
                        if b and b != "none"),
        admissions=tuple((args.admission or "always").split(",")),
        hints=(False, True) if args.hints else (False,),
        block_tokens=args.block_tokens,
        hot=parse_capacity(args.hot) if args.hot else None,
        disk=parse_capacity(args.disk) if args.disk else None,
        store=not args.simulate_only, speed=args.speed, path=args.workdir)


def _run(args: argparse.Namespace) -> int:
    from kvstore.commands import output as a
    from kvstore.replay.report import run_report

    trace = _trace(args)
    if args.hints and all(r.session is None for r in trace.requests):
        from kvstore.errors import ConfigError

        raise ConfigError("--hints: this trace's requests carry no 'session' field, so there "
                          "is no hint to give; use a --generate family, or "
                          "a trace with sessions")
    if args.hints and args.engines is not None:
        from kvstore.errors import ConfigError

        raise ConfigError("--hints is not supported with --engines yet; drop one of them")
    if args.engines is not None:
        from kvstore.commands import replay_fleet

        return replay_fleet.run(args, trace)
    plan = _plan(args)
    if args.plot:
        from kvstore.replay.plot import require_matplotlib

        require_matplotlib()  # none: say so before minutes of replay
    report = a.with_progress("replay", len(trace.requests),
                             lambda tick: run_report(trace, plan, progress=tick))
    if args.plot:
        from kvstore.replay.plot import plot_report

        plot_report(report, args.plot)
    wrong = sum(r.wrong_blocks for row in report.rows for r in row.replayed)
    if args.format == "json":
        a.emit_json("replay", report)
    else:
        _print(report, a, plot=args.plot)
    if wrong:
        print(f"kvstore replay: {wrong} fetched block(s) did not hold the bytes put under "
              "their key: please report this", file=sys.stderr)
        return 1
    return 0


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _print(report, a, *, plot: str | None) -> None:
    from kvstore.replay.baselines import SIM_ONLY

    con = a.out_console()
    con.print(f"Trace {report.trace}: {report.requests:,} requests, {report.references:,} "
              f"block references, {report.unique_blocks:,} unique {report.block_tokens}-token "
              f"blocks ({a.size(report.block_nbytes)} each in the replay's layout)")
    con.print("Prefix hit ratio (blocks found as a leading run / blocks asked for):")
    cols = [("CAPACITY", "right"), ("BLOCKS", "right")]
    for p in report.policies:
        cols += [(f"{p.upper()} SIM", "right"), (f"{p.upper()} STORE", "right")]
    base = [s.label for s in report.rows[0].simulated if s.policy in SIM_ONLY] \
        if report.rows else []
    cols += [(f"{b.upper()} SIM", "right") for b in base]
    cols += [("BELADY", "right"), ("UNBOUNDED", "right")]
    rows = []
    for r in report.rows:
        cap = r.capacity if r.capacity.endswith("%") else f"{r.capacity} ({r.share:.1%})"
        cells = [cap, f"{r.blocks:,}"]
        for p in report.policies:
            sim, st = r.sim(p), r.store(p)
            cells += [_ratio(sim.hit_ratio if sim else None), _ratio(st.hit_ratio if st else None)]
        cells += [_ratio(r.sim(b).hit_ratio) for b in base]  # type: ignore[union-attr]
        cells += [_ratio(r.sim("belady").hit_ratio), _ratio(r.sim("unbounded").hit_ratio)]
        rows.append(cells)
    con.print(a.table(cols, rows))
    if any(r.replayed for r in report.rows):
        con.print()
        con.print("Per tier, through the store:")
        tcols = [("CAPACITY", "right"), ("EVICTION", "left"), ("TIER", "left"),
                 ("HIT RATIO", "right"), ("READ", "right"), ("WRITTEN", "right"),
                 ("EVICTIONS", "right"), ("SECONDS", "right")]
        trows = [(r.capacity, res.label, t.name, f"{t.hit_ratio:.3f}", a.size(t.bytes_read),
                  a.size(t.bytes_written), f"{t.evictions:,}", f"{res.seconds:.1f}")
                 for r in report.rows for res in r.replayed for t in res.tiers]
        con.print(a.table(tcols, trows))
    if plot:
        con.print(f"Plot written to {plot}")


def _args(p: argparse.ArgumentParser) -> None:
    from kvstore.commands.args import add_format, integer

    p.add_argument("trace", nargs="?", metavar="TRACE",
                   help="a Mooncake-format trace (JSON lines: timestamp, input_length, "
                   "output_length, hash_ids)")
    p.add_argument("--chat", type=integer(minimum=1), metavar="N",
                   help="instead of a file: N requests of the synthetic multi-turn chat workload")
    p.add_argument("--generate", metavar="FAMILY",
                   choices=["chat", "mooncake", "rag", "agentic", "batch"],
                   help="instead of a file: a synthetic trace family (chat, mooncake, rag, "
                   "agentic, batch; kvstore/replay/families.py) of --requests requests")
    p.add_argument("--requests", type=integer(minimum=1), default=4000, metavar="N",
                   help="requests of --generate (default 4000)")
    p.add_argument("--save-trace", metavar="FILE.jsonl",
                   help="also write the --generate trace as Mooncake-format JSON lines")
    p.add_argument("--seed", type=integer(minimum=0), default=0, metavar="N",
                   help="seed of --generate and --chat (default 0)")
    p.add_argument("--baselines", metavar="LIST",
                   help="published policies simulated beside the store's: arc, s3fifo, lhd, lrb "
                   "(default arc,s3fifo; none for none)")
    p.add_argument("--capacity", default="2%,5%,10%", metavar="LIST",
                   help="warm-tier capacities, comma-separated: shares of the trace's unique "
                   "blocks (5%%) or sizes (64MiB) (default 2%%,5%%,10%%)")
    p.add_argument("--eviction", metavar="LIST",
                   help="eviction policies to replay and simulate: lru, reuse, adaptive "
                   "(default lru,adaptive; with --engines: adaptive, the store's default)")
    p.add_argument("--admission", metavar="LIST",
                   help="warm-tier admissions to replay and simulate with each policy: always "
                   "(the default), second-hit (a block the tier has not seen lately starts at "
                   "the victim end); e.g. always,second-hit")
    p.add_argument("--hints", action="store_true",
                   help="also run each policy with each request's session as its put's hint "
                   "(kvstore.PutHint; traces with a 'session' field, like the --generate "
                   "families; shown as POLICY+hints)")
    p.add_argument("--hot", metavar="CAP", help="also a hot tier (on the CPU) of this capacity")
    p.add_argument("--disk", metavar="CAP",
                   help="also a disk tier of this capacity (real disk writes, under --workdir)")
    p.add_argument("--workdir", metavar="DIR",
                   help="where the disk tier's temporary stores go (default: the system's "
                   "temporary directory); removed afterwards")
    p.add_argument("--block-tokens", type=integer(minimum=1), default=512, metavar="T",
                   help="tokens per store block; trace blocks are cut or joined into store "
                   "blocks (default 512)")
    p.add_argument("--trace-block-tokens", type=integer(minimum=1), default=512, metavar="T",
                   help="tokens per hash_ids block of the trace (Mooncake: 512)")
    p.add_argument("--limit", type=integer(minimum=1), metavar="N",
                   help="replay only the first N requests (in timestamp order)")
    p.add_argument("--speed", type=float, metavar="X",
                   help="pace requests at their timestamps divided by X (default: as fast as "
                   "the store goes)")
    p.add_argument("--simulate-only", action="store_true",
                   help="skip the store replays: the simulators only (seconds)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw hit ratio against capacity per policy (needs matplotlib)")
    add_format(p)
    from kvstore.commands import replay_fleet

    replay_fleet.add_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    from kvstore.commands.args import Formatter

    p = sub.add_parser(
        "replay", help="replay a request trace through a real store, beside LRU and Belady",
        description="Replay a Mooncake-format request trace through a real store (real "
        "tiers, eviction, disk writes; tokens synthesized per block id, a small block "
        "layout) for each eviction policy and capacity, and report the prefix hit ratio per "
        "tier with bytes read, written and evictions, beside the same policies simulated, "
        "the offline farthest-next-use bound (Belady) and the unbounded cache.",
        epilog=_EPILOG, formatter_class=Formatter)
    _args(p)

    def run(args: argparse.Namespace) -> int:
        from kvstore.commands.output import guard

        if args.speed is not None and not args.speed > 0:
            p.error("--speed must be a number > 0")
        if args.engines is not None and args.admission is not None:
            p.error("--admission does not apply to --engines (the fleet's stores admit every "
                    "block)")
        if args.engines is not None and args.simulate_only:
            p.error("--simulate-only does not apply to --engines (the fleet is real stores); "
                    "for the routing simulator run python -m kvstore.routing.simulate TRACE")
        if not args.imbalance >= 0:
            p.error("--imbalance must be a number >= 0")
        return guard("replay", _run)(args)

    p.set_defaults(func=run)
