#!/usr/bin/env bash
# Install kvstore (editable) and what it needs.  Usage: ./install.sh [dev]
#
# Where: a virtual environment, .venv in this directory (created when missing, reused after),
# because a distribution's python3 refuses pip installs outside one (PEP 668: Debian's and
# Ubuntu's "externally-managed-environment"). Run things with .venv/bin/kvstore and
# .venv/bin/python, or `source .venv/bin/activate` first. When python3 already runs from a
# virtual environment or a conda environment (an activated one), kvstore is installed there
# instead. KVSTORE_VENV=DIR puts the environment in DIR; KVSTORE_VENV=none installs into
# python3 itself (a container's own interpreter). PYTHON picks the interpreter (python3).
# Creating the environment needs Python's venv module: on Debian and Ubuntu that is the
# python3-venv package (apt-get install -y python3-venv).
#
# torch: an installed torch (a CUDA build, say) is kept as it is. Without one, torch 2.13.0
# is installed first; on the CPU-only build machines that version resolves to a local CPU
# wheel, where a bare "torch" requirement would pull a multi-GB CUDA build. Elsewhere, on a
# machine without a GPU, install the CPU build first and it is kept:
#   python3 -m venv .venv && .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

in_an_environment() {  # $1 runs from a virtual environment or a conda environment
    "$1" -c 'import os, sys
sys.exit(not (sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, "conda-meta"))))'
}

VENV="${KVSTORE_VENV:-}"
if [ -z "$VENV" ]; then
    if in_an_environment "$PY"; then VENV=none; else VENV=.venv; fi
fi
if [ "$VENV" != none ]; then
    if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
        fresh=0
        [ -e "$VENV" ] || fresh=1
        echo "install.sh: creating the virtual environment $VENV with $("$PY" -c \
            'import sys; print(sys.executable, "(Python", sys.version.split()[0] + ")")')"
        if ! "$PY" -m venv "$VENV"; then
            if [ "$fresh" = 1 ]; then rm -rf -- "$VENV"; fi
            echo "install.sh: '$PY -m venv $VENV' failed. On Debian or Ubuntu install the venv" \
                 "module first: apt-get install -y python3-venv (as root), then run" \
                 "./install.sh again" >&2
            exit 1
        fi
    fi
    PY="$VENV/bin/python"
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras="[hf]"
if [ "${1:-}" = "dev" ]; then extras="[dev,hf]"; fi
"$PY" -m pip install --quiet "setuptools>=68" wheel
"$PY" -m pip install --quiet --no-build-isolation -e ".${extras}"
"$PY" -c "import kvstore, kvstore.keys as k; print('kvstore', kvstore.__version__, '- key hashing:', k.backend)"
if [ "$VENV" != none ]; then
    echo "install.sh: installed in $VENV: run $VENV/bin/kvstore (e.g. $VENV/bin/kvstore demo)," \
         "or 'source $VENV/bin/activate' first"
else
    echo "install.sh: installed for $("$PY" -c 'import sys; print(sys.executable)')"
fi
