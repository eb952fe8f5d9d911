#!/usr/bin/env bash
# GPU check (issue 6): a few timed bf16 steps of SFT, RM and PPO on a random-init Qwen2 of Qwen2.5-0.5B shape,
# built locally (no hub, no ../shared). Writes step times, tokens/s and peak GPU memory per stage to a JSON file
# (default outputs/gpu_check/gpu_check.json). Logic and options: benchmarks/gpu_check.py (`--help`).
#
# Here (CPU, tiny shape, ~15 s):   benchmarks/gpu_check.sh --tiny        (or: make gpu-check)
#
# On the device machine (one H200, no network; python3 there has torch, accelerate, peft, pyyaml, ... but no trl or
# datasets, and an older transformers): the full check took over 7 minutes on an H200 (PPO ~85-99 s per update at the
# recipe's micro-batches of 4; benchmarks/HISTORY.md, GPU check), `--steps 2 --ppo_steps 2 --response_length 32`
# about 2 minutes:
#   1. here, once: benchmarks/fetch_wheels.sh
#      (downloads trl 1.16.0, transformers, datasets, peft, dill, multiprocess wheels for CPython 3.12 into .whl/,
#      ~16 MB, ignored by git)
#   2. the device tool's run, with carry [".whl"] and timeout_s 600 (or the short options above):
#        bash benchmarks/gpu_check.sh --output $OUT/gpu_check.json
#      This script installs .whl/*.whl into /tmp/site (pip --no-index --no-deps --target) and puts /tmp/site and
#      src/ on PYTHONPATH, so no `pip install -e .` is needed there. By hand instead:
#        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#        PYTHONPATH=/tmp/site:src HF_HUB_OFFLINE=1 python3 benchmarks/gpu_check.py --output $OUT/gpu_check.json
#      (or `python3 -m pip install --no-deps --no-build-isolation -e .` in place of src/ on PYTHONPATH).
#   The JSON comes back under the run's files; the model and stage outputs stay in outputs/gpu_check/work there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
# python: $PYTHON if set, else .venv/bin/python if there is one, else python3
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# wheels carried to a machine whose python lacks trl (see above): install them into /tmp/site, put it first
if ! "$PYTHON" -c "import trl, datasets" 2>/dev/null && compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$ROOT"/.whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" "$ROOT/benchmarks/gpu_check.py" "$@"
