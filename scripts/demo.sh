#!/usr/bin/env bash
# The demo training run, set-up included. Extra arguments go to `torchtrace demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/torchtrace demo "$@"
