"""Phi-3 ``longrope`` RoPE in packed forwards of the token-batched engine.

transformers' ``longrope`` rotary embedding takes its *short* or *long* factors for a whole
forward from that forward's largest position (``max(position_ids) + 1 >
original_max_position_embeddings``: long). A packed forward mixes rows of many prompts, so one
long row (or a row decoding past the original length) switched every other row to the long
factors, and their tokens parted from ``model.generate`` run on each prompt alone.

Here each token gets the factors ``generate`` would give it on its own: a row whose prompt is
longer than the original length uses the long factors for every token (its prompt is computed
whole, without a shared prefix, as ``generate`` computes it); a shorter row uses the short
ones until its next token would sit at that length, where ``generate`` (Phi-3's
``prepare_inputs_for_generation``) recomputes the whole sequence with the long factors, and the
engine does the same (the row rejoins as a long row). :func:`per_token_rope` gives the rotary
modules, for the duration of one forward, cos/sin computed per token with its own factors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvstore.errors import ConfigError

__all__ = ["longrope_modules", "per_token_rope"]


def longrope_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The rotary-embedding modules of ``model`` whose RoPE is ``longrope``."""
    found = []
    for m in model.modules():
        kind = getattr(m, "rope_type", None)
        if isinstance(kind, dict) and "longrope" in kind.values():
            raise ConfigError(f"{type(m).__name__} uses longrope RoPE for some layer types: the "
                              "batched engine cannot give it generate's frequencies per token")
        if kind == "longrope":
            found.append(m)
    return found


@contextlib.contextmanager
def per_token_rope(modules: Sequence[torch.nn.Module], long: torch.Tensor | None,
                   limit: int) -> Iterator[None]:
    """Within the block, ``modules`` compute cos/sin of token ``i`` of the forward with the
    long factors where ``long[i]`` (``[N]`` bool), else with the short ones."""
    if not modules or long is None:
        yield
        return
    def wrap(orig: Any) -> Any:
        def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kw: Any) -> Any:
            pos = position_ids.reshape(-1)
            if pos.numel() != long.numel():
                return orig(x, position_ids, *args, **kw)
            cos = sin = None
            for want, sel in ((False, ~long), (True, long)):
                idx = sel.nonzero().squeeze(1)
                if not idx.numel():
                    continue
                p = pos[idx]
                # transformers picks the factors from the largest position: one more position
                # at the original length makes it take the long ones (its cos/sin is dropped)
                if want:
                    p = torch.cat((p, p.new_full((1,), limit)))
                c, s = orig(x, p.unsqueeze(0), *args, **kw)
                c, s = c[0, : idx.numel()], s[0, : idx.numel()]
                if cos is None:
                    cos = c.new_empty((1, pos.numel(), c.shape[-1]))
                    sin = s.new_empty((1, pos.numel(), s.shape[-1]))
                cos[0, idx], sin[0, idx] = c, s
            return cos, sin
        return forward

    before = [m.__dict__.get("forward") for m in modules]
    for m in modules:
        m.forward = wrap(m.forward)
    try:
        yield
    finally:
        for m, f in zip(modules, before, strict=True):
            if f is None:
                del m.forward  # the class's forward again
            else:
                m.forward = f
