#!/usr/bin/env bash
# One device call for the prefill path's kernels: their GPU tests (attention, RMSNorm, q/k norm + RoPE + KV store,
# dense GEMM and its LoRA), then their benchmarks at Qwen3-30B-A3B's prefill sizes and the engine's prefill step
# profile. Results land in $OUT (device tool) or /tmp/gpu_prefill_check. Each part has its own time limit so the
# whole stays under 10 minutes on a cold Triton cache and a slow part still leaves its log.
# usage: bash scripts/gpu_prefill_check.sh            (SWEEP=1: the benchmarks also time candidate tiles)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh /tmp/gpu_prefill_check
sweep() { if [ "${SWEEP:-0}" = 1 ]; then echo "$@"; fi; }
timeout ${TEST_TIMEOUT:-180} python3 -m pytest -v -rf $PYTEST_FLAGS --maxfail=20 -p no:cacheprovider \
  tests/kernels/test_attention.py tests/kernels/test_attention_gpu.py tests/kernels/test_rms_norm.py \
  tests/kernels/test_rms_norm_gpu.py tests/kernels/test_rope_kv_store.py tests/kernels/test_rope_kv_store_gpu.py \
  tests/kernels/test_linear.py tests/kernels/test_lora_linear.py tests/kernels/test_lora_linear_gpu.py 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "FAILED|ERROR|Timeout|passed|failed" | tail -40
timeout 120 python3 benchmarks/bench_attention.py $(sweep --sweep) 2>&1 | tee "$OUT/bench_attention.md"
timeout 60 python3 benchmarks/bench_norm_rope.py $(sweep --sweep) 2>&1 | tee "$OUT/bench_norm_rope.md"
timeout 120 python3 benchmarks/bench_linear.py --lora --shapes qkv,o --rows 1,128,8192 $(sweep --sweep 8192) 2>&1 \
  | tee "$OUT/bench_linear_lora.md"
timeout ${PROFILE_TIMEOUT:-240} python3 benchmarks/profile_step.py --prefill 8x1024 --adapters 0,8 --top 20 2>&1 \
  | tee "$OUT/prefill_profile.md"
