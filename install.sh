#!/usr/bin/env bash
# Install kvstore (editable) and what it needs.  Usage: ./install.sh [dev]
#
# torch: an installed torch (a CUDA build, say) is kept as it is. Without one, torch 2.13.0
# is installed first; on the CPU-only build machines that version resolves to a local CPU
# wheel, where a bare "torch" requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras="[hf]"
if [ "${1:-}" = "dev" ]; then extras="[dev,hf]"; fi
"$PY" -m pip install --quiet "setuptools>=68" wheel
"$PY" -m pip install --quiet --no-build-isolation -e ".${extras}"
"$PY" -c "import kvstore, kvstore.keys as k; print('kvstore', kvstore.__version__, '- key hashing:', k.backend)"
