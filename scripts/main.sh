#!/usr/bin/env bash
# The main job: installs transport and runs the example (two local processes, file rendezvous).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" examples/quickstart.py "$@"
