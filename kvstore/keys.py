"""Content keys: chained SHA-256 over token blocks (``docs/architecture.md`` "Keys").

``root = SHA-256(b"kvstore/1" || namespace_id || salt)``;
``key_i = SHA-256(key_{i-1} || tokens_i as uint32 LE || extra_i)`` with ``key_{-1} = root``.
Only full blocks are keyed. Keys are deterministic across processes, hosts and restarts.

The chain is computed by a native extension (``kvstore._native``) when it is importable and
``KVSTORE_PURE_PYTHON`` is not set, else by the pure-Python path; both give identical bytes
(pinned by golden vectors in the tests). :data:`backend` names the active one.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import NewType, SupportsIndex, overload

from kvstore.errors import KeyFormatError, TokenError

BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 32
_ROOT_TAG = b"kvstore/1"
_MAX_TOKEN = 2**32

_sha256 = hashlib.sha256


class KeyChain(list[BlockKey]):
    """The keys of consecutive blocks of one prompt, as a ``list`` of 32-byte ``bytes``.

    Besides the keys it remembers which namespace produced them and the key of the block
    before the first one (``None`` when the chain starts at the root), so a store can reject
    keys of another model and keep its cache prefix-closed. Slices keep both.
    """

    __slots__ = ("namespace_id", "parent")

    def __init__(
        self,
        keys: Iterable[BlockKey] = (),
        namespace_id: bytes | None = None,
        parent: BlockKey | None = None,
    ) -> None:
        super().__init__(keys)
        self.namespace_id = namespace_id
        self.parent = parent

    @overload
    def __getitem__(self, i: SupportsIndex) -> BlockKey: ...
    @overload
    def __getitem__(self, i: slice) -> KeyChain: ...
    def __getitem__(self, i):  # type: ignore[override]
        if not isinstance(i, slice):
            return super().__getitem__(i)
        items = super().__getitem__(i)
        start, _stop, step = i.indices(len(self))
        if step != 1 or not items:
            # not a run of consecutive blocks: there is no parent to keep
            return KeyChain(items, self.namespace_id, None)
        parent = self.parent if start == 0 else super().__getitem__(start - 1)
        return KeyChain(items, self.namespace_id, parent)

    def __repr__(self) -> str:
        head = ", ".join(list.__getitem__(self, i).hex()[:12] for i in range(min(3, len(self))))
        more = ", ..." if len(self) > 3 else ""
        return f"KeyChain([{head}{more}], n={len(self)})"


def salt_bytes(salt: str | bytes | None) -> bytes:
    """``str`` salts are UTF-8; ``None`` is the empty salt."""
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode("utf-8")
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return bytes(salt)
    raise TokenError(f"salt must be str, bytes or None, not {type(salt).__name__}")


def root_key(namespace_id: bytes, salt: str | bytes | None = None) -> BlockKey:
    """The chain's root: ``SHA-256(b"kvstore/1" || namespace_id || salt)``."""
    if len(namespace_id) != KEY_BYTES:
        raise KeyFormatError(f"namespace_id must be 32 bytes, got {len(namespace_id)}")
    return BlockKey(_sha256(_ROOT_TAG + bytes(namespace_id) + salt_bytes(salt)).digest())


def tokens_to_u32le(token_ids: object) -> bytes:
    """Validate token ids and encode them as uint32 little-endian bytes.

    Accepts a sequence of ints, a numpy integer array or a torch integer tensor (any device),
    1-D (or one row: shape ``[1, n]``). Raises :class:`TokenError` for negative, too large or
    non-integer tokens (bools included), and for arrays of several rows.
    """
    if isinstance(token_ids, (bytes, bytearray, str)):
        raise TokenError(
            f"token_ids must be a sequence of ints or an integer array, not {type(token_ids).__name__}"
        )
    mod = type(token_ids).__module__
    if mod.startswith("torch") or mod.startswith("numpy"):
        return _array_to_u32le(token_ids)
    if type(token_ids) not in (list, tuple, range, array):
        try:  # an iterator is read once: keep its items for the checks below
            token_ids = list(token_ids)  # type: ignore[call-overload]
        except TypeError:
            raise TokenError("token_ids must be a sequence of ints or an integer array, not "
                             f"{type(token_ids).__name__}") from None
    if type(token_ids) in (list, tuple) and bool in set(map(type, token_ids)):  # type: ignore[call-overload]
        raise TokenError("token_ids must contain only ints (got "
                         f"{_first_non_int(token_ids)!r}); a bool is not a token id")
    try:
        arr = array("I", token_ids)  # C-speed range and type check for the common list case
    except OverflowError:
        raise TokenError(_range_message(token_ids)) from None
    except TypeError:
        raise TokenError(
            "token_ids must contain only ints (got "
            f"{_first_non_int(token_ids)!r}); convert floats or strings to token ids first"
        ) from None
    if arr.itemsize != 4:  # pragma: no cover - no such platform in practice
        return _array_to_u32le(list(arr))
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _array_to_u32le(token_ids: object) -> bytes:
    import numpy as np

    if type(token_ids).__module__.startswith("torch"):
        import torch

        t = token_ids
        if not isinstance(t, torch.Tensor):
            raise TokenError(f"token_ids of type {type(t).__name__} are not supported")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TokenError(f"token_ids tensor must have an integer dtype, not {t.dtype}")
        _check_one_row(tuple(t.shape))
        try:
            a = t.detach().to("cpu").resolve_neg().reshape(-1).numpy()  # a lazy negation
        except (RuntimeError, NotImplementedError) as e:  # a meta tensor, a lost device
            raise TokenError(f"token_ids tensor on {t.device} cannot be read ({e}); pass "
                             "token ids that hold values (a list, a CPU tensor)") from None
    else:
        a = np.asarray(token_ids)
        _check_one_row(a.shape)
        a = a.reshape(-1)
    if a.dtype.kind not in "iu":
        raise TokenError(f"token_ids array must have an integer dtype, not {a.dtype}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= _MAX_TOKEN):
        raise TokenError(_range_message(a.tolist()))
    return a.astype("<u4", copy=False).tobytes()


def one_row(shape: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` holds one prompt: 1-D, or one row (``[1, n]``)."""
    return len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)


def _check_one_row(shape: tuple[int, ...]) -> None:
    if not shape:
        raise TokenError("token_ids must be a 1-D sequence of token ids, got a 0-d array (one "
                         "number): wrap it in a list")
    if not one_row(shape):
        raise TokenError(
            f"token_ids must be one prompt's tokens, 1-D (or one row, shape [1, n]); got an "
            f"array of shape {list(shape)}: pass each prompt on its own (tokens[i]), never a "
            "batch (its rows would be keyed as one prompt)")


def _range_message(tokens: Iterable[object]) -> str:
    for t in tokens:
        if isinstance(t, int) and not 0 <= t < _MAX_TOKEN:
            return f"token id {t} is out of range: token ids must be in [0, 2**32)"
    return "token ids must be in [0, 2**32)"


def _first_non_int(tokens: Iterable[object]) -> object:
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool):
            return t
    return None


def _check_extras(extras: Sequence[bytes | None] | None, n_full: int, n_any: int) -> None:
    if extras is None:
        return
    if len(extras) not in (n_full, n_any):
        raise KeyFormatError(
            f"extras must have one entry per block ({n_full} full blocks"
            + (f", or {n_any} counting the partial last one" if n_any != n_full else "")
            + f"), got {len(extras)}"
        )
    for i, e in enumerate(extras[:n_full]):
        if e is not None and not isinstance(e, (bytes, bytearray, memoryview)):
            raise KeyFormatError(f"extras[{i}] must be bytes or None, not {type(e).__name__}")


def chain_python(
    root: bytes, token_bytes: bytes, block_tokens: int, extras: Sequence[bytes | None] | None
) -> list[BlockKey]:
    """Reference implementation of the key chain over uint32 LE ``token_bytes``."""
    step = 4 * block_tokens
    n_full = len(token_bytes) // step
    out: list[BlockKey] = []
    append = out.append
    k = root
    if extras is None:
        for off in range(0, n_full * step, step):
            k = _sha256(k + token_bytes[off : off + step]).digest()
            append(k)
    else:
        for i in range(n_full):
            e = extras[i]
            data = k + token_bytes[i * step : (i + 1) * step]
            k = _sha256(data + bytes(e) if e else data).digest()
            append(k)
    return out


def _load_native():
    if os.environ.get("KVSTORE_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from kvstore import _native  # type: ignore[attr-defined]
    except ImportError:
        return None
    if not hasattr(_native, "chain_keys"):  # pragma: no cover - a stale build of another era
        return None
    return _native


_native = _load_native()
#: Which implementation computes key chains: ``"native"`` or ``"python"``.
backend = "native" if _native is not None else "python"


def block_keys(
    namespace_id: bytes,
    token_ids: object,
    block_tokens: int,
    *,
    salt: str | bytes | None = None,
    extras: Sequence[bytes | None] | None = None,
) -> KeyChain:
    """Keys of every full block of ``token_ids`` (see module docstring for the scheme)."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise KeyFormatError(f"block_tokens must be a positive int, got {block_tokens!r}")
    root = root_key(namespace_id, salt)
    if _native is not None:
        # Hand lists, tuples and CPU integer arrays to the extension as they are: it validates
        # and converts them in C. Anything else takes the tokens_to_u32le route below.
        direct: object = None
        tt = type(token_ids)
        if tt is list or tt is tuple:
            direct = token_ids
        elif tt.__module__ == "numpy" or tt.__module__.startswith("torch"):
            try:
                a: object = None
                if tt.__module__ == "numpy" and tt.__name__ == "ndarray":
                    a = token_ids
                else:
                    torch = sys.modules.get("torch")
                    if (
                        torch is not None
                        and tt is torch.Tensor
                        and token_ids.device.type == "cpu"  # type: ignore[attr-defined]
                        and not token_ids.dtype.is_floating_point  # type: ignore[attr-defined]
                        and not token_ids.dtype.is_complex  # type: ignore[attr-defined]
                        and token_ids.dtype != torch.bool  # type: ignore[attr-defined]
                    ):
                        a = token_ids.detach().numpy()  # type: ignore[attr-defined]
                if (a is not None and a.dtype.kind in "iu"  # type: ignore[attr-defined]
                        and a.dtype.itemsize in (2, 4, 8) and one_row(a.shape)):  # type: ignore[attr-defined]
                    direct = a.reshape(-1)  # type: ignore[attr-defined]
            except Exception:  # an exotic array or tensor: let the Python path judge it
                direct = None
        if direct is not None:
            n_tokens = len(direct)  # type: ignore[arg-type]
            n_full = n_tokens // block_tokens
            try:
                _check_extras(extras, n_full, -(-n_tokens // block_tokens))
            except KeyFormatError:
                tokens_to_u32le(token_ids)  # like the Python path, report bad tokens first
                raise
            ex = None
            if extras is not None:
                ex = [e if e is None or type(e) is bytes else bytes(e) for e in extras[:n_full]]
            try:
                keys = _native.chain_keys(root, direct, block_tokens, ex)
            except (OverflowError, TypeError, ValueError) as e:
                # Rejected by the extension: re-validate in Python so the TokenError (and its
                # message) is exactly the one the Python path raises.
                tokens_to_u32le(token_ids)
                raise TokenError(f"invalid token_ids: {e}") from None
            return KeyChain(keys, bytes(namespace_id), None)
    tb = tokens_to_u32le(token_ids)
    n_tokens = len(tb) // 4
    n_full = n_tokens // block_tokens
    _check_extras(extras, n_full, -(-n_tokens // block_tokens))
    ex = None if extras is None else list(extras[:n_full])
    if _native is not None:
        if ex is not None:
            ex = [e if e is None or type(e) is bytes else bytes(e) for e in ex]
        keys = _native.chain_keys(root, tb, block_tokens, ex)
    else:
        keys = chain_python(root, tb, block_tokens, ex)
    return KeyChain(keys, bytes(namespace_id), None)


def all_keys(seq: object) -> bool:
    """Whether ``seq`` is a list or tuple of 32-byte ``bytes`` (one C loop when native)."""
    if _native is not None:
        return _native.all_keys(seq)
    return isinstance(seq, (list, tuple)) and (
        not seq or (set(map(type, seq)) == {bytes} and set(map(len, seq)) == {KEY_BYTES}))


def join_keys(seq: object) -> bytes | None:
    """The keys of ``seq`` concatenated, or ``None`` unless :func:`all_keys` holds."""
    if _native is not None:
        return _native.join_keys(seq)
    return b"".join(seq) if all_keys(seq) else None  # type: ignore[arg-type]


def check_key(key: object, what: str | None = None) -> BlockKey:
    """Return ``key`` as bytes if it is a 32-byte key, else raise :class:`KeyFormatError`:
    naming ``what`` (``"key must be 32 bytes"``, the tiers' word) or, without it, telling
    the caller where block keys come from (the store's and client's)."""
    if isinstance(key, bytes) and len(key) == KEY_BYTES:
        return BlockKey(key)
    if isinstance(key, (bytearray, memoryview)) and len(key) == KEY_BYTES:
        return BlockKey(bytes(key))
    got = type(key).__name__ + (f" of length {len(key)}" if isinstance(key, (bytes, bytearray))
                                else "")
    if what is None:
        raise KeyFormatError(f"block keys must be 32-byte bytes objects from block_keys(), got {got}")
    raise KeyFormatError(f"{what} must be {KEY_BYTES} bytes, got {got}")
