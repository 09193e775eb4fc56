#!/usr/bin/env bash
# One device call: GPU tests, then the kernel benchmark. Results land in $OUT (device tool) or /tmp/gpu_check.
# usage: bash scripts/gpu_check.sh [benchmark args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/device.txt"
timeout ${TEST_TIMEOUT:-900} python3 -m pytest -q --maxfail=20 -p no:cacheprovider tests/kernels tests/layers 2>&1 | tee "$OUT/pytest.log" | tail -25
python3 benchmarks/bench_moe.py "$@" 2>&1 | tee "$OUT/bench.md"
