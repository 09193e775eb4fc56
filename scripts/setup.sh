#!/usr/bin/env bash
# Installs moelora and its test dependencies on a fresh machine.
# torch goes first: a bare `pip install torch` would pull several GB of CUDA packages on a CPU box.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>/dev/null \
  || python3 -m pip install -q --disable-pip-version-check torch
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
