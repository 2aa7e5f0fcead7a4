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

:func:`attend_rows` is the same kernel over sequences of different lengths (a forward's
suffix parts: each row's new tokens against its own suffix buffer row, read in place, no
padding to the longest row and no mask); a KV head's query heads are one work item's rows, so
a decode step's few queries per head are dot products straight from the keys.

The kernel is built three times (generic, AVX2, AVX-512: ext/attention_*.c); the best build
torch's CPU capability allows is imported (with GCC's ``target_clones`` the per-item kernel's
AVX-512 clone ran at half a plain ``-mavx512f`` build's speed).

:func:`attend` and :func:`attend_rows` return ``None`` for what the kernel does not take (no
build, another dtype or device, a head size not a multiple of 64, a last dimension not
contiguous, a call too small to gain): the caller then runs torch's kernel.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from kvstore.integrations.batch.engines.split import wide_threads

__all__ = ["attend", "attend_rows", "kernel_available"]

#: the kernel's builds, best first, by torch's CPU capability (``ATEN_CPU_CAPABILITY`` lowers
#: both): a build for an instruction set the CPU lacks would die of SIGILL, so only those the
#: capability names are tried
_BUILDS = {"AVX512": ("_attention_avx512", "_attention_avx2", "_attention"),
           "AVX2": ("_attention_avx2", "_attention")}


def _load(capability: str) -> ModuleType | None:
    """The best build of the kernel this CPU runs, or ``None`` (none was built)."""
    for name in _BUILDS.get(capability.upper(), ("_attention",)):
        try:
            return importlib.import_module(f"kvstore.{name}")
        except ImportError:  # that build failed (an old compiler): the next one
            continue
    return None


# optional: built from ext/attention.c where a C compiler with OpenMP was found
_kernel = _load(torch.backends.cpu.get_cpu_capability())

#: query-key products x query heads below which torch's kernel is as fast (24 queries
#: against a 2,000-token prefix over 4 heads: 0.31 ms torch's, 0.46 here: the keys'
#: transposition per call dominates)
MIN_WORK = 1 << 21


def kernel_available() -> bool:
    """Whether a build of ``kvstore._attention`` is there for this CPU."""
    return _kernel is not None


def _takes(t: torch.Tensor, dims: int = 4) -> bool:
    # a view with torch's negative bit holds the negatives in memory: the kernel reads memory
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == dims
            and t.stride(-1) == 1 and not t.requires_grad and not t.is_neg())


#: the most threads a call asks OpenMP for
_MAX_THREADS = 512
#: key columns of :func:`transposed_keys` come in multiples of this (the kernel's score tile)
_TILE = 32


def transposed_keys(k: torch.Tensor) -> torch.Tensor:
    """``k [B, Hkv, K, D]`` as the kernel's tiles read it, ``[B, Hkv, D, Kpad]`` (zero past
    ``K``): made once for keys many calls read (a shared prefix's, every decode step)."""
    B, H, K, D = k.shape
    out = torch.zeros((B, H, D, (K + _TILE - 1) // _TILE * _TILE), dtype=k.dtype)
    out[..., :K] = k.transpose(-1, -2)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           threads: int | None = None, kt: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``softmax(scale q k^T) v`` and its log-sum-exp for ``q [B, Hq, M, D]`` over ``k``,
    ``v [B, Hkv, K, D]`` (query head ``h`` on KV head ``h // (Hq / Hkv)``); ``causal``: query
    ``i`` sees keys ``j <= i + K - M``. ``o [B, Hq, M, D]`` and ``lse [B, Hq, M]`` in float32,
    or ``None`` where the kernel does not apply. ``threads``: the run's (the ones
    :func:`~.split.wide` gives a large kernel), else torch's. ``kt``: :func:`transposed_keys`
    of ``k``, if the caller keeps it (then no call is too small for the kernel)."""
    if getattr(_kernel, "attend", None) is None or not (_takes(q) and _takes(k) and _takes(v)):
        return None
    B, Hq, M, D = q.shape
    Bk, Hkv, K, Dk = k.shape
    if (Bk != B or Dk != D or tuple(v.shape) != tuple(k.shape) or D % 64 or D > 512
            or Hkv < 1 or Hq % Hkv or M < 1 or K < 1
            or (kt is None and B * Hq * M * K < MIN_WORK)):
        return None
    extra: tuple[int, ...] = ()
    if kt is not None:
        if (kt.dtype != torch.float32 or not kt.is_contiguous() or kt.dim() != 4
                or tuple(kt.shape[:3]) != (B, Hkv, D) or kt.shape[3] < K or kt.shape[3] % _TILE):
            raise ValueError("attend: kt must be transposed_keys(k)")
        extra = (kt.data_ptr(), int(kt.shape[3]))
    o = torch.empty((B, Hq, M, D), dtype=torch.float32)
    lse = torch.empty((B, Hq, M), dtype=torch.float32)
    _kernel.attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                   B, Hq, Hkv, M, K, D, tuple(q.stride()[:3]), tuple(k.stride()[:3]),
                   tuple(v.stride()[:3]), float(scale), bool(causal), _team(threads), *extra)
    return o, lse


def _team(threads: int | None) -> int:
    """The threads a call runs on: ``threads``, else the run's (the ones :func:`~.split.wide`
    gives a large kernel), else torch's; capped (libgomp exits the process when it cannot start
    the threads asked for, ~60k here)."""
    n = threads if threads is not None else (wide_threads() or torch.get_num_threads())
    return max(1, min(int(n), _MAX_THREADS))


def _index(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64 and t.device.type == "cpu" and t.dim() == 1 and t.is_contiguous()


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qstart: torch.Tensor,
                mlen: torch.Tensor, krow: torch.Tensor, klen: torch.Tensor, scale: float,
                causal: bool = True, threads: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of sequences of different lengths: sequence ``b``'s ``mlen[b]`` queries,
    rows ``qstart[b]``.. of ``q [Hq, N, D]``, over the first ``klen[b]`` keys of row
    ``krow[b]`` of ``k``, ``v [rows, Hkv, C, D]`` (``causal``: query ``i`` sees keys
    ``j <= i + klen[b] - mlen[b]``). ``o [Hq, N, D]`` and ``lse [Hq, N]`` (rows no sequence
    covers are left unwritten), or ``None`` where the kernel does not apply. The four index
    tensors: int64, CPU, contiguous, one entry per sequence."""
    if getattr(_kernel, "attend_rows", None) is None \
            or not (_takes(q, 3) and _takes(k) and _takes(v)):
        return None
    Hq, N, D = q.shape
    rows, Hkv, C, Dk = k.shape
    S = int(qstart.shape[0]) if qstart.dim() == 1 else 0
    if (Dk != D or tuple(v.shape) != tuple(k.shape) or D % 64 or D > 512 or Hkv < 1
            or Hq % Hkv or N < 1 or C < 1 or S < 1
            or not all(_index(t) and t.shape[0] == S for t in (qstart, mlen, krow, klen))):
        return None
    # the kernel reads these addresses: every index must name a real row and column
    if (int(krow.min()) < 0 or int(krow.max()) >= rows or int(klen.min()) < 1
            or int(klen.max()) > C or int(mlen.min()) < 1 or int(qstart.min()) < 0
            or int((qstart + mlen).max()) > N):
        raise ValueError("attend_rows: a sequence's rows or lengths fall outside its tensors")
    o = torch.empty((Hq, N, D), dtype=torch.float32)
    lse = torch.empty((Hq, N), dtype=torch.float32)
    _kernel.attend_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                        qstart.data_ptr(), mlen.data_ptr(), krow.data_ptr(), klen.data_ptr(),
                        S, Hq, Hkv, N, D, tuple(q.stride()[:2]), tuple(k.stride()[:3]),
                        tuple(v.stride()[:3]), float(scale), bool(causal), _team(threads))
    return o, lse
