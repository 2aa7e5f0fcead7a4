"""A ``kvstore batch run`` whose engine dies after some results, as if the job were killed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class Killed(BaseException):  # not an Exception: nothing on the way may swallow it
    pass


def hooked_engine(real_open: Callable[..., Any],
                  after: Callable[[int, Sequence[Any]], None],
                  before: Callable[[Sequence[Any]], None] | None = None) -> Callable[..., Any]:
    """A stand-in for ``kvstore.commands.batch._open_engine`` whose engine calls
    ``after(i, requests)`` once result ``i`` was handed on (it may raise: a kill, Ctrl-C) and
    ``before(requests)`` as each run starts."""

    def open_engine(args, tok, prompts=()):
        engine, warm = real_open(args, tok, prompts)
        inner = engine.run

        def run(reqs, on_done=None):
            if before is not None:
                before(reqs)

            def done(i, c):
                on_done(i, c)
                after(i, reqs)

            return inner(reqs, on_done=done)

        engine.run = run
        return engine, warm

    return open_engine


def dying_engine(real_open: Callable[..., Any], die_after: int,
                 ran: list[str] | None = None) -> Callable[..., Any]:
    """A stand-in for ``kvstore.commands.batch._open_engine`` whose engine raises
    :class:`Killed` after ``die_after`` results (never for -1); ``ran`` collects the ids of
    the requests each run was given."""
    seen: list[int] = []

    def after(i: int, reqs: Sequence[Any]) -> None:
        seen.append(i)
        if len(seen) == die_after:
            raise Killed

    def before(reqs: Sequence[Any]) -> None:
        seen.clear()
        if ran is not None:
            ran.extend(r.custom_id for r in reqs)

    return hooked_engine(real_open, after, before)


def save_llama(path: Any, vocab: int, *, hidden: int, layers: int, heads: int, kv_heads: int,
               spread: bool = False) -> Any:
    """A seeded random Llama without EOS/BOS for batch jobs, saved to ``path``; ``spread``:
    weights wider than the default init, so greedy choices have clear margins."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                                   intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=256, eos_token_id=None,
                                   bos_token_id=None)
    m = transformers.LlamaForCausalLM(cfg)
    if spread:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    m.save_pretrained(path)
    return path


def spread_saved(cfg: Any, path: Any) -> Any:
    """A seeded random model of ``cfg`` with weights spread wider than the default init (so
    greedy choices have clear margins), saved to ``path`` and loaded back in float32: what a
    user's ``from_pretrained`` gives, exact on the engine's tests."""
    import torch
    import transformers

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    m.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
