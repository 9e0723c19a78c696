#!/usr/bin/env bash
# The main job: installs transport (+ matplotlib for the plot) and runs the RLHF weight-sync
# example: one trainer and two generator processes on this machine, file rendezvous.
# Extra arguments pass through, e.g. --slow-generator gen-1, --kill-at 100, --launcher ray.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh examples
exec "${PYTHON:-python3}" -m examples.rlhf_sync --out runs/rlhf_sync "$@"
