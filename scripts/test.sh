#!/usr/bin/env bash
# The whole test suite, set-up included.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
