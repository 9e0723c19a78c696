#!/usr/bin/env bash
# The test command: installs everything (with the dev extra) and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev,examples,ray
exec "${PYTHON:-python3}" -m pytest "$@"
