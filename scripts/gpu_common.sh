# Sourced by the GPU check scripts from the repository root: sets $OUT (default: $1) and PYTHONPATH, and writes
# the device and the library versions to $OUT/device.txt. Sets $PYTEST_FLAGS (pytest_flags below) for
# $TEST_WORKERS processes, 8 by default: on a cold Triton cache the tests spend most of their time compiling, one
# file at a time on one core otherwise.
OUT=${OUT:-$1}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/device.txt"
# pytest_flags WORKERS DIST: pytest-xdist's flags (loadfile keeps a file's tests in one process, for its module
# fixtures; WORKERS 0: none, the tests in this process) and pytest-timeout's, each where installed; a hung test
# then fails alone instead of eating the call's time limit
pytest_flags() {
  if [ "$1" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then echo -n "-n $1 --dist $2 "; fi
  if python3 -c "import pytest_timeout" 2>/dev/null; then echo -n "--timeout=${PER_TEST_TIMEOUT:-240}"; fi
}
PYTEST_FLAGS=$(pytest_flags "${TEST_WORKERS:-8}" loadfile)
# at the end, how large Triton's on-disk cache grew (files, MiB compressed): most of a layout's cold start (200-240 s
# at 30B on 2 H200s, 27 s warm) is compiling; whether the cache could travel from one call or session to the next
# (64 MiB a call) depends on this
triton_cache_size() {
  local dir=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
  [ -d "$dir" ] && echo "triton cache: $(find "$dir" -type f | wc -l) files, $(tar -C "$dir" -czf - . 2>/dev/null \
    | wc -c | awk '{printf "%.1f", $1 / 2^20}') MiB compressed" | tee -a "$OUT/device.txt"
}
trap triton_cache_size EXIT
