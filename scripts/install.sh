#!/usr/bin/env bash
# Installs transport and what it needs into the current Python environment (idempotent).
# torch is pinned to the CPU build that lies on this kind of machine's disk: any other torch
# request would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
extras=${1:-}
# libucx-cu12 before the build: csrc/ compiles the ucx backend against its headers (the
# library itself is loaded at run time, so a build without it still works, minus ucx).
"$PY" -m pip install --quiet --disable-pip-version-check "torch==${TRANSPORT_TORCH_VERSION:-2.13.0}" "libucx-cu12>=1.18"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".${extras:+[$extras]}"
