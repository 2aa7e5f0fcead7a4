"""The batched engine's float32 attention kernel (``kvstore._attention``, ext/attention.c).

torch's CPU flash attention ran at 130-170 GFLOP/s in float32 on the engine's large calls on
an idle 2-core machine whose float32 GEMM reaches 400-490 (a 2,000-token prompt's causal
attention over 12 query heads, 2,097 queries against a shared 2,000-token prefix, a decode
step's 192 queries against a 3,800-token prefix), and it needs K/V copied per query head
under GQA. The kernel computes the same blocks with register-tiled products and its own exp,
reads a KV head once for all its query heads, and runs on torch's own OpenMP team (the
module links libgomp.so.1, which torch's wheel bundles: one runtime, whose threads are awake
right after torch's operations; a pool of other threads fought them for the cores and lost
the gain). Sums run in another order: float32 results agree to rounding.

:func:`attend` returns ``None`` for what the kernel does not take (no build, another dtype or
device, a head size not a multiple of 64, a last dimension not contiguous, a call too small to
gain): the caller then runs torch's kernel.
"""

from __future__ import annotations

import torch

from kvstore.integrations.batch.engines.split import wide_threads

__all__ = ["attend", "kernel_available"]

try:  # optional: built from ext/attention.c where a C compiler with OpenMP was found
    from kvstore import _attention as _kernel  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - a build without it
    _kernel = None

#: query-key products x query heads below which torch's kernel is as fast (24 queries
#: against a 2,000-token prefix over 4 heads: 0.31 ms torch's, 0.46 here: the keys'
#: transposition per call dominates)
MIN_WORK = 1 << 21


def kernel_available() -> bool:
    """Whether ``kvstore._attention`` was built."""
    return _kernel is not None


def _takes(t: torch.Tensor) -> bool:
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 4
            and t.stride(-1) == 1 and not t.requires_grad)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``softmax(scale q k^T) v`` and its log-sum-exp for ``q [B, Hq, M, D]`` over ``k``,
    ``v [B, Hkv, K, D]`` (query head ``h`` on KV head ``h // (Hq / Hkv)``); ``causal``: query
    ``i`` sees keys ``j <= i + K - M``. ``o [B, Hq, M, D]`` and ``lse [B, Hq, M]`` in float32,
    or ``None`` where the kernel does not apply. ``threads``: the run's (the ones
    :func:`~.split.wide` gives a large kernel), else torch's."""
    if _kernel is None or not (_takes(q) and _takes(k) and _takes(v)):
        return None
    B, Hq, M, D = q.shape
    Bk, Hkv, K, Dk = k.shape
    if (Bk != B or Dk != D or tuple(v.shape) != tuple(k.shape) or D % 64 or D > 512
            or Hkv < 1 or Hq % Hkv or M < 1 or K < 1 or B * Hq * M * K < MIN_WORK):
        return None
    o = torch.empty((B, Hq, M, D), dtype=torch.float32)
    lse = torch.empty((B, Hq, M), dtype=torch.float32)
    n = threads if threads is not None else (wide_threads() or torch.get_num_threads())
    _kernel.attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                   B, Hq, Hkv, M, K, D, tuple(q.stride()[:3]), tuple(k.stride()[:3]),
                   tuple(v.stride()[:3]), float(scale), bool(causal), max(1, int(n)))
    return o, lse
