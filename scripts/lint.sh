#!/usr/bin/env bash
# Lint and type checks with the settings in pyproject.toml ([tool.ruff], [tool.mypy]): ruff over
# transport, benchmarks, examples and tests, then mypy (strict on the public modules). Both run
# even when the first finds something. scripts/test.sh (the test command) runs it first.
#
#     bash scripts/lint.sh      # needs the dev extra: bash scripts/install.sh dev
#
# Exit status: 0 nothing found, 1 findings (or a tool is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
for tool in ruff mypy; do
    if ! "$PY" -c "import $tool" 2>/dev/null; then
        echo "lint: $tool is not installed in $PY (bash scripts/install.sh dev, or pip install -e '.[dev]')" >&2
        exit 1
    fi
done
rc=0
echo "== ruff check transport benchmarks examples tests"
"$PY" -m ruff check transport benchmarks examples tests || rc=1
echo "== mypy (files and settings: pyproject.toml)"
"$PY" -m mypy || rc=1
echo "== module sizes (warnings only)"
"$PY" scripts/module_sizes.py
exit "$rc"
