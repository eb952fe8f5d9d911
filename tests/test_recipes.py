"""Every recipe under recipes/ parses with its stage's parser, and starts with the command that runs it."""

import glob
import os

import pytest
import torch

from rlhf_trl import ppo, rm, sft
from rlhf_trl.config import parse_recipe

ROOT = os.path.join(os.path.dirname(__file__), "..")
STAGES = {"sft": sft, "rm": rm, "ppo": ppo}
RECIPES = sorted(
    p for p in glob.glob(os.path.join(ROOT, "recipes", "**", "*.yaml"), recursive=True)
    if os.path.basename(p)[:-5] in STAGES
)


def test_there_are_recipes_for_every_stage():
    for run in ("demo", "zh-oasst", "qwen2.5-0.5b"):
        for stage in STAGES:
            assert os.path.isfile(os.path.join(ROOT, "recipes", run, f"{stage}.yaml")), (run, stage)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: os.path.relpath(p, ROOT))
def test_recipe_parses(path):
    stage = os.path.basename(path)[:-5]
    text = open(path, encoding="utf-8").read()
    extra = []
    if not torch.cuda.is_available() and "bf16: true" in text:
        # TrainingArguments refuses bf16 without a GPU at parse time; every other key and type is still checked
        extra = ["--bf16", "false", "--use_cpu", "true"]
    parsed = parse_recipe(STAGES[stage].recipe_types(), ["--config", path, *extra])
    assert parsed[-1] == path
    assert parsed[0].dataset_name, "every recipe names its data"
    assert text.lstrip().startswith("#")
    assert f"make {stage}" in text or f"rlhf-trl {stage}" in text, "the recipe should say how to run it"
