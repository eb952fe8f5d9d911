#!/usr/bin/env bash
# GPU check: a few timed bf16 steps of SFT, RM and PPO on a random-init Qwen2 of Qwen2.5-0.5B's shape, built locally
# (no model hub, no ../shared), with the recipes/qwen2.5-0.5b recipes. It writes step times, tokens/s and peak GPU
# memory per stage to a JSON file, by default outputs/gpu_check/gpu_check.json under the directory you run it from
# (--output PATH to change it; model, data and stage outputs go to the scratch directory outputs/gpu_check/work,
# --work_dir, and the models are removed at the end unless --keep_work_dir). Logic and options:
# benchmarks/gpu_check.py (`--help`).
#
#   make install TORCH=torch && make gpu-check     # on any machine with a CUDA GPU: the 0.5B shape in bf16
#   bash benchmarks/gpu_check.sh --steps 2 --ppo_steps 2 --response_length 32    # shorter: ~2 min on one H200
#   make gpu-check ARGS=--tiny                     # without a GPU: a tiny shape on the CPU (~15 s), a smoke test
#
# What it needs: a CUDA GPU with a CUDA build of torch (without one it falls back to the tiny CPU shape), and the
# project's Python packages (torch, transformers, trl, datasets, peft, accelerate). The python it runs: $PYTHON if
# set, else the project's .venv/bin/python if there is one (`make install`), else python3. It puts src/ on
# PYTHONPATH, so the project itself need not be installed. The full check took over 7 minutes on an H200 (PPO
# ~85-99 s per update at the recipe's micro-batches of 4; benchmarks/HISTORY.md, GPU check).
#
# An offline GPU machine whose python has torch but lacks trl or datasets (or has an older transformers):
#   1. on a machine with network access: benchmarks/fetch_wheels.sh
#      (downloads trl, transformers, datasets, peft, dill and multiprocess wheels for CPython 3.12 into .whl/,
#      ~16 MB, ignored by git);
#   2. copy the repository, .whl/ included, to the GPU machine and run there:
#        bash benchmarks/gpu_check.sh [--output PATH]
#      When its python cannot import trl and datasets, this script installs .whl/*.whl into /tmp/site
#      (pip --no-index --no-deps --target) and puts /tmp/site first on PYTHONPATH. By hand instead:
#        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#        PYTHONPATH=/tmp/site:src HF_HUB_OFFLINE=1 python3 benchmarks/gpu_check.py --output PATH
#      (or `python3 -m pip install --no-deps --no-build-isolation -e .` in place of src/ on PYTHONPATH).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
# python: $PYTHON if set, else .venv/bin/python if there is one, else python3
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# wheels copied to a machine whose python lacks trl (see above): install them into /tmp/site, put it first
if ! "$PYTHON" -c "import trl, datasets" 2>/dev/null && compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$ROOT"/.whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" "$ROOT/benchmarks/gpu_check.py" "$@"
