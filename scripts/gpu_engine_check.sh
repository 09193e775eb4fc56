#!/usr/bin/env bash
# One device call: the engine's GPU tests, then the serving benchmark (dummy Qwen3-30B-A3B, ours against
# transformers + PEFT). Results land in $OUT (device tool) or /tmp/gpu_engine_check. Each part has its own
# time limit (270 + 300 s: on a cold Triton cache `--impl ours` took 230 s, most of it the engine start
# compiling), so the whole stays under 10 minutes and a slow part still leaves its log. On a cold cache give the
# tests more (TEST_TIMEOUT=420) and the benchmark less (a small workload, BENCH_TIMEOUT=150).
# usage: bash scripts/gpu_engine_check.sh [bench_serving args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh /tmp/gpu_engine_check
FILES="tests/engine/test_engine_gpu.py tests/engine/test_engine.py tests/engine/test_cuda_graph.py tests/engine/test_pauses.py"
MODELS=tests/engine/test_engine_gpu_models.py
run_tests() {
  timeout -k 10 ${TEST_TIMEOUT:-270} python3 -m pytest -v -rf --durations=10 --maxfail=20 -p no:cacheprovider -m gpu "$@"
}
# the model-family file's tests each build their own engines and no module fixture: spread over workers of their
# own beside the other files (in one worker they took over 300 s, the other files under 250 s)
run_tests $PYTEST_FLAGS $FILES > "$OUT/pytest.log" 2>&1 &
# a model test may take the file's whole limit: on a cold cache the 30B dummy alone compiles for over 240 s
run_tests $(PER_TEST_TIMEOUT=${TEST_TIMEOUT:-270} pytest_flags 4 load) $MODELS > "$OUT/pytest_models.log" 2>&1
wait
grep -hE "FAILED|ERROR|Timeout|passed|failed|s call " "$OUT/pytest.log" "$OUT/pytest_models.log" | tail -40
timeout -k 10 ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_serving.py "$@" 2>&1 | tee "$OUT/bench_serving.md"
