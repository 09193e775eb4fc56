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
# Triton's on-disk cache travels between device calls, and sessions: most of a cold start is compiling (200-240 s per
# new 30B layout on 2 H200s, 27 s warm). Restored here from .triton_cache/ (git-ignored; the call carries it:
# carry [".triton_cache"]) into an empty cache; saved at exit as $OUT/triton_cache.part-NN, a gzip'd tar in 15 MiB
# parts, when it fits in TRITON_CACHE_PARTS (default 4) less the parts that the other files under $OUT leave no room
# for (a call returns 8 files at most: a cache whose last part stayed behind cannot be unpacked), and in
# TRITON_CACHE_MAX_MIB (default 54: a call carries 64 MiB, the working tree about 8 of them);
# TRITON_CACHE_PARTS=0 only reports its size (a second script in the same call). Copy the parts into .triton_cache/
# for the next call. Triton's index names its files by absolute path: it travels between machines of one image.
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if compgen -G ".triton_cache/triton_cache.part-*" > /dev/null; then
  ( flock 9  # two scripts of one call start together: one restores
    if [ -z "$(ls -A "$TRITON_CACHE" 2>/dev/null)" ]; then
      mkdir -p "$TRITON_CACHE" && cat .triton_cache/triton_cache.part-* | tar -C "$TRITON_CACHE" -xzf - \
        && echo "triton cache restored: $(find "$TRITON_CACHE" -type f | wc -l) files" | tee -a "$OUT/device.txt"
    fi ) 9> /tmp/triton_cache.lock
fi
save_triton_cache() {
  [ -d "$TRITON_CACHE" ] || return 0
  local tgz=/tmp/triton_cache.$$.tgz parts=${TRITON_CACHE_PARTS:-4}
  tar -C "$TRITON_CACHE" -czf "$tgz" . 2>/dev/null
  local mib=$(( ($(stat -c %s "$tgz") + 2**20 - 1) / 2**20 ))
  echo "triton cache: $(find "$TRITON_CACHE" -type f | wc -l) files, $mib MiB compressed" | tee -a "$OUT/device.txt"
  local room=$(( 8 - $(find "$OUT" -type f ! -name 'triton_cache.part-*' | wc -l) ))
  local fit=$(( parts < room ? parts : room ))
  local most=$(( 15 * fit < ${TRITON_CACHE_MAX_MIB:-54} ? 15 * fit : ${TRITON_CACHE_MAX_MIB:-54} ))
  if [ "$parts" -gt 0 ] && [ "$mib" -le "$most" ]; then
    split -b 15M -d "$tgz" "$OUT/triton_cache.part-"
  elif [ "$parts" -gt 0 ]; then
    echo "triton cache not saved: over $most MiB ($fit parts: TRITON_CACHE_PARTS, TRITON_CACHE_MAX_MIB, and room for" \
      "$room of the 8 files a call returns)" | tee -a "$OUT/device.txt"
  fi
  rm -f "$tgz"
}
trap save_triton_cache EXIT
