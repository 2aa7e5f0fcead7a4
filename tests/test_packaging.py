"""The built wheel carries everything kvstore reads at run time (the CUDA kernel source)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_wheel_ships_the_cuda_kernel_source(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvstore-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "kvstore/paged_copy.cu" in names
        src = z.read("kvstore/paged_copy.cu").decode()
    assert src == (ROOT / "kvstore" / "paged_copy.cu").read_text()
    assert "__global__" in src
