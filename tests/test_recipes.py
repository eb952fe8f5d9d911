"""Every recipe under recipes/ parses with its stage's parser, and starts with the command that runs it."""

import glob
import os

import pytest

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
    parsed = parse_recipe(STAGES[stage].recipe_types(), ["--config", path])
    assert parsed[-1] == path
    assert parsed[0].dataset_name, "every recipe names its data"
    first = open(path, encoding="utf-8").read().lstrip().splitlines()[0]
    assert first.startswith("#")
    text = open(path, encoding="utf-8").read()
    assert f"make {stage}" in text or f"rlhf-trl {stage}" in text, "the recipe should say how to run it"
