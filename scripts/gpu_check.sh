#!/usr/bin/env bash
# One device call: GPU tests, then the kernel benchmark. Results land in $OUT (device tool) or /tmp/gpu_check.
# usage: bash scripts/gpu_check.sh [benchmark args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh /tmp/gpu_check
# -rf: the failures' names in the summary; each failure's line also as it happens, should the time limit cut the run
timeout ${TEST_TIMEOUT:-900} python3 -m pytest -v -rf $PYTEST_FLAGS --maxfail=20 -p no:cacheprovider tests/kernels tests/layers 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "FAILED|ERROR|Timeout|passed|failed" | tail -40
python3 benchmarks/bench_moe.py "$@" 2>&1 | tee "$OUT/bench.md"
