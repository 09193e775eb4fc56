#!/usr/bin/env bash
# A Python script run with the stacks of all its threads dumped, and the process ended, once it has run SECONDS
# (faulthandler), the GPU's utilisation, power and memory logged every 10 s beside it where nvidia-smi is: a run that
# hangs then shows where the host waits and whether the device spins (busy at idle power: a kernel that never ends).
# The script runs as `python3 SCRIPT ARGS...` would run it (sys.argv, __main__, its directory first on sys.path).
# usage: bash scripts/gpu_watch.sh SECONDS SCRIPT.py [ARGS...]     e.g. inside a device call:
#        bash scripts/gpu_watch.sh 250 benchmarks/bench_serving.py --impl ours --batch-sizes 8 --adapters 0,8
set -uo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ]; then
  echo "usage: bash scripts/gpu_watch.sh SECONDS SCRIPT.py [ARGS...] (SECONDS: a whole number, 1 or more)" >&2
  exit 2
fi
seconds=$1
shift
sampler=
if command -v nvidia-smi > /dev/null; then
  ( while sleep 10; do
      echo "$(date +%T) gpu: $(nvidia-smi --query-gpu=utilization.gpu,power.draw,memory.used --format=csv,noheader)"
    done ) &
  sampler=$!
fi
python3 -c "
import faulthandler, os, runpy, sys
faulthandler.dump_traceback_later($seconds, exit=True)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name='__main__')" "$@"
rc=$?
[ -n "$sampler" ] && kill "$sampler"
exit $rc
