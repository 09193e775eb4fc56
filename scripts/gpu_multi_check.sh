#!/usr/bin/env bash
# One device call on a machine of several GPUs (nvidia-h200-x2 .. -x8): the multi-rank GPU tests over NCCL
# (CUDA graphs capturing the collectives, batch invariance, two GPUs against one, per-rank memory), then the
# scaling benchmark (decode and prefill tokens/s at tp 1/2/4/8 x ep, LoRA off / 1 / 8 adapters) on a dummy
# Qwen3-30B-A3B and a DeepSeek-V3-shaped dummy of 4 layers. Layouts beyond the machine's GPUs are skipped.
# Each part has its own time limit (150 + 2 x 210 s), so the whole stays under 10 minutes and a slow part
# still leaves its log. Results land in $OUT (device tool) or /tmp/gpu_multi_check.
# usage: bash scripts/gpu_multi_check.sh [bench_tp args for both models...]
#   e.g. LAYOUTS=2x2,4x4 bash scripts/gpu_multi_check.sh --dispatch all_to_all   (the default dispatch: all_reduce)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh /tmp/gpu_multi_check
nvidia-smi topo -m 2>&1 | tee -a "$OUT/device.txt"
timeout -k 10 ${TEST_TIMEOUT:-150} python3 -m pytest -v --durations=10 --maxfail=20 -p no:cacheprovider \
  tests/distributed/test_engine_tp_gpu.py tests/distributed/test_memory.py 2>&1 | tee "$OUT/pytest.log" | tail -30
LAYOUTS=${LAYOUTS:-1x1,2x1,2x2,4x1,4x2,4x4,8x8}
timeout -k 10 ${BENCH_TIMEOUT:-210} python3 benchmarks/bench_tp.py --layouts "$LAYOUTS" --batch-sizes 1,32 "$@" \
  2>&1 | tee "$OUT/bench_tp_qwen3_30b.md"
timeout -k 10 ${BENCH_TIMEOUT:-210} python3 benchmarks/bench_tp.py --model deepseek-v3 --layers 4 --layouts "$LAYOUTS" \
  --batch-sizes 1,32 "$@" 2>&1 | tee "$OUT/bench_tp_deepseek_v3.md"
