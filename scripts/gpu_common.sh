# Sourced by the GPU check scripts from the repository root: sets $OUT (default: $1) and PYTHONPATH, and writes
# the device and the library versions to $OUT/device.txt. Sets $PYTEST_FLAGS to pytest-xdist's and
# pytest-timeout's flags where they are installed: on a cold Triton cache the tests spend most of their time
# compiling, one file at a time on one core otherwise ($TEST_WORKERS processes, 8 by default; each file's tests
# stay in one, for its module fixtures).
OUT=${OUT:-$1}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/device.txt"
PYTEST_FLAGS=""
if python3 -c "import xdist" 2>/dev/null; then PYTEST_FLAGS="-n ${TEST_WORKERS:-8} --dist loadfile"; fi
# a hung test fails alone (pytest-timeout, where installed) instead of eating the call's time limit
if python3 -c "import pytest_timeout" 2>/dev/null; then
  PYTEST_FLAGS="$PYTEST_FLAGS --timeout=${PER_TEST_TIMEOUT:-240}"
fi
