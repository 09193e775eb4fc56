#!/usr/bin/env bash
# One device call: the engine's GPU tests, then the serving benchmark (dummy Qwen3-30B-A3B, ours against
# transformers + PEFT). Results land in $OUT (device tool) or /tmp/gpu_engine_check. Each part has its own
# time limit (170 + 420 s; the engine start compiles its prompt-step kernels, minutes on a cold Triton cache), so the whole stays under 9 minutes and a slow part still leaves its log.
# usage: bash scripts/gpu_engine_check.sh [bench_serving args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh /tmp/gpu_engine_check
timeout -k 10 ${TEST_TIMEOUT:-170} python3 -m pytest -v $PYTEST_FLAGS --durations=10 --maxfail=20 -p no:cacheprovider -m gpu \
  tests/engine/test_engine_gpu*.py tests/engine/test_engine.py tests/engine/test_cuda_graph.py tests/engine/test_pauses.py 2>&1 | tee "$OUT/pytest.log" | tail -40
timeout -k 10 ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_serving.py "$@" 2>&1 | tee "$OUT/bench_serving.md"
