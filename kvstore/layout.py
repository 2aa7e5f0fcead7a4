"""``KVLayout``: the shape and dtype of one stored block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import LayoutError

# dtype <-> canonical name; the name is what goes into namespaces and on disk.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.uint8: "uint8",
}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _name
_NAME_DTYPES = {v: k for k, v in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a supported KV dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise LayoutError(
            f"dtype {dtype} is not supported for KV blocks; use one of "
            f"{', '.join(sorted(_NAME_DTYPES))}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    try:
        return _NAME_DTYPES[name]
    except KeyError:
        raise LayoutError(
            f"unknown KV dtype name {name!r}; expected one of {', '.join(sorted(_NAME_DTYPES))}"
        ) from None


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"KVLayout.{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise LayoutError(f"KVLayout.{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one block: ``[num_layers, kv_planes, block_tokens, num_kv_heads, head_dim]``.

    ``kv_planes`` is 2 for separate K and V, 1 for MLA latents.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    block_tokens: int = 16
    kv_planes: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "kv_planes"):
            _positive_int(name, getattr(self, name))
        if self.kv_planes not in (1, 2):
            raise LayoutError(
                f"KVLayout.kv_planes must be 2 (separate K and V) or 1 (MLA latents), "
                f"got {self.kv_planes}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        dtype_name(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block tensor."""
        return (self.num_layers, self.kv_planes, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

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
