"""``kvstore explain``: per block of a prompt, where it is or why it misses (``docs/cli.md``).

Exit status: 0 explained (whatever it found); 2 usage or store error (no store, a namespace
that matches nothing, unreadable prompt, no daemon at ``--socket``).
"""

from __future__ import annotations

import argparse

_EPILOG = """\
examples:
  kvstore explain --model meta-llama/Llama-3.1-8B --layout 'bfloat16 L32 P2 T16 H8 D128' \\
      --tokens-file prompt.json
  kvstore explain --namespace 74e27a29a9ec --tokens '[128000, 2675, 527, 264]'
  kvstore explain --namespace meta-llama/Llama-3.1-8B --tokenizer ./Llama-3.1-8B \\
      --text-file system_prompt.txt --socket /run/kvstore/kvstore.sock
statuses: hit, unreachable, damaged, evicted, removed, dropped, pruned, other_namespace,
  other_salt, never_stored (docs/cli.md explains each)
"""


def _namespace(args: argparse.Namespace):
    from kvstore.admin.common import AdminError
    from kvstore.commands.args import namespace_fields_of

    if args.namespace is not None:
        if args.model or args.layout or args.extra:
            raise AdminError("give either --namespace or --model/--layout, not both")
        return args.namespace
    if not args.model or not args.layout:
        raise AdminError("name the namespace: --namespace ID (or model id), or --model M "
                         "--layout 'bfloat16 L32 P2 T16 H8 D128' as the engine opens the store")
    return namespace_fields_of(args)


def prompt_of(args: argparse.Namespace) -> list[int]:
    """The prompt's token ids from ``--tokens`` / ``--tokens-file`` / ``--text[-file]``."""
    from kvstore.admin.common import AdminError
    from kvstore.admin.prompt_input import parse_tokens, read_tokens, tokenize

    if args.tokens is not None:
        return parse_tokens(args.tokens, "--tokens")
    if args.tokens_file is not None:
        return read_tokens(args.tokens_file)
    if args.tokenizer is None:
        raise AdminError("--text and --text-file need --tokenizer DIR (the model's tokenizer "
                         "files); or give token ids with --tokens / --tokens-file")
    if args.text_file is not None:
        try:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise AdminError(f"cannot read {args.text_file}: {e.strerror or e}") from None
    else:
        text = args.text
    return tokenize(text, args.tokenizer, add_special_tokens=not args.no_special_tokens)


def _run(args: argparse.Namespace) -> int:
    from kvstore.admin.explain import explain
    from kvstore.commands import output as a

    res = explain(args.store, prompt_of(args), namespace=_namespace(args), salt=args.salt,
                  try_salts=args.try_salt or (), socket=args.socket,
                  salt_policy=args.salt_policy, verify=args.verify)
    if args.format == "json":
        a.emit_json("explain", res, indent=None)  # one line: 8k blocks print fast
        return 0
    _print(res, a, per_block=args.blocks)
    return 0


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _print(res, a, *, per_block: bool) -> None:
    con = a.out_console()
    f = res.namespace
    where = (f"asked live: the daemon at {res.socket} and the disk" if res.socket else
             "read offline: its disk tier; memory tiers belong to the processes using the "
             "store, --socket asks a daemon")
    con.print(f"Store {res.store} ({where})")
    state = "registered" if res.namespace_registered else "NOT REGISTERED: nobody opened it here"
    con.print(f"Namespace {res.namespace_id[:12]}  {f.model_id}  {f.layout}  ({state})")
    if res.live_note:
        con.print(f"Note: {res.live_note}")
    if not res.namespace_registered and res.closest:
        con.print("Closest registered namespaces:")
        for m in res.closest:
            diffs = ", ".join(f"{d.field} {d.stored!r} (you: {d.wanted!r})" for d in m.differs)
            con.print(f"  {m.namespace_id[:12]}  {m.model_id}  {m.layout}: {diffs}")
    bt = res.block_tokens
    partial = res.tokens - res.blocks * bt
    con.print(f"Prompt: {res.tokens} tokens = {res.blocks} full block(s) of {bt}"
              + (f" + {partial} token(s) of a partial block (never cached)" if partial else "")
              + (f", salt {res.salt!r}" if res.salt is not None else ""))
    con.print()
    cols = [("BLOCKS", "left"), ("TOKENS", "left"), ("STATUS", "left"), ("TIER", "left"),
            ("WHY", "left")]
    if per_block:
        runs = [(str(b.index), f"{b.first_token}-{b.end_token - 1}", b.status.value,
                 b.tier or "-", r.text) for r in res.runs for b in res.per_block[r.first:r.last + 1]]
        cols[0] = ("BLOCK", "left")
    else:
        runs = [(_span(r.first, r.last), f"{r.first * bt}-{(r.last + 1) * bt - 1}",
                 r.status.value, r.tier or "-", r.text) for r in res.runs]
    if runs:
        con.print(a.table(cols, runs, wrap=("WHY",)))
        con.print()
    pct = f" ({res.reused_tokens / res.tokens:.1%})" if res.tokens else ""
    con.print(f"A lookup finds {res.lookup_blocks} of {res.blocks} block(s): "
              f"{res.reused_tokens} of {res.tokens} tokens reused{pct}."
              + ("" if res.verified else " Payloads not read (--verify checks checksums)."))


def register(sub: argparse._SubParsersAction) -> None:
    from kvstore.commands.args import (
        Formatter,
        add_format,
        add_namespace_fields,
        add_store,
    )

    p = sub.add_parser(
        "explain", help="per block of a prompt: where it is, or why it misses",
        description="For each block of a prompt, say where it is (hot/warm/disk/remote) or "
        "why it misses: never stored, evicted (when, by which tier), removed, damaged and "
        "dropped, stored under another namespace (naming the differing field) or salt, or a "
        "namespace nobody opened (a typo'd model id). Read-only: changes nothing.",
        epilog=_EPILOG, formatter_class=Formatter)
    add_store(p)
    p.add_argument("--socket", metavar="S",
                   help="also ask the 'kvstore serve' daemon at this socket (warm and remote "
                   "tiers; the store is its --store); its lookups count in its counters")
    ns = p.add_argument_group("namespace (as the engine opens the store)")
    ns.add_argument("--namespace", metavar="ID|MODEL",
                    help="a registered namespace: id or unique prefix (>= 4 hex digits), or "
                    "an exact model id")
    add_namespace_fields(ns, model_help="the model_id the engine passes")
    pr = p.add_argument_group("prompt (one of)").add_mutually_exclusive_group(required=True)
    pr.add_argument("--tokens", metavar="JSON", help="token ids, e.g. '[1, 2, 3]'")
    pr.add_argument("--tokens-file", metavar="FILE",
                    help="token ids: a JSON array (or {\"prompt_token_ids\": [...]}), or ints "
                    "separated by spaces; '-' reads stdin")
    pr.add_argument("--text", metavar="TEXT", help="text, tokenized with --tokenizer")
    pr.add_argument("--text-file", metavar="FILE", help="a text file, tokenized with --tokenizer")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="local Hugging Face tokenizer directory for --text/--text-file")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="tokenize without special tokens (match the engine's setting)")
    p.add_argument("--salt", metavar="SALT", help="the prompt's cache salt (default: none)")
    p.add_argument("--try-salt", action="append", metavar="SALT",
                   help="also look under this salt (repeatable); no salt is always tried")
    p.add_argument("--salt-policy", choices=["shared", "per-uid"], default="shared",
                   help="with --socket: the salt policy the engines connect with")
    p.add_argument("--verify", action="store_true",
                   help="read each held block and check its checksum (default: file sizes only)")
    p.add_argument("--blocks", action="store_true", help="one row per block instead of runs")
    add_format(p)

    def run(args: argparse.Namespace) -> int:
        from kvstore.commands.output import guard

        return guard("explain", _run)(args)

    p.set_defaults(func=run)
