# Sourced by the GPU check scripts from the repository root: sets $OUT (default: $1) and PYTHONPATH,
# and writes the device and the library versions to $OUT/device.txt.
OUT=${OUT:-$1}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/device.txt"
