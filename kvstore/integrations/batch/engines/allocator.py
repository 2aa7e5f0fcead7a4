"""Large tensors reused from the heap instead of fresh pages, during a batched-engine run.

glibc's ``malloc`` serves a block above its mmap threshold (128 KiB, raised on its own up to
32 MiB as such blocks are freed) from pages mapped for it alone and unmapped at ``free``, and
hands the top of its heap back to the OS above its trim threshold. A forward of the engine
allocates and frees tensors of tens of MiB per layer (a prefill's ``[3800, 2048]`` MLP
activations are 31 MiB, an attention chunk's scores up to 64 MiB): each is mapped again and
its pages faulted in (zeroed by the kernel) at first touch. On the 110M Llama of issue 28
(2 shared cores) that was 1.4-5.2 s of system time per job, and a prefill's SiLU or
``gate * up`` on ``[3800, 2048]`` took ~55 ms, ten times its arithmetic.

:func:`heap_reuse` raises both thresholds for the duration of a run (as allocators such as
tcmalloc or jemalloc, which CPU inference engines preload, keep freed memory for reuse), then
sets them to glibc's own ceiling (mmap 32 MiB, trim 64 MiB) and returns the free heap to the
OS with ``malloc_trim``. Measured (same process, alternating, load 2.6-4): doc 8.9/7.4 s ->
6.5/6.0 s, chat 14.1/15.6 -> 9.8/10.1 s, long 36.9/33.5 -> 31.6/29.4 s. Elsewhere than glibc
it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["heap_reuse"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: thresholds during a run: blocks below this come from (and go back to) the heap
RUN_THRESHOLD = 1 << 30
#: after a run: glibc's dynamic ceiling (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit; trim twice that)
AFTER_MMAP, AFTER_TRIM = 32 << 20, 64 << 20

_lock = threading.Lock()
_depth = 0
_libc: Any = None


def _glibc() -> Any:
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                if hasattr(lib, "mallopt") and hasattr(lib, "malloc_trim") \
                        and hasattr(lib, "gnu_get_libc_version"):
                    _libc = lib
    return _libc or None


@contextlib.contextmanager
def heap_reuse() -> Iterator[bool]:
    """Within the block, freed blocks up to :data:`RUN_THRESHOLD` stay in the heap for reuse
    (yields whether that could be set: glibc only). Nested or concurrent blocks share it."""
    global _depth
    lib = _glibc()
    if lib is None:
        yield False
        return
    with _lock:
        if _depth == 0:
            lib.mallopt(_M_MMAP_THRESHOLD, RUN_THRESHOLD)
            lib.mallopt(_M_TRIM_THRESHOLD, RUN_THRESHOLD)
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                lib.mallopt(_M_MMAP_THRESHOLD, AFTER_MMAP)
                lib.mallopt(_M_TRIM_THRESHOLD, AFTER_TRIM)
                lib.malloc_trim(0)
