"""Synchronous checks of the tensors callers hand to a store (embedded or client).

Each raises :class:`~kvstore.errors.TensorMismatchError` saying what to change.
"""

from __future__ import annotations

import torch

from kvstore.errors import ConfigError, TensorMismatchError
from kvstore.layout import KVLayout


def _shape(lay: KVLayout) -> str:
    return ", ".join(map(str, lay.block_shape))


def check_kv(lay: KVLayout, device: torch.device, kv: object, n: int) -> None:
    """``kv`` must be ``[n, L, P, T, H, D]`` of the layout's dtype, on ``device`` or the CPU."""
    if not isinstance(kv, torch.Tensor):
        raise TensorMismatchError(
            f"kv must be a torch.Tensor [n, {_shape(lay)}], got {type(kv).__name__}"
        )
    if kv.dtype != lay.dtype:
        raise TensorMismatchError(
            f"kv has dtype {kv.dtype}; this store's layout holds {lay.dtype} "
            "(convert with kv.to(layout.dtype) or open the store with the engine's dtype)"
        )
    if kv.dim() != 6 or tuple(kv.shape[1:]) != lay.block_shape:
        raise TensorMismatchError(
            f"kv must have shape [n, L, P, T, H, D] = [n, {_shape(lay)}], got {list(kv.shape)}"
        )
    if kv.shape[0] != n:
        raise TensorMismatchError(
            f"kv holds {kv.shape[0]} blocks but {n} keys were given; pass one key per block"
        )
    if kv.device.type not in ("cpu", device.type) or (
        kv.device.type == device.type
        and kv.device.index is not None
        and device.index is not None
        and kv.device.index != device.index
    ):
        raise TensorMismatchError(f"kv is on {kv.device}; this store takes tensors on {device} or cpu")


def check_out(lay: KVLayout, out: object, n: int, *, device: torch.device | None = None) -> None:
    """``out`` must be a contiguous ``[>= n, L, P, T, H, D]`` tensor of the layout's dtype, in
    host memory or on ``device`` (when given): a copy into another GPU's memory would run on
    that device's stream, which the store's events do not cover."""
    if not isinstance(out, torch.Tensor):
        raise TensorMismatchError("out must be a torch.Tensor [n, L, P, T, H, D]")
    if out.dtype != lay.dtype:
        raise TensorMismatchError(f"out has dtype {out.dtype}; the layout needs {lay.dtype}")
    if out.dim() != 6 or tuple(out.shape[1:]) != lay.block_shape:
        raise TensorMismatchError(f"out must have shape [n, {_shape(lay)}], got {list(out.shape)}")
    if out.shape[0] < n:
        raise TensorMismatchError(f"out holds {out.shape[0]} blocks, {n} keys were asked for")
    if not out.is_contiguous():
        raise TensorMismatchError("out must be contiguous")
    if device is not None and out.device.type != "cpu" and not _same_device(out.device, device):
        raise TensorMismatchError(
            f"out is on {out.device}; this store fetches into {device} or host memory "
            f"(allocate out on {device}, or copy the result across afterwards)"
        )


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a torch device the hot tier can run on (default: the current CUDA
    device, else the CPU); :class:`ConfigError` naming what to pass otherwise."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a torch device ('cpu', 'cuda:0', ...)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available here; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"device={device!r}: the hot tier runs on 'cpu' or 'cuda:N'")
    return dev
