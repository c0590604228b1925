#!/usr/bin/env bash
# The demo training run, set-up included. Extra arguments go to `torchtrace demo`.
# It runs in the caller's directory: a relative --run-dir (and the default ./torchtrace-runs)
# is taken from there, not from the checkout.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/setup.sh"
exec "$root/.venv/bin/torchtrace" demo "$@"
