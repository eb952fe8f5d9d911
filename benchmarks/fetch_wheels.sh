#!/usr/bin/env bash
# Download, into .whl/ at the repo root, the wheels that an offline GPU machine's python3 (CPython 3.12, x86-64, with
# torch) may lack for benchmarks/gpu_check.sh: trl 1.16, datasets and its dill / multiprocess, transformers (this
# project needs >= 5.24) and peft. Pure-Python wheels, ~16 MB together. Run it where there is network access, then
# copy the repository with .whl/ to the GPU machine; benchmarks/gpu_check.sh installs them there (its header).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$ROOT/.whl"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$ROOT/.whl" \
    trl==1.16.0 transformers==5.24.0 datasets==5.2.0 peft==0.21.2 dill==0.4.1 multiprocess==0.70.19
ls -l "$ROOT/.whl"
