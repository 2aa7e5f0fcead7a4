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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["PackedLinears", "packing_available"]

log = logging.getLogger(__name__)

#: the batch size the weights are packed for (a hint; every batch size runs)
_PACK_HINT = 512


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
        try:
            yield len(swapped)
        finally:
            self._restore(swapped)

    @staticmethod
    def _restore(mods: list[torch.nn.Module]) -> None:
        for m in mods:
            del m.forward


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None) -> Any:
    op = torch.ops.mkldnn._linear_pointwise

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise RuntimeError("packed linear layers take float32 CPU inputs")
        return op(x, packed, bias, "none", [], "")

    return forward
