"""Every recipe value is checked when the recipe is parsed, and nothing of an earlier run changes on any failure: a
bad value (recipe file or command line), an output_dir that is a file, a causal LM as the reward model,
a reward function that raises at update 1 and a diverged run each stop with one line, the last on stderr, and leave
every file of the earlier run in output_dir byte-identical, with nothing new beside it."""

import os
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import RECIPES, import_ppo, reward_stand_in, tree_hashes

from rlhf_trl.cli import main as cli_main


@pytest.fixture(scope="module")
def earlier_ppo(assets, tmp_path_factory):
    """A finished 4-update PPO run (checkpoints 2 and 4, samples, logs, merged models) of the base model against the
    stand-in reward model."""
    out = tmp_path_factory.mktemp("earlier") / "ppo"
    import_ppo().main(ppo_argv(assets, out, "--save_steps", "2", "--log_samples_every", "2"))
    assert {"checkpoint-2", "checkpoint-4", "merged", "samples.jsonl", "metrics.json"} <= set(os.listdir(out))
    return out


def ppo_argv(assets, out, *extra):
    return ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            assets["base_model"], "--reward_model_path", reward_stand_in(assets), "--output_dir", str(out),
            "--max_samples", "48", "--eval_split_size", "8", "--per_device_eval_batch_size", "8",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--total_episodes", "16",
            "--num_ppo_epochs", "1", "--response_length", "8", "--local_rollout_forward_batch_size", "4",
            "--logging_steps", "1", "--report_to", "tensorboard", "--overwrite_output_dir", "true", *extra]


def stage_argv(stage, assets, out, *extra):
    if stage == "ppo":
        return ppo_argv(assets, out, *extra)
    data, model = (assets["sft"], assets["base_model"]) if stage == "sft" else (assets["rm"], assets["base_model"])
    return ["--config", f"{RECIPES}/{stage}.yaml", "--dataset_name", data, "--model_name_or_path", model,
            "--output_dir", str(out), "--overwrite_output_dir", "true", *extra]


def recipe_with(tmp_path, stage, **values) -> str:
    """The demo recipe of ``stage`` with ``values`` set, written to tmp_path."""
    with open(f"{RECIPES}/{stage}.yaml", encoding="utf-8") as f:
        recipe = {**yaml.safe_load(f), **values}
    path = tmp_path / f"{stage}.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return str(path)


def last_stderr_line(stage, argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        cli_main([stage, *argv])
    err = capsys.readouterr().err
    return exc.value.code, err.splitlines()[-1] if err.strip() else "", err


# (name, stage, recipe values, extra args, the exact last line after "rlhf-trl <stage>: error: "; "{recipe}": the
# recipe file written with the values, "{base}": the base model, "{rm_hint}": the rm recipe beside the demo's)
CASES = [
    ("learning_rate_in_recipe", "sft", {"learning_rate": -0.001}, [],
     "{recipe}: learning_rate must be > 0, got -0.001"),
    ("learning_rate_on_command_line", "ppo", {}, ["--learning_rate", "-1e-3"],
     "command line: learning_rate must be > 0, got -0.001"),
    ("learning_rate_command_line_over_recipe", "rm", {"learning_rate": 0.1}, ["--learning_rate=-1e-3"],
     "command line: learning_rate must be > 0, got -0.001"),
    ("response_length_zero", "ppo", {"response_length": 0}, [], "{recipe}: response_length must be >= 1, got 0"),
    ("response_length_zero_on_command_line", "ppo", {}, ["--response_length", "0"],
     "command line: response_length must be >= 1, got 0"),
    ("batch_size_zero", "rm", {}, ["--per_device_train_batch_size", "0"],
     "command line: per_device_train_batch_size must be >= 1, got 0"),
    ("gradient_accumulation_zero", "sft", {"gradient_accumulation_steps": 0}, [],
     "{recipe}: gradient_accumulation_steps must be >= 1, got 0"),
    ("epochs_zero", "sft", {}, ["--num_train_epochs", "0"], "command line: num_train_epochs must be > 0, got 0.0"),
    ("max_length_zero", "rm", {"max_length": 0}, [], "{recipe}: max_length must be >= 1, got 0"),
    ("gamma_above_one", "ppo", {}, ["--gamma", "1.5"], "command line: gamma must be in [0, 1], got 1.5"),
    ("unknown_key", "sft", {"learnig_rate": 0.1}, [],
     "{recipe}: unknown key(s) ['learnig_rate']; did you mean 'learning_rate'?"),
    ("unknown_flag", "ppo", {}, ["--respone_length", "8"],
     "command line: unknown argument(s) ['--respone_length', '8']; did you mean '--response_length'?"),
    ("output_dir_is_a_file", "sft", {}, ["--output_dir", "{file}"],
     "command line: output_dir '{file}' is a file, not a directory; choose another output_dir"),
    ("output_dir_under_a_file", "ppo", {"output_dir": "{file}/ppo"}, [],
     "{recipe}: output_dir '{file}/ppo': '{file}' is a file, not a directory; choose another output_dir"),
    ("causal_lm_as_reward_model", "ppo", {}, ["--reward_model_path", "{base}"],
     "reward_model_path '{base}' is a Qwen2ForCausalLM, not a sequence-classification model: a reward model needs "
     "a trained score head; train one with `make rm RECIPE={rm_hint}` and use its merged/ directory"),
    ("reward_model_without_score_weights", "ppo", {}, ["--reward_model_path", "{headless}"],
     "reward_model_path '{headless}' has no score.weight in its weights (its score head would be newly initialised "
     "at random): a reward model needs a trained score head; train one with `make rm RECIPE={rm_hint}` and use its "
     "merged/ directory"),
]


@pytest.mark.parametrize("name, stage, values, extra, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_value_over_a_finished_run_is_one_line(assets, earlier_ppo, tmp_path, capsys, name, stage, values, extra,
                                                   expected):
    """Exit 2, the exact error as the last line on stderr, no traceback, the earlier run byte-identical."""
    out = tmp_path / "run"
    shutil.copytree(earlier_ppo, out)
    (tmp_path / "notes.txt").write_text("a file, not a directory\n")
    headless = tmp_path / "headless"  # a sequence-classification config over weights without score.weight
    shutil.copytree(assets["base_model"], headless)
    (headless / "config.json").write_text((headless / "config.json").read_text().replace(
        "Qwen2ForCausalLM", "Qwen2ForSequenceClassification"))
    subs = {"{file}": str(tmp_path / "notes.txt"), "{base}": assets["base_model"], "{headless}": str(headless)}

    def fill(text):
        for key, value in subs.items():
            text = text.replace(key, value)
        return text

    recipe = recipe_with(tmp_path, stage, **{k: fill(v) if isinstance(v, str) else v for k, v in values.items()})
    argv = stage_argv(stage, assets, out, *[fill(e) for e in extra])
    argv[argv.index("--config") + 1] = recipe
    for key in values:  # set in the recipe only
        if f"--{key}" in argv:
            argv[argv.index(f"--{key}"):argv.index(f"--{key}") + 2] = []
    before = tree_hashes(tmp_path)
    code, last, err = last_stderr_line(stage, argv, capsys)
    subs.update({"{recipe}": recipe, "{rm_hint}": str(tmp_path / "rm.yaml")})
    assert (code, last) == (2, f"rlhf-trl {stage}: error: " + fill(expected)), err[-3000:]
    assert "Traceback" not in err
    assert tree_hashes(tmp_path) == before  # the earlier run, the recipe, the models: nothing written or deleted


def test_reward_function_raising_at_update_1_leaves_the_earlier_run_byte_identical(assets, earlier_ppo, tmp_path):
    """A reward function that raises once training has started (a real process): exit 2, the one-line error is the
    last line on stderr (after the progress bar), the earlier run's files are back, byte for byte, and nothing the
    failed run wrote (event files, samples, staging) is left."""
    out = tmp_path / "run"
    shutil.copytree(earlier_ppo, out)
    bad = tmp_path / "rewards.py"
    bad.write_text("def boom(prompts, completions, **kw):\n    raise KeyError('label')\n")
    before = tree_hashes(out)
    proc = subprocess.run([sys.executable, "-m", "rlhf_trl", "ppo", *ppo_argv(assets, out, "--reward_funcs",
                                                                            f"{bad}:boom")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (f"rlhf-trl ppo: error: reward function {bad}:boom at update 1: raised "
                                            "KeyError: 'label'"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert tree_hashes(out) == before


def test_divergence_leaves_the_earlier_run_byte_identical(assets, earlier_ppo, tmp_path, capsys):
    """A non-finite score at update 1 (an overflowing missing_eos_penalty): exit 3, 'training stopped' as the last
    line, no checkpoint of the earlier run named as this run's, the earlier run byte-identical."""
    from rlhf_trl.cli_launch import run_stage

    out = tmp_path / "run"
    shutil.copytree(earlier_ppo, out)
    before = tree_hashes(out)
    with pytest.raises(SystemExit) as exc:
        run_stage("ppo", ppo_argv(assets, out, "--missing_eos_penalty", "1e39"))
    last = capsys.readouterr().err.splitlines()[-1]
    assert exc.value.code == 3 and last.startswith("rlhf-trl ppo: training stopped: non-finite "), last
    assert "at update 1 " in last and last.endswith("last good checkpoint: none yet"), last
    assert tree_hashes(out) == before


def test_a_killed_run_over_an_earlier_one_is_undone_by_the_next_start(assets, earlier_ppo, tmp_path):
    """A run killed after it set the earlier run aside (the set-aside directory, a new event file and a staging
    directory left as a SIGKILL leaves them): the next start puts the earlier run back before it checks anything,
    here before it fails on a missing data file."""
    from rlhf_trl.checkpoints import set_earlier_run_aside
    from rlhf_trl.data import DataError

    out = tmp_path / "run"
    shutil.copytree(earlier_ppo, out)
    before = tree_hashes(out)
    set_earlier_run_aside(str(out))
    assert sorted(os.listdir(out)) == [".earlier-run"]
    (out / "runs").mkdir()
    (out / "runs" / "events.new").write_text("new")
    (out / ".tmp-checkpoint-1").mkdir()
    with pytest.raises(DataError, match="file not found"):
        import_ppo().main(ppo_argv(assets, out, "--dataset_name", str(tmp_path / "missing.jsonl")))
    assert tree_hashes(out) == before


def test_function_reward_ppo_without_a_reward_model_key_runs_offline(assets, tmp_path):
    """A recipe with reward functions and no reward_model_path key at all: no hub default, no download."""
    from rlhf_trl import ppo

    with open(f"{RECIPES}/ppo.yaml", encoding="utf-8") as f:
        recipe = yaml.safe_load(f)
    del recipe["reward_model_path"]
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    argv = ppo_argv(assets, tmp_path / "out", "--value_model_path", reward_stand_in(assets), "--reward_funcs",
                    "rlhf_trl.demo_task:ground_truth_reward", "--total_episodes", "8", "--save_strategy", "no")
    argv[argv.index("--config") + 1] = str(path)
    argv[argv.index("--reward_model_path"):argv.index("--reward_model_path") + 2] = []
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    res = ppo.main(argv)
    assert res["trainer"].reward_model is None and res["metrics"]["global_step"] == 2
    assert (tmp_path / "out" / "merged" / "model.safetensors").is_file()


def test_bitsandbytes_offline_kernel_warnings_are_silenced(caplog):
    """The two WARNING lines bitsandbytes' CPU backend logs at import when the hub's kernel cannot be fetched."""
    import logging

    from rlhf_trl.cli_launch import quiet_libraries

    quiet_libraries()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("kernels._internals.hf_hub").warning("Skipping publisher trust check for 'x'")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: %s", "offline")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]
