"""Bit-exact comparison of two finished runs of a stage, and the configurations held to it.

`assert_runs_equal(dir_a, dir_b)` holds a resumed (or killed and resumed) run to the uninterrupted one: every file
both runs left is compared by what it holds, tensors with `torch.equal` (bit for bit: a NaN equals a NaN of the same
bits), everything else with ``==`` (a float NaN equals NaN). Compared:

- final weights: every ``*.safetensors`` outside the checkpoints (``merged/``, ``adapter/``, PPO's ``value_model/``);
- every checkpoint both runs hold (the newest must be one): weights, ``optimizer.pt``, ``scheduler.pt``, the RNG
  states (``rng_state*.pth``), PPO's data position (``data_state*.pt``), PPO's reward baseline and KL coefficient
  (``reward_baseline.json``: ``reward_baseline``, ``kl_coef``), SFT / RM loop sums (``loop_state.json``), and
  ``trainer_state.json`` (log history included);
- the run's ``log_history.json``, ``metrics.json`` (PPO: ``kl_coef_final``), RM ``eval_metrics.json`` /
  ``eval_pairs.jsonl``, PPO ``samples.jsonl``, ``run_config.yaml``.

Left out, by name: `WALL_TIME_FIELDS` in any log entry or metrics file, `PATH_KEYS` of the recipe files (the two
runs write to different directories), ``training_args.bin`` (a pickle of the arguments, paths included; its values
are ``run_config.yaml``'s) and ``runs/`` (TensorBoard event files: wall-clock stamps); the order of `SET_VALUED`
lists in ``adapter_config.json`` (peft writes these sets in the string-hash order of the process); the file sizes in
a checkpoint's ``manifest.json`` (its list of files is compared): besides the files holding paths or wall times,
a pickle's bytes depend on which equal objects it shares (a resumed run's PPO ``data_state.pt`` holds a saved RNG
state next to a fresh one and is 64 bytes longer than the uninterrupted run's, with the same values).

`tree_digest(root)` identifies an on-disk state (two roots with the same digest resume identically), and
`stage_configs` lists the runs held to exact resume. Running those stages in fresh processes (the `Zygote` fork
server, kill sweeps, ``accelerate launch``) is zygote.py's job.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import torch
import yaml

# measured from elapsed time: differ between two runs of the same computation
WALL_TIME_FIELDS = frozenset({
    "eps",  # PPO: episodes per second since the start of this process's training
    "train_runtime", "train_samples_per_second", "train_steps_per_second", "train_tokens_per_second",
    "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_tokens_per_second",
    "peak_memory_mb",  # the process's peak memory: a resumed process has a different history
    "step_time",  # GRPO / RLOO: seconds per step
})
# recipe keys naming where a run writes (differ between the runs compared)
PATH_KEYS = frozenset({"output_dir", "logging_dir", "resume_from_checkpoint"})
NOT_COMPARED = frozenset({"training_args.bin", ".rlhf-trl.lock"})  # the lock names its holder: not run state
SET_VALUED = ("target_modules", "modules_to_save")  # adapter_config.json: sets, compared as sets
SKIPPED_DIRS = frozenset({"runs"})
CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


# -- equality ------------------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def assert_same(a, b, where: str = "") -> None:
    """``a`` and ``b`` hold the same values: tensors `torch.equal` (or the same bits), numpy arrays equal, floats ==
    (NaN == NaN), mappings and sequences element by element. AssertionError names the first difference."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if torch.equal(a, b) or torch.equal(_bits(a), _bits(b)):
            return
        diff = (a.double() - b.double()).abs().nan_to_num(float("inf")).max().item() if a.is_floating_point() else "-"
        raise AssertionError(f"{where}: tensors differ (max abs difference {diff})")
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{where}: arrays differ"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: dict vs {type(b)}"
        assert set(a) == set(b), f"{where}: keys only in a {sorted(map(str, set(a) - set(b)))}, only in b " \
                                 f"{sorted(map(str, set(b) - set(a)))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
        return
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def drop_wall_time(entries):
    """A log entry (or a list of them, or metrics) without `WALL_TIME_FIELDS`."""
    if isinstance(entries, list):
        return [drop_wall_time(e) for e in entries]
    return {k: v for k, v in entries.items() if k not in WALL_TIME_FIELDS}


# -- reading a file for comparison ---------------------------------------------------------------------------------
def _load_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def comparable(path: Path):
    """What of a run's file is compared (see the module docstring)."""
    name = path.name
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path))
    if name.endswith((".pt", ".pth")):
        return torch.load(path, weights_only=False)
    if name == "trainer_state.json":
        state = json.loads(path.read_text(encoding="utf-8"))
        state["log_history"] = drop_wall_time(state["log_history"])
        return state
    if name in ("log_history.json",):
        data = json.loads(path.read_text(encoding="utf-8"))
        return {"log_history": drop_wall_time(data["log_history"])}
    if name == "metrics.json":
        return drop_wall_time(json.loads(path.read_text(encoding="utf-8")))
    if name == "manifest.json":  # the files it lists (their sizes: see the module docstring)
        data = json.loads(path.read_text(encoding="utf-8"))
        data["files"] = sorted(data["files"])
        return data
    if name == "adapter_config.json":  # peft writes target_modules, a set, in the process's string-hash order
        data = json.loads(path.read_text(encoding="utf-8"))
        for key in SET_VALUED:
            if isinstance(data.get(key), list):
                data[key] = sorted(data[key])
        return data
    if name.endswith(".json"):
        return json.loads(path.read_text(encoding="utf-8"))
    if name.endswith(".jsonl"):
        return _load_jsonl(path)
    if name.endswith((".yaml", ".yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return {k: v for k, v in data.items() if k not in PATH_KEYS} if isinstance(data, dict) else data
    return path.read_bytes()


def run_files(root: Path) -> dict[str, Path]:
    """The files of a finished run that are compared, by path relative to ``root`` (staging directories, ``runs/``
    and `NOT_COMPARED` left out)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root)
        dirs[:] = [d for d in dirs if not d.startswith(".tmp-") and not (rel_folder == Path(".") and d in SKIPPED_DIRS)]
        for f in files:
            if f in NOT_COMPARED or f.endswith(".tmp"):
                continue
            found[str(rel_folder / f)] = Path(folder) / f
    return found


def checkpoints(root) -> list[int]:
    """Steps of the complete ``checkpoint-N`` directories in ``root``, ascending."""
    return sorted(int(m.group(1)) for d in os.listdir(root) if (m := CHECKPOINT.match(d)))


def assert_trees_equal(dir_a, dir_b, rel: str = "") -> None:
    """Every compared file (`run_files`) under ``dir_a/rel`` and ``dir_b/rel`` holds the same (`comparable`)."""
    a, b = Path(dir_a) / rel, Path(dir_b) / rel
    fa, fb = run_files(a), run_files(b)
    assert set(fa) == set(fb), f"only in {a}: {sorted(set(fa) - set(fb))}; only in {b}: {sorted(set(fb) - set(fa))}"
    for name in sorted(fa):
        assert_same(comparable(fa[name]), comparable(fb[name]), os.path.join(rel, name))


def assert_runs_equal(dir_a, dir_b) -> None:
    """The finished runs in ``dir_a`` and ``dir_b`` hold the same results (module docstring). Checkpoints that only
    one of them holds (a resumed run lacks those it did not copy) are not compared; the newest must be in both."""
    a, b = Path(dir_a), Path(dir_b)
    ca, cb = checkpoints(a), checkpoints(b)
    assert ca and cb and ca[-1] == cb[-1], f"newest checkpoints differ: {ca} vs {cb}"
    common = set(ca) & set(cb)
    fa, fb = run_files(a), run_files(b)

    def keep(rel: str) -> bool:
        m = CHECKPOINT.match(rel.split(os.sep)[0])
        return m is None or int(m.group(1)) in common

    fa = {k: v for k, v in fa.items() if keep(k)}
    fb = {k: v for k, v in fb.items() if keep(k)}
    assert set(fa) == set(fb), f"files only in {a}: {sorted(set(fa) - set(fb))}; only in {b}: {sorted(set(fb) - set(fa))}"
    weights = [k for k in fa if k.endswith(".safetensors") and not CHECKPOINT.match(k.split(os.sep)[0])]
    assert weights, f"{a} holds no final weights"
    for rel in sorted(fa):
        assert_same(comparable(fa[rel]), comparable(fb[rel]), rel)


# -- the configurations held to exact resume ----------------------------------------------------------------------
RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "demo"



class StageConfig:
    """One run held to exact resume: ``rlhf-trl <stage> argv --output_dir DIR`` on ``nproc`` processes; its
    uninterrupted run saves ``checkpoints`` (steps), the last one at the end of training."""

    def __init__(self, name: str, stage: str, argv: list[str], checkpoints: list[int], nproc: int = 1):
        self.name, self.stage, self.argv, self.checkpoints, self.nproc = name, stage, argv, checkpoints, nproc

    def __repr__(self) -> str:
        return f"StageConfig({self.name})"


def stage_configs(assets: dict, sft_merged: str, rm_merged: str) -> dict[str, StageConfig]:
    """The eleven configurations: tiny runs of the demo assets, three checkpoints each, the second in the middle of
    the run. SFT / RM: 8 steps of 2 accumulated micro-batches, 2 passes over the data, checkpoints between two
    logging steps (so the loop's running loss sums matter). PPO: 3 updates, adaptive KL control, a sample table
    every update, the 2nd checkpoint at the end of a pass over the prompts (2 processes: in the second pass)."""
    common = ["--save_strategy", "steps", "--report_to", "none", "--overwrite_output_dir", "true"]
    sft = ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
           assets["base_model"], "--max_samples", "36", "--eval_split_size", "4", "--num_train_epochs", "2",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--warmup_steps", "2",
           "--save_steps", "3", "--logging_steps", "2", *common]  # 32 rows / 8 = 4 steps a pass, 8 steps
    rm = ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"], "--model_name_or_path", sft_merged,
          "--max_samples", "12", "--eval_split_size", "4", "--num_train_epochs", "2",
          "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--save_steps", "3",
          "--logging_steps", "2", *common]  # 36 pairs - 4 held out = 32 / 8 = 4 steps a pass, 8 steps
    ppo = ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path", sft_merged,
           "--reward_model_path", rm_merged, "--max_samples", "24", "--eval_split_size", "8",
           "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--per_device_eval_batch_size",
           "4", "--total_episodes", "24", "--num_ppo_epochs", "1", "--response_length", "8",
           "--local_rollout_forward_batch_size", "8", "--kl_target", "0.5", "--kl_horizon", "40",
           "--log_samples_every", "1", "--save_steps", "1", "--logging_steps", "1", *common]
    # 16 prompts / 8 = 2 updates a pass, 3 updates: checkpoint-2 ends the first pass
    ppo2 = [*ppo]
    ppo2[ppo2.index("--max_samples") + 1] = "32"
    ppo2[ppo2.index("--eval_split_size") + 1] = "16"
    ppo2[ppo2.index("--total_episodes") + 1] = "48"
    # 2 processes: 16 prompts / 16 = 1 update a pass, 3 updates: checkpoint-2 is in the second pass (the sampler's
    # generator, shared by the processes, has moved on)
    dpo = ["--config", f"{RECIPES}/dpo.yaml", "--dataset_name", assets["rm"], "--model_name_or_path", sft_merged,
           "--max_samples", "12", "--eval_split_size", "4", "--num_train_epochs", "2", "--per_device_train_batch_size",
           "4", "--gradient_accumulation_steps", "2", "--save_steps", "3", "--logging_steps", "2", *common]
    # 36 pairs - 4 held out = 32 / 8 = 4 steps a pass, 8 steps (as RM)
    grpo = ["--config", f"{RECIPES}/grpo.yaml", "--dataset_name", assets["prompts"], "--model_name_or_path",
            sft_merged, "--reward_model_path", rm_merged, "--max_samples", "16", "--eval_split_size", "4",
            "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8",
            "--max_steps", "6", "--save_steps", "2", "--logging_steps", "1", *common]
    # 2 prompts x 4 completions a step; 12 training prompts / 2 = 6 steps: one pass
    rloo = [*grpo]
    rloo[rloo.index(f"{RECIPES}/grpo.yaml")] = f"{RECIPES}/rloo.yaml"
    kto = ["--config", f"{RECIPES}/kto.yaml", "--dataset_name", assets["rm"], "--model_name_or_path", sft_merged,
           "--max_samples", "6", "--eval_split_size", "4", "--num_train_epochs", "2", "--per_device_train_batch_size",
           "4", "--gradient_accumulation_steps", "2", "--save_steps", "3", "--logging_steps", "2", *common]
    # 6 ranked lists x 3 pairs x 2 examples = 36 - 4 held out = 32 / 8 = 4 steps a pass, 8 steps (as DPO)
    lora_value = ["--value_use_peft", "true", "--value_lora_r", "4"]
    configs = [
        StageConfig("sft", "sft", sft, [3, 6, 8]),
        StageConfig("rm", "rm", rm, [3, 6, 8]),
        StageConfig("ppo", "ppo", ppo, [1, 2, 3]),
        StageConfig("ppo_value_lora", "ppo", [*ppo, *lora_value], [1, 2, 3]),
        StageConfig("ppo_shared_base", "ppo", [*ppo, *lora_value, "--share_reward_value_base", "true"], [1, 2, 3]),
        StageConfig("ppo_value_head", "ppo", [*ppo, "--value_head", "true"], [1, 2, 3]),
        StageConfig("ppo_ptx", "ppo", [*ppo, "--ptx_dataset", assets["sft"], "--ptx_coef", "0.1"], [1, 2, 3]),
        StageConfig("ppo_baseline_auto", "ppo", [*ppo, "--reward_baseline", "auto", "--reward_baseline_batches", "1"],
                    [1, 2, 3]),
        StageConfig("ppo_2proc", "ppo", ppo2, [1, 2, 3], nproc=2),
        StageConfig("dpo", "dpo", dpo, [3, 6, 8]),
        StageConfig("grpo", "grpo", grpo, [2, 4, 6]),
        StageConfig("rloo", "rloo", rloo, [2, 4, 6]),
        StageConfig("kto", "kto", kto, [3, 6, 8]),
    ]
    return {c.name: c for c in configs}



# -- on-disk state -------------------------------------------------------------------------------------------------
def tree_digest(root) -> str:
    """sha256 over every file under ``root`` outside ``.tmp-*`` staging directories (which a new run removes before
    anything else): relative path and bytes. Two roots with the same digest resume identically."""
    h = hashlib.sha256()
    root = Path(root)
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".tmp-")]
        paths += [Path(folder) / f for f in files]
        paths += [Path(folder) / d for d in dirs]  # empty directories count too
    for p in sorted(paths):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if p.is_symlink():
            h.update(b"link:" + os.readlink(p).encode())
        elif p.is_file():
            h.update(b"file:" + p.read_bytes())
        else:
            h.update(b"dir")
        h.update(b"\0")
    return h.hexdigest()
