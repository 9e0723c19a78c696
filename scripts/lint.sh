#!/usr/bin/env bash
# Lint and type checks with the settings in pyproject.toml ([tool.ruff], [tool.mypy]): ruff over
# transport, benchmarks, examples and tests, then mypy (strict on the public modules), then the
# standard-header check of csrc/ (scripts/check_includes.sh, include-what-you-use), then the import
# graph (scripts/import_graph.py: no cycle among modules or folders). All run even
# when one finds something. scripts/test.sh (the test command) runs it first.
# Without include-what-you-use the header check is skipped with a note, unless
# TRANSPORT_CHECK_INCLUDES=1 (CI sets it, after installing Debian's iwyu): then it fails.
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
echo "== standard headers of csrc/ (scripts/check_includes.sh)"
if command -v "${IWYU:-include-what-you-use}" >/dev/null 2>&1 || [ "${TRANSPORT_CHECK_INCLUDES:-0}" = 1 ]; then
    bash scripts/check_includes.sh || rc=1
else
    echo "skipped: include-what-you-use is not installed (apt-get install iwyu); CI runs this check"
fi
echo "== import graph: no cycle, lazy and type-only imports included (scripts/import_graph.py)"
"$PY" scripts/import_graph.py || rc=1
echo "== module sizes (warnings only)"
"$PY" scripts/module_sizes.py
exit "$rc"
