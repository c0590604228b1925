#!/usr/bin/env bash
# The whole test suite, set-up and static checks (scripts/lint.sh) included.
# TORCHTRACE_SKIP_LINT=1 runs the tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "${TORCHTRACE_SKIP_LINT:-0}" != "1" ]; then
  PYTHON=.venv/bin/python ./scripts/lint.sh
fi
# Two passes. First every test but the `serial` ones, in parallel (pytest-xdist): one worker
# more than the cores, 2 to 4, as many tests wait on processes they started (on 2 cores the
# pass took 332 s with 2 workers, 268 s with 3, 258 s with 4); TORCHTRACE_TEST_WORKERS=N picks N.
# Then the `serial` tests (they check measured wall time against planted sleeps; see
# SERIAL_TESTS in tests/conftest.py) alone.
# TORCHTRACE_TEST_WORKERS=0: one pass, one process, as plain pytest.
if [ -n "${TORCHTRACE_TEST_WORKERS:-}" ]; then
  workers="$TORCHTRACE_TEST_WORKERS"
else
  workers="$(( $(nproc 2>/dev/null || echo 1) + 1 ))"
  [ "$workers" -gt 4 ] && workers=4
  [ "$workers" -lt 2 ] && workers=2
fi
if [ "$workers" = "0" ]; then
  exec .venv/bin/python -m pytest -q -p no:xdist "$@"
fi
# A marker expression of the caller's (-m EXPR) narrows both passes: pytest keeps only the
# last -m it is given, so passed on as it is it would replace the passes' own.
marks=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -m)
      if [ $# -lt 2 ]; then echo "scripts/test.sh: -m needs a marker expression" >&2; exit 4; fi
      marks="$2"; shift 2 ;;
    -m*) marks="${1#-m}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
parallel_marks="not serial"
serial_marks="serial"
if [ -n "$marks" ]; then
  parallel_marks="not serial and ($marks)"
  serial_marks="serial and ($marks)"
fi
status=0
.venv/bin/python -m pytest -q -n "$workers" --dist loadgroup -m "$parallel_marks" ${args[@]+"${args[@]}"} || status=$?
serial=0
.venv/bin/python -m pytest -q -p no:xdist -m "$serial_marks" ${args[@]+"${args[@]}"} || serial=$?
# 5: the selection left no test in that pass (one of them may be empty, not both)
[ "$status" -eq 5 ] && [ "$serial" -ne 5 ] && status=0
[ "$serial" -eq 5 ] && serial=0
[ "$status" -ne 0 ] && exit "$status"
exit "$serial"
