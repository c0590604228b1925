#!/usr/bin/env bash
# Creates .venv (Python 3.10+) and installs torchtrace with its test dependencies.
# The pinned CPU torch goes in first, so the range in pyproject.toml pulls nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TORCHTRACE_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[dev]"
