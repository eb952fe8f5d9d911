"""Every recipe under recipes/ parses with its stage's parser, and starts with the command that runs it."""

import glob
import os
import re

import pytest
import torch
from conftest import import_ppo

from types import SimpleNamespace

from rlhf_trl import dpo, grpo, kto, rm, sft
from rlhf_trl.config import parse_recipe

ROOT = os.path.join(os.path.dirname(__file__), "..")
STAGES = {"sft": lambda: sft, "rm": lambda: rm, "ppo": import_ppo}  # stage -> its module (PPO: imported when used)
STAGE3 = {"dpo": lambda: dpo, "grpo": lambda: grpo,  # the other stage-3 methods: demo, CPU and 7B recipes
          "rloo": lambda: SimpleNamespace(recipe_types=lambda: grpo.recipe_types("rloo")), "kto": lambda: kto}
PARSERS = {**STAGES, **STAGE3}
RECIPES = sorted(
    p for p in glob.glob(os.path.join(ROOT, "recipes", "**", "*.yaml"), recursive=True)
    if os.path.basename(p)[:-5] in PARSERS
)


GPU_SETS = ("qwen2.5-0.5b", "qwen2.5-0.5b-qlora", "qwen2.5-7b", "qwen2.5-7b-qlora", "baichuan2-7b")


def test_there_are_recipes_for_every_stage():
    for run in ("demo", "zh-oasst", *GPU_SETS):
        for stage in STAGES:
            assert os.path.isfile(os.path.join(ROOT, "recipes", run, f"{stage}.yaml")), (run, stage)
    assert os.path.isfile(os.path.join(ROOT, "recipes", "qwen2.5-7b-full", "sft.yaml"))  # full-parameter, ZeRO-3
    for run, methods in (("demo", STAGE3), ("qwen2.5-0.5b-cpu", STAGE3), ("qwen2.5-7b", ("dpo", "grpo", "kto"))):
        for method in methods:
            assert os.path.isfile(os.path.join(ROOT, "recipes", run, f"{method}.yaml")), (run, method)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_recipe_parses(path):
    stage = os.path.basename(path)[:-5]
    text = open(path, encoding="utf-8").read()
    extra = []
    if not torch.cuda.is_available() and "bf16: true" in text:
        # TrainingArguments refuses bf16 without a GPU at parse time; every other key and type is still checked
        extra = ["--bf16", "false", "--use_cpu", "true"]
    parsed = parse_recipe(PARSERS[stage]().recipe_types(), ["--config", path, *extra])
    assert parsed.path == path
    assert parsed.data.dataset_name, "every recipe names its data"
    assert text.lstrip().startswith("#")
    assert f"make {stage}" in text or f"rlhf-trl {stage}" in text, "the recipe should say how to run it"


def recipe_yaml(path):
    import yaml

    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def header(path):
    """The comment block a recipe starts with (its lines without the leading '#')."""
    lines = []
    for line in open(path, encoding="utf-8"):
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return " ".join(lines)


GPU_RECIPES = [p for p in RECIPES if recipe_yaml(p).get("use_cpu") is False]
QUANTIZED_RECIPES = [p for p in RECIPES if recipe_yaml(p).get("load_in_4bit") or recipe_yaml(p).get("load_in_8bit")]


def test_the_gpu_and_quantized_recipes_are_found():
    names = {os.path.relpath(p, ROOT) for p in GPU_RECIPES}
    for run in GPU_SETS:
        assert all(os.path.join("recipes", run, f"{stage}.yaml") in names for stage in STAGES), run
    assert os.path.join("recipes", "qwen2.5-7b-full", "sft.yaml") in names
    quantized = {os.path.relpath(os.path.dirname(p), ROOT) for p in QUANTIZED_RECIPES}
    assert quantized == {os.path.join("recipes", "qwen2.5-0.5b-qlora"), os.path.join("recipes", "qwen2.5-7b-qlora")}


@pytest.mark.parametrize("path", QUANTIZED_RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_quantized_recipes_train_through_lora(path, monkeypatch):
    """4-bit weights cannot be trained: the policy / SFT / RM model through use_peft, PPO's value model through
    value_use_peft; and the recipe's quantization settings pass rlhf_trl's checks (bitsandbytes / GPU aside)."""
    from rlhf_trl import models

    recipe = recipe_yaml(path)
    assert recipe.get("use_peft") is True
    if os.path.basename(path) == "ppo.yaml":
        assert recipe.get("value_use_peft") is True
        assert recipe.get("save_merged_checkpoints") is False  # a merge into 4-bit weights would round the update away
    assert recipe.get("dtype") == "bfloat16" and recipe.get("bnb_4bit_quant_type") == "nf4"
    assert "pip install -e '.[qlora]'" in header(path)
    stage = os.path.basename(path)[:-5]
    parsed = parse_recipe(STAGES[stage]().recipe_types(), ["--config", path, "--bf16", "false", "--use_cpu", "true"])
    model_args = parsed.model
    lora = {"use_peft": model_args.use_peft}
    if stage == "ppo":
        lora["value_use_peft"] = parsed.script.value_use_peft
    monkeypatch.setattr(models, "require_kbit_support", lambda *args, **kwargs: None)  # no bitsandbytes / GPU here
    config = models.recipe_quantization_config(model_args, lora)
    assert config.load_in_4bit and config.bnb_4bit_compute_dtype == torch.bfloat16


BATCH = re.compile(r"per_device_train_batch_size x processes x gradient_accumulation_steps = (\d+) x (\d+) x (\d+) = "
                   r"(\d+)")


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_gpu_recipes_state_effective_batch_and_memory(path):
    """Each GPU recipe's header gives its effective batch (matching its keys) and its expected GPU memory."""
    text, recipe = header(path), recipe_yaml(path)
    match = BATCH.search(text)
    assert match, "the header states the effective batch as per-device x processes x accumulation = N"
    per_device, processes, accumulation, total = map(int, match.groups())
    assert per_device == recipe["per_device_train_batch_size"]
    assert accumulation == recipe.get("gradient_accumulation_steps", 1)
    assert per_device * processes * accumulation == total
    if "NPROC=" in text:
        assert f"NPROC={processes}" in text
    memory = re.search(r"Memory[^:(]*\([^)]*(?:estimate|expected)[^)]*not measured[^)]*\):(.*?)GB", text)
    assert memory, "the header gives the expected GPU memory in GB, marked as an estimate (not measured)"
    assert re.search(r"peak ~?\d|~\d+(-\d+)? GB per GPU", text), "the header ends the derivation with a figure"


def test_zero3_recipe_is_full_parameter_under_zero3():
    path = os.path.join(ROOT, "recipes", "qwen2.5-7b-full", "sft.yaml")
    text, recipe = header(path), recipe_yaml(path)
    assert "make sft RECIPE=recipes/qwen2.5-7b-full/sft.yaml ACCEL=zero3 NPROC=8" in text
    assert os.path.isfile(os.path.join(ROOT, "recipes", "accelerate_configs", "zero3.yaml"))
    assert recipe["use_peft"] is False and recipe["gradient_checkpointing"] is True and recipe["bf16"] is True
    assert "per GPU" in text


def test_math_recipes_share_their_held_out_problems():
    """`make math-real`: grpo.yaml trains, eval.yaml (a PPO recipe: compare reads it) scores the same held-out split
    with the same rule reward and no reward model."""
    math = os.path.join(ROOT, "recipes", "qwen2.5-0.5b-cpu-math")
    ppo = parse_recipe(import_ppo().recipe_types(), ["--config", f"{math}/eval.yaml"])
    data, ppo_args, training_args = ppo.data, ppo.script, ppo.training
    g = parse_recipe(grpo.recipe_types(), ["--config", f"{math}/grpo.yaml"])
    g_data, g_args, g_training = g.data, g.script, g.training
    assert ppo_args.reward_funcs == ["rlhf_trl.math_rewards:correct"] == g_args.reward_funcs
    assert not training_args.reward_model_path and not g_args.reward_model_path
    keys = ("dataset_name", "question_key", "max_samples", "eval_split_size", "max_prompt_length", "chat_template",
            "system_prompt")
    assert [getattr(data, k) for k in keys] == [getattr(g_data, k) for k in keys]
    assert training_args.seed == g_training.seed and training_args.response_length == g_training.max_completion_length
