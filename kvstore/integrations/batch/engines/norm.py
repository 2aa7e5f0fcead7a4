"""RMSNorm in one pass for the batched engine's CPU forwards.

HF's ``LlamaRMSNorm`` (Qwen2's, Mistral's and others are copies of it) runs five element-wise
torch operations, each a pass over the rows (square, mean, reciprocal root, two products);
on the 110M shape (hidden 768, 2 threads) 6,135 rows took 10.8 ms and 48 rows 29 us, 25 times
a forward. ``kvstore._rmsnorm`` (ext/rmsnorm.c, optional, vectorised for AVX-512 / AVX2)
does it in one pass on the calling thread: 1.5 ms and 7 us.

:class:`FusedNorms` finds the model's RMSNorm modules of a known class, checks each against
its own forward on random rows when the engine is built (a module whose results differ is
left alone), and swaps their ``forward`` during :meth:`FusedNorms.active`. The sum of squares
adds in another order than torch's: float32 results agree to rounding (3.6e-7 relative at
most on the check), as the engine's attention and packed linear layers do. Inputs the kernel
does not take (another dtype or device, not contiguous, 0-d, a lazily negated view whose
memory holds the values' negatives, autograd on) run the module's own forward, and so does a
module whose weight changed since the check into one the kernel does not take
(``model.half()``, ``.to(dtype)``, ``weight.data = ...`` cast it in place): the weight is
looked at on every call (about 0.8 us). A build whose ``rms_norm`` is missing or takes other
arguments (a stale one) fuses nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from kvstore.integrations.batch.engines.swap import swapped_forwards

__all__ = ["FusedNorms", "fused_norm_available"]

try:  # optional: built from ext/rmsnorm.c where a C compiler was found
    from kvstore import _rmsnorm as _kernel  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a build without it (or a corrupt or foreign file)
    _kernel = None
if not callable(getattr(_kernel, "rms_norm", None)):  # a stale build of another era
    _kernel = None

#: RMSNorm classes whose forward is ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32
#: (Gemma's adds 1 to its weight: not one of them)
KNOWN = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                   "Qwen3MoeRMSNorm", "Phi3RMSNorm", "OlmoRMSNorm", "GraniteRMSNorm"})
#: how far the kernel may be from the module's own forward on the check (relative)
CHECK_RTOL = 1e-5


def fused_norm_available() -> bool:
    """Whether ``kvstore._rmsnorm`` was built."""
    return _kernel is not None


def _fusable(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    eps = getattr(m, "variance_epsilon", None)
    return (type(m).__name__ in KNOWN and isinstance(w, torch.Tensor) and w.dim() == 1
            and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
            and isinstance(eps, float))


def _fused_forward(m: torch.nn.Module, own: Callable[..., Any]) -> Callable[..., Any]:
    eps, dim, f32 = float(m.variance_epsilon), m.weight.numel(), torch.float32
    run = _kernel.rms_norm  # type: ignore[union-attr]

    def forward(x: torch.Tensor) -> torch.Tensor:
        # the weight as it is now: model.half() / .to() / weight.data = ... change it in place
        # after the check, and the kernel reads ``dim`` float32 from it
        w = m.weight
        if (x.dtype != f32 or x.device.type != "cpu" or not x.is_contiguous() or x.dim() == 0
                or x.shape[-1] != dim or x.is_neg() or w.dtype != f32 or w.device.type != "cpu"
                or not w.is_contiguous() or w.numel() != dim or w.is_neg()
                or (torch.is_grad_enabled() and x.requires_grad)):
            return own(x)
        out = torch.empty_like(x)
        if x.numel():
            run(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
        return out

    return forward


class FusedNorms:
    """The model's RMSNorm modules that run on ``kvstore._rmsnorm`` (see the module
    docstring); empty where the kernel was not built."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules: list[torch.nn.Module] = []
        if _kernel is None:
            return
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for m in model.modules():
                if not _fusable(m):
                    continue
                x = torch.randn((7, m.weight.numel()), generator=g) * 3
                want = m(x)
                try:
                    got = _fused_forward(m, m.forward)(x)
                except (TypeError, ValueError):  # a build whose signature is not this one's
                    continue
                if want.shape == got.shape and torch.allclose(got, want, rtol=CHECK_RTOL,
                                                              atol=1e-6):
                    self.modules.append(m)

    def __len__(self) -> int:
        return len(self.modules)

    def active(self) -> contextlib.AbstractContextManager[int]:
        """Within the block the modules run on the kernel; yields how many."""
        return swapped_forwards((m, functools.partial(_fused_forward, m, m.forward))
                                for m in self.modules)
