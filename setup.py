"""Build script for the optional native extension ``kvstore._native`` (ext/).

Project metadata lives in pyproject.toml; this file only declares the C extension. The
extension is optional: without a working C compiler the install still succeeds (with a
warning) and kvstore uses its pure-Python key path, which gives identical keys.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools >= 59 vendors distutils; both spellings name the same classes
    from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError
except ImportError:  # pragma: no cover - very old setuptools
    from distutils.errors import CCompilerError, CompileError, LinkError
    from distutils.errors import DistutilsExecError as ExecError
    from distutils.errors import DistutilsPlatformError as PlatformError

_BUILD_ERRORS = (CCompilerError, CompileError, LinkError, ExecError, PlatformError, OSError)

NATIVE = Extension(
    "kvstore._native",
    sources=["ext/chainhash.c", "ext/sha256.c"],
    depends=["ext/sha256.h"],
    include_dirs=["ext"],
    optional=True,
)

#: the batched engine's one-pass RMSNorm (ext/rmsnorm.c); without it the model's own runs
RMSNORM = Extension("kvstore._rmsnorm", sources=["ext/rmsnorm.c"], depends=["ext/kv_clones.h"],
                    optional=True)
#: the batched engine's one-pass rotary embedding (ext/rope.c); without it the model's own
ROPE = Extension("kvstore._rope", sources=["ext/rope.c"], depends=["ext/kv_clones.h"],
                 optional=True)
#: the batched engine's float32 attention (ext/attention.c); without it torch's flash kernel.
#: OpenMP: it needs libgomp.so.1, which torch's wheel bundles (one runtime, torch's threads)
ATTENTION = Extension("kvstore._attention", sources=["ext/attention.c"], optional=True)
#: the same kernel built for AVX2 and AVX-512 (engines/flash.py imports the best one torch's
#: CPU capability allows): about twice the generic build's speed where it runs
ATTENTION_ISA = [Extension(f"kvstore._attention_{isa}", sources=[f"ext/attention_{isa}.c"],
                           depends=["ext/attention.c"], include_dirs=["ext"], optional=True)
                 for isa in ("avx2", "avx512")]
#: more flags per extension (gcc/clang): RMSNorm's simd pragmas (no OpenMP runtime), the
#: attention kernel's OpenMP (linked to libgomp.so.1: torch's own once torch is imported)
_FLAGS = {"kvstore._rmsnorm": ["-fopenmp-simd"],
          # HF's rotary rounds each product: no fused multiply-adds (GCC contracts by default)
          "kvstore._rope": ["-fopenmp-simd", "-ffp-contract=off"],
          "kvstore._attention": ["-fopenmp", "-fno-math-errno", "-Wno-psabi"]}
_ISA_FLAGS = {"avx2": ["-mavx2", "-mfma"],
              "avx512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"]}
for _isa, _isa_flags in _ISA_FLAGS.items():
    _FLAGS[f"kvstore._attention_{_isa}"] = [*_FLAGS["kvstore._attention"], *_isa_flags]
_LINK_FLAGS = {name: ["-fopenmp"] for name in _FLAGS if name.startswith("kvstore._attention")}
#: what a failed build of each extension costs
_FALLBACK = {
    "kvstore._native": "kvstore will use its pure-Python key path (identical keys, slower).",
    "kvstore._rmsnorm": "the batched engine will run the model's own RMSNorm (slower).",
    "kvstore._rope": "the batched engine will run the model's own rotary embedding (slower).",
    "kvstore._attention": "the batched engine will run torch's attention kernel (slower).",
    "kvstore._attention_avx2": "the batched engine's attention kernel runs its generic build.",
    "kvstore._attention_avx512": "the batched engine's attention kernel runs its generic or "
                                 "AVX2 build.",
}


def _warn(msg: str, name: str = "kvstore._native") -> None:
    bar = "*" * 78
    print(f"\n{bar}\nWARNING: {msg}\n{_FALLBACK[name]}\n{bar}\n", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: a missing compiler or a compile error only warns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._failed: set[str] = set()

    def run(self) -> None:
        try:
            super().run()
        except _BUILD_ERRORS as e:
            self._failed.update(ext.name for ext in self.extensions)
            for ext in self.extensions:
                _warn(f"could not build the native extension {ext.name}: {e}", ext.name)

    def build_extension(self, ext: Extension) -> None:
        ctype = self.compiler.compiler_type if self.compiler is not None else ""
        if ctype == "msvc":
            ext.extra_compile_args = ["/O2"]
        else:
            ext.extra_compile_args = ["-O3", "-fvisibility=hidden", *_FLAGS.get(ext.name, ())]
            ext.extra_link_args = list(_LINK_FLAGS.get(ext.name, ()))
            if os.environ.get("KVSTORE_NATIVE_DEBUG"):
                ext.extra_compile_args += ["-O0", "-g", "-Wall", "-Wextra"]
        try:
            super().build_extension(ext)
        except _BUILD_ERRORS as e:
            self._failed.add(ext.name)
            _warn(f"could not build the native extension {ext.name}: {e}", ext.name)

    # Editable installs copy built extensions into the source tree and list them as outputs;
    # leave out the ones that failed so a failed build does not break the install.
    def copy_extensions_to_source(self) -> None:
        kept = self.extensions
        self.extensions = [e for e in kept if e.name not in self._failed]
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = kept

    def get_outputs(self) -> list[str]:
        outputs = super().get_outputs()
        return [p for p in outputs if os.path.exists(p)] if self._failed else outputs

    def get_output_mapping(self) -> dict[str, str]:
        mapping = super().get_output_mapping()
        if self._failed:
            mapping = {k: v for k, v in mapping.items() if os.path.exists(k)}
        return mapping


setup(ext_modules=[NATIVE, RMSNORM, ROPE, ATTENTION, *ATTENTION_ISA], cmdclass={"build_ext": OptionalBuildExt})
