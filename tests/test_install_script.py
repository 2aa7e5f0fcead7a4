"""install.sh (issue 31 item 1): it installs into a virtual environment, .venv beside it by
default, since a distribution's python3 refuses pip installs outside one (PEP 668); inside an
active virtual or conda environment it uses that one. Checked with a stand-in python that
logs what it is asked to do (the real install is what the README's clean-shell run checks)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FAKE = r"""#!/usr/bin/env bash
# a stand-in python: logs each call; venv and pip are pretended, the environment check is
# asked of a real interpreter ($FAKE_REAL), the other -c snippets are answered here
echo "$0 $*" >> "$FAKE_LOG"
if [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin"
    if [ -n "${FAKE_VENV_FAIL:-}" ]; then echo "ensurepip is not available" >&2; exit 1; fi
    cp "$0" "$3/bin/python"
    exit 0
fi
if [ "$1" = -m ] && [ "$2" = pip ]; then exit 0; fi
case "$2" in
    *base_prefix*) exec "$FAKE_REAL" "$@" ;;
    *"import torch"*) exit "${FAKE_NO_TORCH:-0}" ;;
    *) echo "fake python"; exit 0 ;;
esac
"""


def base_python() -> str:
    """An interpreter outside any virtual environment (the one this venv was made from)."""
    exe = getattr(sys, "_base_executable", None) or sys.executable
    if sys.prefix != sys.base_prefix and not os.path.exists(exe):
        exe = os.path.join(sys.base_prefix, "bin", "python3")
    return exe


@pytest.fixture
def sandbox(tmp_path):
    """install.sh copied into an empty directory (it works in its own directory), a fake
    python, and a clean environment like `env -i PATH=/usr/bin:/bin HOME=...`."""
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy2(REPO / "install.sh", work / "install.sh")
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": str(fake),
           "FAKE_LOG": str(log), "FAKE_REAL": base_python(), "FAKE_NO_TORCH": "1"}

    def run(**extra):
        log.write_text("")
        p = subprocess.run(["bash", str(work / "install.sh")], cwd=tmp_path, env=env | extra,
                           capture_output=True, text=True, timeout=60)
        return p, log.read_text().splitlines()

    return work, fake, run


def test_a_plain_python_gets_a_venv_beside_install_sh(sandbox):
    work, fake, run = sandbox
    p, calls = run()
    assert p.returncode == 0, p.stderr
    venv_py = ".venv/bin/python"
    assert f"{fake} -m venv .venv" in calls
    assert f"{venv_py} -m pip install --quiet torch==2.13.0" in calls  # no torch there yet
    assert any(c.startswith(f"{venv_py} -m pip install") and "-e .[hf]" in c for c in calls)
    assert not any(c.startswith(f"{fake} -m pip install") for c in calls)
    assert ".venv/bin/kvstore demo" in p.stdout
    p, calls = run()  # a second run reuses it
    assert p.returncode == 0 and not any("-m venv" in c for c in calls)


def test_an_active_venv_is_used_as_it_is(sandbox, tmp_path):
    work, fake, run = sandbox
    subprocess.run([base_python(), "-m", "venv", "--without-pip", str(tmp_path / "active")],
                   check=True, timeout=60)
    p, calls = run(FAKE_REAL=str(tmp_path / "active" / "bin" / "python"), FAKE_NO_TORCH="0")
    assert p.returncode == 0, p.stderr
    assert not any("-m venv" in c for c in calls) and not (work / ".venv").exists()
    assert not any("torch==" in c for c in calls)  # an installed torch is kept
    assert any(c.startswith(f"{fake} -m pip install") and "-e .[hf]" in c for c in calls)


def test_kvstore_venv_chooses_the_place_or_none(sandbox, tmp_path):
    work, fake, run = sandbox
    p, calls = run(KVSTORE_VENV=str(tmp_path / "elsewhere"))
    assert p.returncode == 0, p.stderr
    assert f"{fake} -m venv {tmp_path / 'elsewhere'}" in calls
    assert not (work / ".venv").exists()
    p, calls = run(KVSTORE_VENV="none")
    assert p.returncode == 0, p.stderr
    assert not any("-m venv" in c for c in calls)
    assert any(c.startswith(f"{fake} -m pip install") and "-e .[hf]" in c for c in calls)


def test_without_the_venv_module_it_says_which_package_to_install(sandbox):
    work, _fake, run = sandbox
    p, calls = run(FAKE_VENV_FAIL="1")
    assert p.returncode == 1
    assert "apt-get install -y python3-venv" in p.stderr
    assert not (work / ".venv").exists()  # no half-made environment left to reuse
    assert not any("pip install" in c for c in calls)
