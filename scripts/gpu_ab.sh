#!/usr/bin/env bash
# One device call, two trees: COMMAND on the working tree (A), then with PATCH applied (B), then on A again, so that
# a drift of the machine between the runs shows. Each run's output lands in $OUT/a1.log, b.log and a2.log (device tool)
# or /tmp/gpu_ab. The patch is a plain diff of the tree, e.g. `git diff main some-branch > ab.patch` (an untracked
# file at the repository root travels with the tree); the tree is put back after B.
# usage: bash scripts/gpu_ab.sh PATCH COMMAND [ARGS...]     (RUN_TIMEOUT: seconds per run, default 150)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ] || [ ! -f "$1" ]; then
  echo "usage: bash scripts/gpu_ab.sh PATCH COMMAND [ARGS...] (PATCH: a diff file in the tree)" >&2
  exit 2
fi
patch_file=$(realpath "$1")
shift
source scripts/gpu_common.sh /tmp/gpu_ab
patch --dry-run -s -p1 < "$patch_file" > /dev/null || { echo "$patch_file does not apply to this tree" >&2; exit 2; }
run() {  # run NAME: the command's output to $OUT/NAME.log and the terminal
  echo "## $1"
  timeout "${RUN_TIMEOUT:-150}" "${command[@]}" 2>&1 | tee "$OUT/$1.log"
}
command=("$@")
run a1
patch -s -p1 < "$patch_file" && run b
patch -s -R -p1 < "$patch_file"
run a2
