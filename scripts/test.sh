#!/usr/bin/env bash
# The whole test suite, set-up and static checks (scripts/lint.sh) included.
# TORCHTRACE_SKIP_LINT=1 runs the tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "${TORCHTRACE_SKIP_LINT:-0}" != "1" ]; then
  PYTHON=.venv/bin/python ./scripts/lint.sh
fi
exec .venv/bin/python -m pytest -q "$@"
