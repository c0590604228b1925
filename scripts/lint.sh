#!/usr/bin/env bash
# Static checks CI runs before the tests: ruff (pycodestyle, pyflakes, import order) on the
# package and its tests, and mypy on the package (settings in pyproject.toml).
#
#   scripts/lint.sh            # both; exits non-zero on any finding
#   ruff check --fix --select I torchtrace tests   # puts imports in order (what ruff can fix)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m ruff check torchtrace tests
"$PY" -m mypy torchtrace
