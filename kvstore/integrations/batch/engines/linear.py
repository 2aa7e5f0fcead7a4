"""Linear layers on prepacked weights for the batched engine's CPU forwards.

torch's ``nn.Linear`` on the CPU hands each call's weight to the GEMM as it is, which then
re-lays it out into its own blocked format on every call. oneDNN can take the weight already
in that format (``torch.ops.mkldnn._reorder_linear_weight`` once, then
``torch.ops.mkldnn._linear_pointwise`` per call), which is what vLLM's CPU backend does
(``dispatch_cpu_unquantized_gemm``): measured on a shared 2-core machine, one thread, a
768 x 2048 float32 weight, 2,000 rows: 38 GFLOP/s against ``F.linear``'s 30, 64 rows: 30
against 27.

:class:`PackedLinears` packs the model's float32 ``nn.Linear`` weights once (again when a
weight changes in place: its tensor version moves) and swaps their ``forward`` for the packed
one for the duration of :meth:`PackedLinears.active`. The products sum in another order than
torch's GEMM: float32 results agree to rounding, as the engine's attention does.

A gated SiLU MLP (the Llama MLP's forward; Qwen2's and Mistral's are copies of it) runs on
fused calls meanwhile: SiLU as the gate GEMM's post-op, the product as the up GEMM's (as
torch's inductor fuses them on the CPU). Measured alone (110M shape, 2 threads): 512 rows
13.0 -> 11.6 ms per MLP, 64 rows 1.80 -> 1.70 ms.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from kvstore.integrations.batch.engines.split import wide

__all__ = ["PackedLinears", "packing_available"]

log = logging.getLogger(__name__)

#: the batch size the weights are packed for (a hint; every batch size runs)
_PACK_HINT = 512
#: a fused MLP over more rows than this runs in chunks of :data:`_MLP_CHUNK` rows: the
#: ``[rows, FFN]`` intermediates of a chunk stay in cache for the down projection (110M shape,
#: 2 threads, idle: 6,135 rows 172 -> 148 ms, 3,800 rows 98 -> 89 ms)
_MLP_WHOLE, _MLP_CHUNK = 1536, 1024


def packing_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear (CPU builds with MKL-DNN)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


def _packable(m: torch.nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m) is torch.nn.Linear and isinstance(w, torch.Tensor) and w.dim() == 2
            and w.dtype == torch.float32 and w.device.type == "cpu")


class PackedLinears:
    """The float32 CPU ``nn.Linear`` layers of ``model`` on oneDNN-packed weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._packed: dict[torch.nn.Linear, tuple[int, torch.Tensor]] = {}
        self.failed = False

    @property
    def linear_count(self) -> int:
        """The model's linear layers (``nn.Linear`` and subclasses), packable or not."""
        return sum(isinstance(m, torch.nn.Linear) for m in self.model.modules())

    def _pack(self, m: torch.nn.Linear) -> torch.Tensor:
        w = m.weight
        have = self._packed.get(m)
        if have is not None and have[0] == w._version:
            return have[1]
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_size=_PACK_HINT)
        self._packed[m] = (w._version, packed)
        return packed

    def pack_all(self) -> int:
        """Pack every packable layer now (as vLLM packs at load), not in the first run; how
        many. A torch without packing is left to :meth:`active` to report."""
        n = 0
        if not self.failed:
            try:
                for m in self.model.modules():
                    if _packable(m):
                        self._pack(m)
                        n += 1
            except (RuntimeError, NotImplementedError):
                return 0
        return n

    @contextlib.contextmanager
    def active(self) -> Iterator[int]:
        """Within the block the model's linear layers run on packed weights; yields how many."""
        swapped: list[torch.nn.Module] = []
        if not self.failed:
            try:
                for m in self.model.modules():
                    if _packable(m) and "forward" not in m.__dict__:
                        m.forward = _packed_forward(self._pack(m), m.bias)  # type: ignore[method-assign]
                        swapped.append(m)
            except (RuntimeError, NotImplementedError) as e:  # a torch without it: plain GEMM
                log.warning("prepacked linear layers unavailable, using torch's: %s", e)
                self.failed = True
                self._restore(swapped)
                swapped = []
        fused = [] if self.failed else self._fuse_mlps()
        try:
            yield len(swapped)
        finally:
            self._restore(fused + swapped)

    def _fuse_mlps(self) -> list[torch.nn.Module]:
        """Gated SiLU MLPs (the Llama MLP's forward, ``down(silu(gate(x)) * up(x))``) on two
        fused oneDNN calls: the gate's GEMM with SiLU as its post-op, the up GEMM with the
        product as its post-op (no separate SiLU and product passes over ``[N, FFN]``)."""
        done: list[torch.nn.Module] = []
        for m in self.model.modules():
            if "forward" in m.__dict__ or not _gated_silu(m):
                continue
            try:
                m.forward = _fused_mlp(self._pack(m.gate_proj), m.gate_proj.bias,  # type: ignore[method-assign]
                                       self._pack(m.up_proj), m.up_proj.bias, m.down_proj)
            except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - old oneDNN
                log.warning("fused MLP unavailable, using separate ops: %s", e)
                break
            done.append(m)
        return done

    @staticmethod
    def _restore(mods: list[torch.nn.Module]) -> None:
        for m in mods:
            del m.forward


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None) -> Any:
    op = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise RuntimeError("packed linear layers take float32 CPU inputs")
        return wide(op, x, packed, bias, "none", [], "")

    return forward


def _llama_mlp_code() -> Any:
    try:
        from transformers.models.llama.modeling_llama import LlamaMLP
    except ImportError:  # pragma: no cover
        return None
    return LlamaMLP.forward.__code__


def _gated_silu(m: torch.nn.Module) -> bool:
    """``m`` is an MLP whose forward is the Llama MLP's (Qwen2, Mistral... copy it) with SiLU
    and packable gate / up layers."""
    ref = _llama_mlp_code()
    fwd = getattr(type(m), "forward", None)
    code = getattr(fwd, "__code__", None)
    act = getattr(m, "act_fn", None)
    return (ref is not None and code is not None and code.co_code == ref.co_code
            and code.co_names == ref.co_names
            and type(act).__name__ in ("SiLU", "SiLUActivation")
            and all(_packable(getattr(m, n, None)) for n in ("gate_proj", "up_proj")))


def _fused_mlp(gate: torch.Tensor, gate_bias: torch.Tensor | None, up: torch.Tensor,
               up_bias: torch.Tensor | None, down: torch.nn.Module) -> Any:
    op = torch.ops.mkldnn._linear_pointwise

    def part(x: torch.Tensor) -> torch.Tensor:
        g = wide(op, x, gate, gate_bias, "swish", [], "")  # oneDNN's swish with alpha 1 is SiLU
        return down(wide(op.binary, x, g, up, up_bias, "mul"))

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise RuntimeError("packed linear layers take float32 CPU inputs")
        rows = x.numel() // x.shape[-1]
        if rows <= _MLP_WHOLE:
            return part(x)
        flat = x.reshape(rows, x.shape[-1])
        first = part(flat[:_MLP_CHUNK])
        out = torch.empty((rows, first.shape[-1]), dtype=first.dtype, device=first.device)
        out[:_MLP_CHUNK] = first
        for a in range(_MLP_CHUNK, rows, _MLP_CHUNK):
            out[a:a + _MLP_CHUNK] = part(flat[a:a + _MLP_CHUNK])
        return out.view(*x.shape[:-1], first.shape[-1])

    return forward
