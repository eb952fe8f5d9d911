"""Multi-process proof on CPU: SFT, RM and PPO each run once as one process and once under
``accelerate launch --num_processes 2`` (gloo, recipes/accelerate_configs/multi_cpu.yaml, as ``make <stage>
ACCEL=multi_cpu NPROC=2`` runs them), and produce the same outputs: the same files, models that load, step counts
that follow the effective batch = per_device_train_batch_size x processes x gradient_accumulation_steps (the formula
each recipe states in its header comment), and every file written by one process only.

Tiny runs on the demo assets (a few optimizer steps / PPO updates each): about 1.5-2 minutes on 2 CPU cores.
"""

import json
import math
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RECIPES = os.path.join(REPO, "recipes", "demo")
MULTI_CPU = os.path.join(REPO, "recipes", "accelerate_configs", "multi_cpu.yaml")
DDP = os.path.join(REPO, "recipes", "accelerate_configs", "ddp.yaml")
NPROC = 2
# per-device batch and gradient accumulation of every run here: effective batch 8 (1 process) / 16 (2 processes)
PER_DEVICE, GRAD_ACCUM = 4, 2
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "ACCELERATE_USE_CPU")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(stage: str, args: list[str], nproc: int, config: str = MULTI_CPU, use_cpu_env: bool = True,
           check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """``rlhf-trl <stage> ARGS`` as one process, or under ``accelerate launch --num_processes nproc``; ``env``: more
    environment variables (e.g. a fault to inject)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV} | (env or {})
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RLHF_TRL_DEBUG="1", PYTHONUNBUFFERED="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "rlhf_trl.cli", stage, *args]
    else:
        if use_cpu_env:
            env["ACCELERATE_USE_CPU"] = "true"  # what `make ... ACCEL=multi_cpu` exports
        cmd = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file", config,
               "--num_processes", str(nproc), "--main_process_port", str(free_port()), "-m", "rlhf_trl.cli", stage,
               *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


def run_both(tmp_path_factory, stage: str, args: list[str]) -> dict:
    """Run a stage as 1 and as NPROC processes into separate output dirs. Returns {nproc: (output_dir, process)}."""
    runs = {}
    for n in (1, NPROC):
        out = str(tmp_path_factory.mktemp(f"{stage}_{n}proc"))
        runs[n] = (out, launch(stage, [*args, "--output_dir", out], n))
    return runs


def expected_steps(rows: int, nproc: int, epochs: int = 1) -> int:
    """Optimizer steps of SFT / RM: ceil(rows / effective batch) per epoch (the last batch may be short)."""
    return math.ceil(rows / (PER_DEVICE * nproc * GRAD_ACCUM)) * epochs


def file_set(root: str) -> set[str]:
    """Relative paths under ``root`` with step numbers and ranks normalized (checkpoint-N, rng_state*.pth,
    data_state*.pt: each process saves its own RNG and data position)."""
    paths = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            rel = re.sub(r"checkpoint-\d+", "checkpoint-N", rel)
            rel = re.sub(r"rng_state(_\d+)?\.pth$", "rng_state*.pth", rel)
            rel = re.sub(r"data_state(_rank\d+)?\.pt$", "data_state*.pt", rel)
            paths.add(rel)
    return paths


def checkpoints(root: str) -> list[int]:
    return sorted(int(m.group(1)) for d in os.listdir(root) if (m := re.fullmatch(r"checkpoint-(\d+)", d)))


def expected_checkpoints(steps: int, save_steps: int, kept: int = 3) -> list[int]:
    """Every save_steps updates, and at the end of training; the newest ``kept`` (the default save_total_limit)."""
    return sorted(set(range(save_steps, steps + 1, save_steps)) | {steps})[-kept:]


def assert_written_once(root: str, proc: subprocess.CompletedProcess, stage: str, nproc: int) -> None:
    """No leftovers of two processes writing one file; each JSON file parses; the run's report printed once."""
    names = {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}
    assert not [n for n in names if n.endswith(".tmp") or ".tmp-" in n], names
    for name in names:
        path = os.path.join(root, name)
        if name.endswith(".json"):
            json.load(open(path, encoding="utf-8"))
        elif name.endswith(".jsonl"):
            for line in open(path, encoding="utf-8"):
                json.loads(line)
    last = os.path.join(root, f"checkpoint-{checkpoints(root)[-1]}")
    ranks = sorted(f for f in os.listdir(last) if f.startswith("rng_state"))
    assert ranks == (["rng_state.pth"] if nproc == 1 else [f"rng_state_{r}.pth" for r in range(nproc)])
    # the manifest, written by the main process after every process's files, lists every process's RNG state
    from rlhf_trl.checkpoints import MANIFEST, checkpoint_problem

    assert set(ranks) <= set(json.load(open(os.path.join(last, MANIFEST)))["files"])
    assert checkpoint_problem(last) is None
    assert proc.stdout.count(f"rlhf-trl {stage}: done") == 1, proc.stdout[-2000:]


def load_and_score(path: str, kind: str, tokenizer_dir: str) -> torch.Tensor:
    """Load a saved model with plain transformers and run it on one prompt; returns its output (logits / score)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls = AutoModelForCausalLM if kind == "lm" else AutoModelForSequenceClassification
    model = cls.from_pretrained(path).eval()
    ids = tok("问：你觉得咖啡怎么样？\n\n答：", return_tensors="pt")
    with torch.no_grad():
        out = model(**ids).logits
    assert torch.isfinite(out).all(), path
    return out


def compare(runs: dict) -> None:
    one, many = file_set(runs[1][0]), file_set(runs[NPROC][0])
    assert one == many, f"only in 1 process: {sorted(one - many)}; only in {NPROC}: {sorted(many - one)}"


def metrics(out: str) -> dict:
    return json.load(open(os.path.join(out, "metrics.json"), encoding="utf-8"))


# -- the runs' arguments (each stage's single-process output is the next stage's input) ------------------------

def common(save_steps: int) -> list[str]:
    return ["--per_device_train_batch_size", str(PER_DEVICE), "--gradient_accumulation_steps", str(GRAD_ACCUM),
            "--save_strategy", "steps", "--save_steps", str(save_steps), "--logging_steps", "1",
            "--report_to", "none", "--overwrite_output_dir", "true"]


SFT_EPOCHS, SFT_SAVE = 2, 3
RM_SAVE = 2
PPO_EPISODES, PPO_SAVE = 32, 2


def sft_args(assets) -> list[str]:
    # 60 rows - 8 held out = 52 training rows: 7 steps / epoch on 1 process, 4 on 2 (the last batch is short)
    return ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
            assets["base_model"], "--max_samples", "60", "--eval_split_size", "8", "--num_train_epochs",
            str(SFT_EPOCHS), "--warmup_steps", "0", *common(SFT_SAVE)]


def rm_args(assets, sft_runs) -> list[str]:
    return ["--config", f"{RECIPES}/rm.yaml", "--dataset_name", assets["rm"], "--model_name_or_path",
            os.path.join(sft_runs[1][0], "merged"), "--max_samples", "24", "--eval_split_size", "4",
            "--num_train_epochs", "1", *common(RM_SAVE)]


def ppo_args(assets, sft_runs, rm_runs, episodes: int = PPO_EPISODES, samples_every: int = 1,
             auto_baseline: bool = True) -> list[str]:
    """The demo PPO recipe on the single-process SFT and RM outputs; ``auto_baseline``: ``reward_baseline auto``
    calibrated on one batch."""
    extra = ["--reward_baseline", "auto", "--reward_baseline_batches", "1"] if auto_baseline else []
    return ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"],
            "--sft_model_path", os.path.join(sft_runs[1][0], "merged"),
            "--reward_model_path", os.path.join(rm_runs[1][0], "merged"),
            "--max_samples", "64", "--total_episodes", str(episodes), "--num_ppo_epochs", "1",
            "--local_rollout_forward_batch_size", "8", "--log_samples_every", str(samples_every), *extra,
            *common(PPO_SAVE)]


# the runs themselves (`sft_runs`, `rm_runs`, `ppo_runs`) are session fixtures in conftest.py: tests/test_zero.py
# compares its ZeRO runs with the same DDP runs


# -- SFT -----------------------------------------------------------------------------------------------------------

def test_sft_two_processes_match_one(assets, sft_runs):
    compare(sft_runs)
    rows = {n: metrics(out)["num_train_rows"] for n, (out, _) in sft_runs.items()}
    assert rows[1] == rows[NPROC] == 52
    for n, (out, proc) in sft_runs.items():
        steps = expected_steps(rows[n], n, SFT_EPOCHS)
        assert metrics(out)["global_step"] == steps, (n, metrics(out)["global_step"], steps)
        assert checkpoints(out) == expected_checkpoints(steps, SFT_SAVE)
        state = json.load(open(os.path.join(out, f"checkpoint-{steps}", "trainer_state.json")))
        assert state["global_step"] == state["max_steps"] == steps
        assert {"merged", "metrics.json", "run_config.yaml"} <= set(os.listdir(out))
        assert_written_once(out, proc, "sft", n)
        load_and_score(os.path.join(out, "merged"), "lm", os.path.join(out, "merged"))
    assert expected_steps(52, 1, SFT_EPOCHS) == 14 and expected_steps(52, NPROC, SFT_EPOCHS) == 8


# -- RM ------------------------------------------------------------------------------------------------------------

def test_rm_two_processes_match_one(rm_runs):
    compare(rm_runs)
    pairs = {n: metrics(out)["num_train_pairs"] for n, (out, _) in rm_runs.items()}
    assert pairs[1] == pairs[NPROC] > 0
    for n, (out, proc) in rm_runs.items():
        steps = expected_steps(pairs[n], n)
        assert metrics(out)["global_step"] == steps, (n, metrics(out)["global_step"], steps)
        assert checkpoints(out) == expected_checkpoints(steps, RM_SAVE)
        assert {"merged", "adapter", "eval_metrics.json", "metrics.json", "run_config.yaml"} <= set(os.listdir(out))
        ev = json.load(open(os.path.join(out, "eval_metrics.json")))
        assert ev["num_pairs"] == metrics(out)["num_eval_pairs"] > 0  # the whole eval split, scored once
        assert_written_once(out, proc, "rm", n)
        score = load_and_score(os.path.join(out, "merged"), "cls", os.path.join(out, "merged"))
        assert score.shape == (1, 1)
    assert expected_steps(pairs[1], 1) > expected_steps(pairs[1], NPROC)


# -- PPO -----------------------------------------------------------------------------------------------------------

def test_ppo_two_processes_match_one(ppo_runs):
    compare(ppo_runs)
    baselines = set()
    for n, (out, proc) in ppo_runs.items():
        m = metrics(out)
        updates = PPO_EPISODES // (PER_DEVICE * n * GRAD_ACCUM)  # total_episodes / effective batch
        assert m["global_step"] == updates and m["episode"] == PPO_EPISODES, (n, m["global_step"], updates)
        assert checkpoints(out) == expected_checkpoints(updates, PPO_SAVE)
        last = os.path.join(out, f"checkpoint-{updates}")
        assert {"adapter_model.safetensors", "value_model", "merged", "data_state.pt", "reward_baseline.json",
                "run_config.yaml", "optimizer.pt"} <= set(os.listdir(last))
        assert {"adapter", "merged", "value_model", "samples.jsonl", "metrics.json", "run_config.yaml"} <= set(
            os.listdir(out))
        assert_written_once(out, proc, "ppo", n)
        # the checkpoint's adapter is the policy's LoRA (not the policy + value wrapper)
        from safetensors.torch import load_file

        keys = load_file(os.path.join(last, "adapter_model.safetensors")).keys()
        assert keys and all("lora_" in k for k in keys)
        # reward_baseline auto: one number, the same in the metrics and every checkpoint of the run
        saved = {json.load(open(os.path.join(out, f"checkpoint-{c}", "reward_baseline.json")))["reward_baseline"]
                 for c in checkpoints(out)}
        assert saved == {m["reward_baseline"]}
        baselines.add(round(m["reward_baseline"], 5))
        # sample tables: one per update (log_samples_every 1), each with the eval batch of every process, once
        rows = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"), encoding="utf-8")]
        steps = [r["step"] for r in rows]
        assert sorted(set(steps)) == list(range(1, updates + 1))
        assert all(steps.count(s) == 8 * n for s in set(steps))  # per_device_eval_batch_size x processes
        assert len({(r["step"], r["query"]) for r in rows}) == len(rows)
        assert proc.stdout.count("samples at update") + proc.stderr.count("samples at update") == updates
        # trainer log: each update logged once
        state = json.load(open(os.path.join(last, "trainer_state.json")))
        logged = [h["step"] for h in state["log_history"] if "objective/kl" in h]
        assert logged == list(range(1, updates + 1))
        load_and_score(os.path.join(out, "merged"), "lm", os.path.join(out, "merged"))
        load_and_score(os.path.join(out, "value_model"), "cls", os.path.join(out, "merged"))
    # the main process calibrates on the same prompts with the same seed and shares it: one number for both launches
    assert len(baselines) == 1, baselines


def test_ppo_two_processes_resume_exactly(assets, sft_runs, rm_runs, tmp_path):
    """Under 2 processes, a run resumed from its checkpoint-2 ends with the weights of the uninterrupted run: every
    process restores its own data position and RNG state (data_state.pt, data_state_rank1.pt)."""
    from safetensors.torch import load_file

    args = ppo_args(assets, sft_runs, rm_runs, episodes=64, samples_every=0, auto_baseline=False)
    straight = str(tmp_path / "straight")
    launch("ppo", [*args, "--output_dir", straight], NPROC)
    assert checkpoints(straight) == [2, 4]
    assert {"data_state.pt", "data_state_rank1.pt"} <= set(os.listdir(os.path.join(straight, "checkpoint-2")))
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    import shutil

    shutil.copytree(os.path.join(straight, "checkpoint-2"), os.path.join(resumed, "checkpoint-2"))
    launch("ppo", [*args, "--output_dir", resumed, "--resume_from_checkpoint", "true"], NPROC)
    assert metrics(resumed)["global_step"] == 4
    for name in ("adapter/adapter_model.safetensors", "value_model/model.safetensors"):
        a, b = load_file(os.path.join(straight, name)), load_file(os.path.join(resumed, name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k, float((a[k] - b[k]).abs().max()))


# -- a launch whose processes would not form one group -------------------------------------------------------------

def test_processes_without_a_process_group_refuse_to_start(assets, tmp_path):
    """A GPU config on a machine without GPUs and a recipe without use_cpu: each process would train alone and all
    would write the same files; the stage stops before writing anything."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without GPUs")
    out = tmp_path / "out"
    proc = launch("sft", ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"],
                          "--model_name_or_path", assets["base_model"], "--output_dir", str(out),
                          "--use_cpu", "false", "--report_to", "none"],
                  NPROC, config=DDP, use_cpu_env=False, check=False)
    assert proc.returncode != 0
    assert "did not join one process group" in proc.stderr
    assert not out.exists() or not os.listdir(out)


def test_a_finished_stage_destroys_its_process_group(tmp_path):
    """`run_stage` ends the process group when the stage is done: left to the interpreter's exit, gloo's threads can
    abort a rank that finished and wrote everything (exit -6), and `accelerate launch` reports the run as failed."""
    import torch.distributed as dist

    from rlhf_trl.cli_launch import end_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    end_process_group()
    assert not dist.is_initialized()
    end_process_group()  # one process, no group: nothing to do
