#!/usr/bin/env bash
# Issue 52's GPU points in one run on a CUDA machine, sized for one call of at most 10 minutes:
#   1. the CUDA tests: no synchronisation under set_sync_debug_mode("error"), CUDA memory
#      statistics, the phase clock's CUDA events, and the clip's equality and bytes read on cuda;
#   2. overhead.py on the 101M-parameter MLP: BASIC beyond the device floor;
#   3. overhead.py on the 124M GPT-style decoder in bf16 whose step clips its gradients: BASIC
#      against the bare step (target 1.005x), then 5 BASIC steps under sync debug "error".
#
#     bash benchmarks/gpu_checks.sh              # writes into $OUT (default /tmp/gpu-checks)
#
# A machine whose image has torch but not torchtrace's other dependencies takes them from the
# wheels in $WHEELS (default .whl, ignored by git; carry it to the machine with the checkout),
# made here for the machine's Python (3.12 on the machines lent so far):
#     pip download -d .whl --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#         opentelemetry-sdk opentelemetry-exporter-otlp prometheus-client psutil pytest pytest-timeout
# (11 MB on 2026-11-29). Only what the image lacks is installed from them.
# Each step's output goes to its own file in $OUT; a step that fails or runs out of time does
# not stop the next.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checks}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ]; then
    "$PY" -m pip install --no-index --find-links "$WHEELS" opentelemetry-sdk opentelemetry-exporter-otlp \
        prometheus-client psutil pytest pytest-timeout >"$OUT/install.txt" 2>&1
    echo "installs: exit status $?" >>"$OUT/install.txt"
fi
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))'
} >"$OUT/device.txt" 2>&1

run() {  # run NAME SECONDS COMMAND...: the command's output in $OUT/NAME.txt, its exit status last
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" "$@" >"$OUT/$name.txt" 2>&1
    echo "exit status $?" >>"$OUT/$name.txt"
    tail -n 3 "$OUT/$name.txt"
}

run cuda_tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_paths.py tests/record/test_no_sync.py \
    tests/step/test_clipping_equality.py tests/step/test_clipping_bytes.py
run mlp_101m 170 "$PY" benchmarks/overhead.py --device cuda --gpu-model --variants bare,floor,basic,basic-aa \
    --budget 60
run gpt_124m 200 "$PY" benchmarks/overhead.py --device cuda --gpt --variants bare,floor,basic,basic-aa --budget 90
