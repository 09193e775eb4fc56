#!/usr/bin/env bash
# One device call for adapters moving between host memory and GPU slots: the GPU tests of it (a slot write queued
# without the host waiting, overlap loading giving the bits of an engine without it, and the launched-ahead step
# test, alone, as its host-time bound is sensitive to a loaded machine), then benchmarks/bench_lora_swap.py. Results
# land in $OUT (device tool) or /tmp/gpu_lora_swap_check; each part has its own time limit (130 + 440 s; 0 skips the
# part: TEST_TIMEOUT=0 runs the benchmark alone).
# usage: bash scripts/gpu_lora_swap_check.sh [bench_lora_swap args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh /tmp/gpu_lora_swap_check
if [ "${TEST_TIMEOUT:-130}" != 0 ]; then
  timeout -k 10 ${TEST_TIMEOUT:-130} python3 -m pytest -v -rf -p no:cacheprovider -m gpu $(pytest_flags 0 load) \
    tests/engine/test_engine_gpu.py -k "slot or overlap_loading or launched_ahead" 2>&1 | tee "$OUT/pytest.log" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed"
fi
if [ "${BENCH_TIMEOUT:-440}" != 0 ]; then
  timeout -k 10 ${BENCH_TIMEOUT:-440} python3 benchmarks/bench_lora_swap.py "$@" 2>&1 | tee "$OUT/bench_lora_swap.md"
fi
