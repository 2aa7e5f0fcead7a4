"""``KVLayout``: the shape and dtype of one stored block.

Torch-free: a layout, its namespace id and its block size are computed without importing
torch (``import kvstore.client`` and the CLI's daemon commands never load it). ``dtype`` is a
``torch.dtype`` or its canonical name (``"bfloat16"``); :attr:`KVLayout.dtype` is always the
``torch.dtype`` (torch is imported the first time it is read), :attr:`KVLayout.dtype_name`
the name that goes into namespaces and on disk.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from kvstore.errors import LayoutError

if TYPE_CHECKING:
    import torch

#: canonical dtype name -> bytes per element: the KV dtypes a block may hold
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def _supported() -> str:
    return ", ".join(sorted(DTYPE_SIZES))


def _torch_dtype_name(dtype: object) -> str | None:
    """``str(dtype)`` without ``torch.`` when ``dtype`` is a torch dtype (torch is then
    imported already: nothing else makes one), else ``None``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")  # canonical: torch.half -> "float16"
    return None


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a supported KV dtype (``torch.bfloat16`` -> ``"bfloat16"``); a
    canonical name is returned as is."""
    name = dtype if isinstance(dtype, str) else _torch_dtype_name(dtype)
    if name in DTYPE_SIZES:
        return name  # type: ignore[return-value]
    if name is None or isinstance(dtype, str):
        raise LayoutError(f"KVLayout.dtype must be a torch.dtype or its name ({_supported()}), "
                          f"got {dtype!r}")
    raise LayoutError(f"dtype {dtype} is not supported for KV blocks; use one of {_supported()}")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` (imports torch)."""
    if name not in DTYPE_SIZES:
        raise LayoutError(f"unknown KV dtype name {name!r}; expected one of {_supported()}")
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise LayoutError(f"KV dtype {name} needs a newer torch (torch {torch.__version__} "
                          "does not have it)")
    return dt


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"KVLayout.{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise LayoutError(f"KVLayout.{name} must be > 0, got {value}")


_SHAPE_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "kv_planes")


class KVLayout:
    """Shape of one block: ``[num_layers, kv_planes, block_tokens, num_kv_heads, head_dim]``.

    ``kv_planes`` is 2 for separate K and V, 1 for MLA latents. ``dtype`` is a
    ``torch.dtype`` or its name (``"bfloat16"``, the default). Frozen and hashable; two
    layouts are equal when their shapes and dtypes are, however the dtype was given.
    """

    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype_name", "block_tokens",
                 "kv_planes", "_dtype")

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_name: str  # canonical name: "bfloat16"
    block_tokens: int
    kv_planes: int

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype | str = "bfloat16", block_tokens: int = 16,
                 kv_planes: int = 2) -> None:
        values = (num_layers, num_kv_heads, head_dim, block_tokens, kv_planes)
        for name, v in zip(_SHAPE_FIELDS, values, strict=True):
            _positive_int(name, v)
        if kv_planes not in (1, 2):
            raise LayoutError(
                f"KVLayout.kv_planes must be 2 (separate K and V) or 1 (MLA latents), "
                f"got {kv_planes}"
            )
        name = dtype_name(dtype)
        for field, v in zip(_SHAPE_FIELDS, values, strict=True):
            object.__setattr__(self, field, v)
        object.__setattr__(self, "dtype_name", name)
        object.__setattr__(self, "_dtype", None if isinstance(dtype, str) else dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The ``torch.dtype`` (torch is imported on first use when given by name)."""
        dt = self._dtype
        if dt is None:
            dt = dtype_from_name(self.dtype_name)
            object.__setattr__(self, "_dtype", dt)
        return dt

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"KVLayout is frozen: cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"KVLayout is frozen: cannot delete field {name!r}")

    def _key(self) -> tuple[object, ...]:
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_name,
                self.block_tokens, self.kv_planes)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not KVLayout:
            return NotImplemented
        return self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"KVLayout(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype=torch.{self.dtype_name}, "
                f"block_tokens={self.block_tokens}, kv_planes={self.kv_planes})")

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return KVLayout, self._key()  # pickled by name: unpickling needs no torch

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block tensor."""
        return (self.num_layers, self.kv_planes, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype_name]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block (every layer, every plane)."""
        n = self.itemsize
        for d in self.block_shape:
            n *= d
        return n

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer of one block; a block is ``num_layers`` of these, contiguous."""
        return self.block_nbytes // self.num_layers

    def batch_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of ``num_blocks`` blocks stacked: ``[n, L, P, T, H, D]``."""
        return (num_blocks, *self.block_shape)

    @property
    def bytes_per_token(self) -> int:
        return self.block_nbytes // self.block_tokens
