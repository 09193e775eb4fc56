#!/usr/bin/env bash
# Device calls on a machine of several GPUs (nvidia-h200-x2, -x4): the multi-rank GPU tests over NCCL, then the
# scaling benchmark. Layouts beyond the machine's GPUs are skipped. STAGES picks the parts of this call, in order,
# each under its own time limit so that a slow part still leaves its log and the call stays under 10 minutes:
#   tests      the tensor-parallel sum in rank order over NCCL, eager and from a CUDA graph (tests/layers/
#              test_collectives.py); tests/distributed/test_engine_tp_gpu.py (every layout of tp 2/4 x ep 1/2/4
#              against one GPU: bf16 log-probs, greedy tokens of the base model and 8 adapters in one batch, CUDA
#              graphs bitwise equal to eager with the collectives captured, adapters loaded and unloaded while
#              serving, an engine on cuda:1); per-rank memory
#   qwen3      bench_tp.py on a dummy Qwen3-30B-A3B: decode tokens/s at batch 1/32/128 and prefill 8x1024, LoRA off /
#              1 / 8 adapters, for each of $LAYOUTS (tp x ep) with $DISPATCH (all_reduce or all_to_all)
#   deepseek   the same on a DeepSeek-V3-shaped dummy (real widths, 4 layers) for $DS_LAYOUTS
# PROFILE=N: the benchmarks also profile each layout's LoRA-off prefill, and its decode steps at batch 32 with each
# adapter count, on every rank, and list the N busiest kernels of each; PROFILE_DIR keeps their traces (each rank's
# trace and kernel summary per run: mind the 8 files a call returns). The profiles add 4 runs a layout: give the
# stage more BENCH_TIMEOUT.
# Results land in $OUT (device tool) or /tmp/gpu_multi_check. Time limits: TEST_TIMEOUT (default 540 s) and
# BENCH_TIMEOUT per benchmark stage (default 270 s). Measured on 2 H200s (RESULTS.md, session 25): the tests stage took
# 409 s with only the 2-GPU cases (each 4-GPU case adds a multi-rank engine start, 40-75 s); a 30B layout started in
# 27 s on a warm Triton cache and 200-240 s on a cold one (each tp x ep compiles kernel variants of its own shapes),
# then measured in about 100 s. On 4 H200s (session 26): the engine tests of tp4 and the all-to-all, 13 cases, 410 s;
# the sum kernel's and the collectives' cases over 540 s on a cold Triton cache; a cold 30B start at 4x4 over 340 s.
# So on 4 GPUs give each stage one or two layouts, and TESTS_K a pytest -k expression (e.g. "tp4 or another_device")
# to split the tests stage over calls.
# usage: STAGES=tests bash scripts/gpu_multi_check.sh
#        STAGES=tests TESTS_K="tp4 or collectives or another_device" bash scripts/gpu_multi_check.sh
#        STAGES=qwen3 LAYOUTS=1x1,2x2,4x4 BENCH_TIMEOUT=560 bash scripts/gpu_multi_check.sh
#        STAGES=qwen3,deepseek LAYOUTS=4x1,4x2 DS_LAYOUTS=1x1,4x4 DISPATCH=all_to_all bash scripts/gpu_multi_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off (the device machines' rule: it can take a shared host's GPUs out of service); spawned
# ranks inherit these
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/gpu_common.sh /tmp/gpu_multi_check
nvidia-smi topo -m 2>&1 | tee -a "$OUT/device.txt"
STAGES=${STAGES:-tests,qwen3,deepseek}
LAYOUTS=${LAYOUTS:-1x1,2x1,2x2,4x1,4x2,4x4}
DS_LAYOUTS=${DS_LAYOUTS:-1x1,4x4}
DISPATCH=${DISPATCH:-all_reduce}
status=0  # the last failed stage's exit status, the script's
for stage in ${STAGES//,/ }; do
  case $stage in
    tests)
      # one process: each multi-rank engine takes GPUs 0..tp-1, and a test's engines start one after another. The
      # engine tests first: on a cold Triton cache the sum kernel's ~180 cases compile for minutes (session 26)
      timeout -k 10 ${TEST_TIMEOUT:-540} python3 -m pytest -v -rf --durations=15 --maxfail=20 -p no:cacheprovider \
        $(pytest_flags 0) ${TESTS_K:+-k "$TESTS_K"} tests/distributed/test_engine_tp_gpu.py tests/distributed/test_memory.py \
        tests/layers/test_collectives.py tests/kernels/test_sum_in_order.py \
        > "$OUT/pytest.log" 2>&1 || status=$?
      grep -hE "PASSED|FAILED|ERROR|SKIPPED|Timeout|passed|failed|s call " "$OUT/pytest.log" | tail -40 ;;
    qwen3)
      timeout -k 10 ${BENCH_TIMEOUT:-270} python3 benchmarks/bench_tp.py --layouts "$LAYOUTS" --dispatch "$DISPATCH" \
        --profile "${PROFILE:-0}" ${PROFILE_DIR:+--profile-dir "$PROFILE_DIR"} 2>&1 \
        | tee "$OUT/bench_tp_qwen3_30b_${DISPATCH}.md" || status=$? ;;
    deepseek)
      timeout -k 10 ${BENCH_TIMEOUT:-270} python3 benchmarks/bench_tp.py --model deepseek-v3 --layers 4 \
        --layouts "$DS_LAYOUTS" --dispatch "$DISPATCH" --profile "${PROFILE:-0}" ${PROFILE_DIR:+--profile-dir "$PROFILE_DIR"} 2>&1 \
        | tee "$OUT/bench_tp_deepseek_v3_${DISPATCH}.md" || status=$? ;;
    *) echo "unknown stage $stage (tests, qwen3, deepseek)"; exit 2 ;;
  esac
done
exit $status
