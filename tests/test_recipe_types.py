"""Every recipe value is checked against its dataclass field's type when the recipe is parsed
(`rlhf_trl.config.check_types`), for every stage and every TRL config key, before anything is read: a list, a
mapping, or a boolean where a number belongs, and a number where a string belongs, stop with one line naming
the file and the key (exit 2). The rules come from the field types, not from a list of keys. A word where a number belongs is argparse's
to refuse, in one line naming the file and key (`test_errors.py`, ``wrong_value_type``)."""

import dataclasses
import importlib
import typing

import pytest
import yaml

from rlhf_trl.cli import main as cli_main
from rlhf_trl.config import RecipeError, _fits, check_types, parse_recipe

STAGES = {"sft": "sft", "rm": "rm", "ppo": "ppo", "dpo": "dpo", "grpo": "grpo", "rloo": "grpo"}
if importlib.util.find_spec("rlhf_trl.kto"):
    STAGES["kto"] = "kto"


def stage_types(stage: str) -> tuple:
    module = importlib.import_module(f"rlhf_trl.{STAGES[stage]}")
    return module.recipe_types("rloo") if stage == "rloo" else module.recipe_types()


def fields_of(types_: tuple, wanted) -> list[str]:
    """Every field of ``types_`` whose type hint is exactly ``wanted`` (or ``wanted | None``)."""
    out = []
    for t in types_:
        hints = typing.get_type_hints(t)
        for f in dataclasses.fields(t):
            hint = getattr(t, "yaml_types", {}).get(f.name, hints[f.name])
            if hint == wanted or hint == wanted | None:
                out.append(f.name)
    return sorted(set(out))


def write(tmp_path, data: dict) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_numeric_key_of_every_stage_refuses_lists_mappings_and_booleans(stage, tmp_path):
    types_ = stage_types(stage)
    numeric = fields_of(types_, int) + fields_of(types_, float)
    assert {"learning_rate", "per_device_train_batch_size", "max_steps"} <= set(numeric)
    for key in numeric:
        for bad, shown in (([1], "a list [1]"), ({"a": 1}, "a mapping {'a': 1}"), (True, "a boolean True")):
            with pytest.raises(RecipeError) as info:
                check_types(types_, {key: bad}, "r.yaml")
            message = str(info.value)
            assert message.startswith(f"r.yaml: {key} must be "), message
            assert f"got {shown}" in message and "\n" not in message


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_boolean_and_string_key_refuses_numbers_and_lists(stage):
    types_ = stage_types(stage)
    for key in fields_of(types_, bool):
        with pytest.raises(RecipeError, match=rf"^r.yaml: {key} must be true or false, got a number 2"):
            check_types(types_, {key: 2}, "r.yaml")
    for key in fields_of(types_, str):
        with pytest.raises(RecipeError, match=rf"^r.yaml: {key} must be a string, got a number 5; quote it"):
            check_types(types_, {key: 5}, "r.yaml")
        with pytest.raises(RecipeError, match=rf"^r.yaml: {key} must be a string, got a list"):
            check_types(types_, {key: ["a"]}, "r.yaml")


def test_values_argparse_converts_still_fit():
    assert _fits("1e-4", float) and _fits(3, float) and _fits("8", int) and _fits("true", bool)
    assert _fits("tensorboard", None | str | list[str]) and _fits(["tensorboard"], list[str] | None)
    assert _fits(0.5, float | str) and _fits("auto", float | str)  # reward_baseline's yaml_types
    assert not _fits(1.0, int) and not _fits(True, int) and not _fits([1.0], list[str])


@pytest.mark.parametrize("stage,key,value,expected", [
    ("ppo", "learning_rate", [1.0e-4], "learning_rate must be a number, got a list [0.0001]; write e.g. "
                                       "`learning_rate: 0.0001`"),
    ("ppo", "total_episodes", [8], "total_episodes must be an integer, got a list [8]; write e.g. `total_episodes: 8`"),
    ("dpo", "max_steps", [1], "max_steps must be an integer, got a list [1]; write e.g. `max_steps: 1`"),
    ("sft", "datasets", [{"dataset_name": "a.jsonl", "max_samples": [4]}],
     "datasets[0].max_samples must be an integer, got a list [4]"),
])
def test_the_cli_refuses_a_list_at_parsing_in_one_line(stage, key, value, expected, tmp_path, capsys):
    recipe = write(tmp_path, {"output_dir": str(tmp_path / "out"), key: value})
    with pytest.raises(SystemExit) as info:
        cli_main([stage, "--config", recipe])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"rlhf-trl {stage}: error: {recipe}: {expected}"), err[-1]
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_valid_recipe_parses_unchanged(tmp_path):
    recipe = write(tmp_path, {"output_dir": str(tmp_path / "o"), "learning_rate": 1.0e-4, "report_to": "none",
                              "reward_baseline": 0.5, "bf16": False, "max_steps": 3})
    parsed = parse_recipe(stage_types("ppo"), ["--config", recipe])
    ppo_args, training_args = parsed.script, parsed.training
    assert training_args.learning_rate == 1.0e-4 and training_args.max_steps == 3
    assert ppo_args.reward_baseline_value() == 0.5
