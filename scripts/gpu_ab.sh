#!/usr/bin/env bash
# One device call, several trees: COMMAND on the working tree (A), then with each PATCH applied in turn (B, each on
# the tree alone), then on A again, so that a drift of the machine between the runs shows. Each run's output lands
# in $OUT/a1.log, b.log (one patch; with several b1.log, b2.log, ... in their order) and a2.log (device tool) or
# /tmp/gpu_ab. A patch is a plain diff of the tree, e.g. `git diff main some-branch > ab.patch` (an untracked file
# at the repository root travels with the tree); the tree is put back after each B.
# usage: bash scripts/gpu_ab.sh PATCH[,PATCH...] COMMAND [ARGS...]     (RUN_TIMEOUT: seconds per run, default 150)
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/gpu_ab.sh PATCH[,PATCH...] COMMAND [ARGS...] (PATCH: a diff file in the tree)"
if [ $# -lt 2 ]; then
  echo "$usage" >&2
  exit 2
fi
IFS=, read -r -a patches <<< "$1"
shift
if [ ${#patches[@]} -eq 0 ]; then
  echo "$usage: no patch" >&2
  exit 2
fi
for i in "${!patches[@]}"; do
  [ -f "${patches[$i]}" ] || { echo "$usage: no file ${patches[$i]}" >&2; exit 2; }
  patches[$i]=$(realpath "${patches[$i]}")
  patch --dry-run -s -p1 < "${patches[$i]}" > /dev/null || { echo "${patches[$i]} does not apply to this tree" >&2; exit 2; }
done
source scripts/gpu_common.sh /tmp/gpu_ab
run() {  # run NAME [WHAT]: the command's output to $OUT/NAME.log and the terminal
  echo "## $1${2:+: $2}"
  timeout "${RUN_TIMEOUT:-150}" "${command[@]}" 2>&1 | tee "$OUT/$1.log"
}
command=("$@")
run a1
for i in "${!patches[@]}"; do
  name=b
  [ ${#patches[@]} -gt 1 ] && name=b$((i + 1))
  patch -s -p1 < "${patches[$i]}" && run "$name" "$(basename "${patches[$i]}")"
  patch -s -R -p1 < "${patches[$i]}"
done
run a2
