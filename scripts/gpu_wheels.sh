#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the pure-Python wheels scripts/gpu_check.sh installs
# offline on a GPU machine whose image lacks them (no network there): trio and pytest-trio with
# their dependencies. Run it here, on a machine with PyPI access, then carry .whl/ along:
#
#     bash scripts/gpu_wheels.sh && <copy the repo with .whl/ to the GPU machine> && bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TARGET_PY=${GPU_PYTHON_VERSION:-3.12}  # the GPU image's Python
mkdir -p .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --python-version "$TARGET_PY" --implementation cp --platform manylinux2014_x86_64 \
    -d .whl trio pytest-trio pytest-timeout outcome sniffio sortedcontainers attrs idna
ls .whl
