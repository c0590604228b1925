#!/usr/bin/env bash
# Creates .venv (Python 3.10+) and installs torchtrace with its test dependencies.
# The pinned CPU torch goes in first, so the range in pyproject.toml pulls nothing more.
#
# A second run costs a fraction of a second: the install is recorded in .venv/.torchtrace-setup
# (a hash of pyproject.toml, the torch pin and the Python version) and pip runs again only
# when that changes. The package is installed in editable mode, so edits to torchtrace/ need
# no reinstall. TORCHTRACE_SETUP_FORCE=1 reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_PIN="${TORCHTRACE_TORCH_VERSION:-2.13.0}"
STAMP=.venv/.torchtrace-setup

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PY" --version 2>&1)" >&2
  "$PY" -m venv .venv
fi

want="$( { sha256sum pyproject.toml; echo "torch==$TORCH_PIN"; .venv/bin/python --version; } 2>&1 | sha256sum | cut -d' ' -f1)"
if [ "${TORCHTRACE_SETUP_FORCE:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && [ -x .venv/bin/torchtrace ]; then
  exit 0  # nothing changed since the last install
fi

LOG=.venv/setup.log
echo "setup: installing torch==$TORCH_PIN and torchtrace[dev] into .venv (first time: a minute or more; log: $LOG)" >&2
rm -f "$STAMP"
: > "$LOG"
pip_quiet() {
  if ! .venv/bin/python -m pip install -q "$@" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "setup: pip install $* failed; the whole log is in $LOG" >&2
    exit 1
  fi
}
pip_quiet --upgrade pip
.venv/bin/python - "$TORCH_PIN" <<'EOF' 2>/dev/null || pip_quiet "torch==$TORCH_PIN"
import sys, torch
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] else 1)
EOF
pip_quiet -e ".[dev]"
echo "$want" > "$STAMP"
echo "setup: done" >&2
