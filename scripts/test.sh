#!/usr/bin/env bash
# The whole test suite, set-up included.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Two or more workers (pytest-xdist), one per core up to 4; TORCHTRACE_TEST_WORKERS=1 runs
# in one process. Tests that must not share the machine with another test carry
# xdist_group("serial") and run one after another in a single worker (--dist loadgroup).
workers="${TORCHTRACE_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 2); [ "$n" -gt 4 ] && n=4; [ "$n" -lt 2 ] && n=2; echo "$n")}"
exec .venv/bin/python -m pytest -q -n "$workers" --dist loadgroup "$@"
