"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU (DeepSpeed over gloo, fp32): SFT, RM and PPO each run with 2 processes under the
shipped ``zero2`` and ``zero3`` accelerate configs, as ``make <stage> ACCEL=zero3 NPROC=2`` runs them, with the
arguments of the 2-process DDP runs of tests/test_multiprocess.py (session fixtures), and are compared with them:

- the same output files (less DeepSpeed's own checkpoint files: ``global_stepN/`` shards, ``latest``,
  ``zero_to_fp32.py`` instead of ``optimizer.pt``), the same step counts and checkpoints, models that load with plain
  transformers;
- training agrees with DDP: SFT / RM per-step losses within 1e-4 (relative) over the whole run, PPO's first update
  within 1e-4. Why not bit-equal: ZeRO reduces gradients with a reduce-scatter into partitions (ZeRO-3 also gathers
  parameters layer by layer), DDP with an all-reduce over buckets: the same sums in another order, fp32 rounding of
  ~1e-7 per step. PPO's first rollout is sampled from identical weights, so its metrics agree to rounding; later
  rollouts may sample other tokens after rounding-level weight differences, so only update 1 is compared;
- under ZeRO-3 the final ``merged/`` (full-parameter SFT) and ``adapter/`` (LoRA RM) equal, tensor for tensor, the
  weights DeepSpeed's own ``zero_to_fp32`` consolidates from the last checkpoint's shards (saved at the last step);
- a ZeRO-3 PPO run SIGKILLed while writing its second checkpoint and resumed ends with the weights of the straight
  run, bit-exact (every process reloads its own optimizer partition, data position and RNG state); a ZeRO shard cut
  short is refused in one line, as any damaged checkpoint is;
- refused in one line before anything is written: a mixed-precision clash between the accelerate config and the
  recipe (the recipe decides precision), and FSDP on a machine without GPUs.

About 8 minutes on 2 CPU cores (on top of the DDP runs). Needs DeepSpeed (``make install`` installs it).
"""

import json
import os
import re

import pytest
import torch
from test_multiprocess import (NPROC, PER_DEVICE, GRAD_ACCUM, PPO_EPISODES, RECIPES, REPO, checkpoints, file_set,
                               launch, load_and_score, metrics, ppo_args, rm_args, sft_args)

pytestmark = pytest.mark.slow
deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (make install installs it)")

CONFIGS = {name: os.path.join(REPO, "recipes", "accelerate_configs", f"{name}.yaml") for name in
           ("zero2", "zero3", "fsdp")}
ZERO = ("zero2", "zero3")
DEEPSPEED_OWN = re.compile(r"(^|/)(global_step\d+|latest|zero_to_fp32\.py|zero_to_torch\.py|optimizer\.pt)($|/)")


def run(stage: str, config: str, out: str, args: list[str], **kw):
    """``rlhf-trl <stage> ARGS --output_dir OUT`` with 2 processes under a shipped DeepSpeed config."""
    return launch(stage, [*args, "--output_dir", out], NPROC, config=CONFIGS[config], use_cpu_env=False, **kw)


def comparable(root: str) -> set[str]:
    """`file_set` less the files only DeepSpeed or only DDP writes into a checkpoint (optimizer state), and the model
    card ``merged/README.md`` (under ZeRO-3 a LoRA stage merges through ``rlhf-trl merge``'s path, which writes one)."""
    return {p for p in file_set(root) if not DEEPSPEED_OWN.search(p) and p != "merged/README.md"}


def losses(out: str) -> list[float]:
    return [h["loss"] for h in json.load(open(os.path.join(out, "log_history.json")))["log_history"] if "loss" in h]


def first_update(out: str) -> dict:
    return next(h for h in json.load(open(os.path.join(out, "log_history.json")))["log_history"] if h.get("step") == 1)


def assert_equal_tensors(saved: dict, reference: dict) -> None:
    assert saved.keys() == reference.keys(), sorted(set(saved) ^ set(reference))[:5]
    for k in saved:
        ref = reference[k].to(saved[k].dtype)
        assert torch.equal(saved[k], ref), (k, float((saved[k] - ref).abs().max()))


def assert_zero_checkpoints(out: str) -> None:
    """Each checkpoint holds DeepSpeed's shards of both processes for its own step, listed in its manifest."""
    from rlhf_trl.checkpoints import MANIFEST, checkpoint_problem

    for step in checkpoints(out):
        ckpt = os.path.join(out, f"checkpoint-{step}")
        assert open(os.path.join(ckpt, "latest")).read().strip() == f"global_step{step}"
        shards = sorted(os.listdir(os.path.join(ckpt, f"global_step{step}")))
        assert [s for s in shards if s.endswith("optim_states.pt")] == [
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(NPROC)]
        listed = json.load(open(os.path.join(ckpt, MANIFEST)))["files"]
        assert {f"global_step{step}/{s}" for s in shards} <= set(listed)
        assert checkpoint_problem(ckpt) is None


@pytest.fixture(scope="module")
def zero_runs(assets, sft_runs, rm_runs, ppo_runs, tmp_path_factory):
    """``get(stage, config) -> output dir``: each ZeRO run made once, when a test first asks for it."""
    def ppo() -> list[str]:  # the number DDP's `reward_baseline auto` found ('auto' cannot run under ZeRO-3)
        args = ppo_args(assets, sft_runs, rm_runs)
        args[args.index("--reward_baseline") + 1] = repr(metrics(ppo_runs[NPROC][0])["reward_baseline"])
        return args

    args = {"sft": lambda: sft_args(assets), "rm": lambda: rm_args(assets, sft_runs), "ppo": ppo}
    done = {}

    def get(stage: str, config: str) -> str:
        if (stage, config) not in done:
            out = str(tmp_path_factory.mktemp(f"{stage}_{config}"))
            run(stage, config, out, args[stage]())
            done[stage, config] = out
        return done[stage, config]

    return get


@pytest.mark.parametrize("stage", ["sft", "rm"])
@pytest.mark.parametrize("config", ZERO)
def test_zero_trains_as_ddp_does(stage, config, zero_runs, sft_runs, rm_runs):
    ddp = (sft_runs if stage == "sft" else rm_runs)[NPROC][0]
    out = zero_runs(stage, config)
    assert comparable(out) == comparable(ddp), sorted(comparable(out) ^ comparable(ddp))
    assert metrics(out)["global_step"] == metrics(ddp)["global_step"] and checkpoints(out) == checkpoints(ddp)
    assert_zero_checkpoints(out)
    ours, theirs = losses(out), losses(ddp)
    assert len(ours) == len(theirs) == metrics(ddp)["global_step"]
    assert ours == pytest.approx(theirs, rel=1e-4)
    if stage == "rm":
        ours, theirs = (json.load(open(os.path.join(o, "eval_metrics.json"))) for o in (out, ddp))
        assert ours["num_pairs"] == theirs["num_pairs"] and ours["accuracy"] == pytest.approx(theirs["accuracy"])
    load_and_score(os.path.join(out, "merged"), "lm" if stage == "sft" else "cls", os.path.join(out, "merged"))


def consolidated(checkpoint: str) -> dict:
    """DeepSpeed's own consolidation of a checkpoint's ZeRO shards (fp32; the trainable weights for LoRA)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(checkpoint)


def test_zero3_final_models_are_the_gathered_shards(zero_runs):
    from safetensors.torch import load_file

    out = zero_runs("sft", "zero3")
    merged = load_file(os.path.join(out, "merged", "model.safetensors"))
    gathered = consolidated(os.path.join(out, f"checkpoint-{checkpoints(out)[-1]}"))
    tied = set(gathered) - set(merged)  # lm_head tied to embed_tokens: saved once
    assert tied <= {"lm_head.weight"}
    assert_equal_tensors(merged, {k: v for k, v in gathered.items() if k not in tied})

    out = zero_runs("rm", "zero3")
    adapter = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    gathered = consolidated(os.path.join(out, f"checkpoint-{checkpoints(out)[-1]}"))
    trained = {re.sub(r"\.(default\.|modules_to_save\.default\.)", ".", k): v for k, v in gathered.items()
               if "lora_" in k or "modules_to_save" in k}
    assert_equal_tensors(adapter, trained)
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    base = AutoModelForSequenceClassification.from_pretrained(json.load(open(os.path.join(
        out, "adapter", "adapter_config.json")))["base_model_name_or_path"], num_labels=1)
    assert PeftModel.from_pretrained(base, os.path.join(out, "adapter")) is not None


@pytest.mark.parametrize("config", ZERO)
def test_ppo_under_zero_matches_ddp(config, zero_runs, ppo_runs):
    ddp = ppo_runs[NPROC][0]
    out = zero_runs("ppo", config)
    assert comparable(out) == comparable(ddp), sorted(comparable(out) ^ comparable(ddp))
    updates = PPO_EPISODES // (PER_DEVICE * NPROC * GRAD_ACCUM)
    assert metrics(out)["global_step"] == metrics(ddp)["global_step"] == updates
    assert checkpoints(out) == checkpoints(ddp)
    assert_zero_checkpoints(out)
    assert metrics(out)["reward_baseline"] == metrics(ddp)["reward_baseline"]
    ours, theirs = first_update(out), first_update(ddp)
    for key in ("objective/scores", "objective/kl", "objective/entropy", "loss/policy_avg", "loss/value_avg",
                "policy/approxkl_avg", "val/clipfrac_avg"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    load_and_score(os.path.join(out, "merged"), "lm", os.path.join(out, "merged"))
    load_and_score(os.path.join(out, "value_model"), "cls", os.path.join(out, "merged"))


def test_zero3_ppo_killed_in_a_checkpoint_resumes_exactly(assets, sft_runs, rm_runs, tmp_path):
    from safetensors.torch import load_file

    # 4 updates, checkpoints 2 and 4
    args = ppo_args(assets, sft_runs, rm_runs, episodes=64, samples_every=0, auto_baseline=False)
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    run("ppo", "zero3", straight, args)
    # rank 0 is SIGKILLed at the first file operation of its second checkpoint save (checkpoint-4)
    proc = run("ppo", "zero3", killed, args, check=False, env={"RLHF_TRL_FAULT": "2:1:kill"})
    assert proc.returncode != 0 and checkpoints(killed) == [2] and not os.path.exists(os.path.join(killed, "merged"))
    run("ppo", "zero3", killed, [*args, "--resume_from_checkpoint", "true"])
    assert metrics(killed)["global_step"] == 4 and checkpoints(killed) == [2, 4]
    for name in ("adapter/adapter_model.safetensors", "value_model/model.safetensors", "merged/model.safetensors"):
        assert_equal_tensors(load_file(os.path.join(killed, name)), load_file(os.path.join(straight, name)))

    # a ZeRO optimizer shard cut short: the resume is refused in one line naming the checkpoint and the file
    ckpt = os.path.join(straight, "checkpoint-4")
    tag = open(os.path.join(ckpt, "latest")).read().strip()  # DeepSpeed's step count: optimizer steps, not updates
    shard = os.path.join(ckpt, tag, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.truncate(shard, os.path.getsize(shard) // 2)
    proc = run("ppo", "zero3", straight, [*args, "--resume_from_checkpoint", os.path.join(straight, "checkpoint-4")],
               check=False)
    assert proc.returncode != 0
    line = (rf"resume_from_checkpoint: checkpoint '.*checkpoint-4' is damaged \({tag}/"
            r"zero_pp_rank_1_mp_rank_00_optim_states\.pt is truncated \(\d+ of \d+ bytes\)\)")
    assert re.search(line, proc.stderr), proc.stderr[-3000:]
    assert os.path.exists(os.path.join(straight, "merged", "model.safetensors"))  # the earlier run is intact


def test_zero3_value_head_and_ptx_killed_and_resumed_end_exactly(assets, sft_runs, rm_runs, tmp_path):
    """The seeds' layout and PPO-ptx under ZeRO-3: the value head's tensors are sharded with the policy's, gathered
    into ``value_head.safetensors``; a run SIGKILLed in its second checkpoint and resumed ends with the straight run's
    adapter, merged policy and head, bit for bit (each process's ptx data position is in its data state)."""
    from safetensors.torch import load_file

    args = [*ppo_args(assets, sft_runs, rm_runs, episodes=64, samples_every=0, auto_baseline=False),
            "--value_head", "true", "--ptx_dataset", assets["sft"], "--ptx_coef", "0.1"]
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    run("ppo", "zero3", straight, args)
    proc = run("ppo", "zero3", killed, args, check=False, env={"RLHF_TRL_FAULT": "2:1:kill"})
    assert proc.returncode != 0 and checkpoints(killed) == [2]
    run("ppo", "zero3", killed, [*args, "--resume_from_checkpoint", "true"])
    assert not os.path.exists(os.path.join(straight, "value_model"))
    head = load_file(os.path.join(straight, "merged", "value_head.safetensors"))
    assert head["v_head.summary.weight"].shape[0] == 1 and head["v_head.summary.weight"].abs().sum() > 0
    for name in ("adapter/adapter_model.safetensors", "merged/value_head.safetensors", "merged/model.safetensors",
                 "checkpoint-4/value_head.safetensors"):
        assert_equal_tensors(load_file(os.path.join(killed, name)), load_file(os.path.join(straight, name)))
    logs = json.load(open(os.path.join(straight, "log_history.json")))["log_history"]
    assert [h["loss/ptx_avg"] > 0 for h in logs if "objective/kl" in h] == [True] * 4
    # DeepSpeed's own count of optimizer steps: one per update (1 epoch x 1 mini-batch), also in the updates that end
    # a pass over the 64 prompts (TRL 1.12 stepped once per micro-batch there)
    for step in (2, 4):
        assert open(os.path.join(killed, f"checkpoint-{step}", "latest")).read().strip() == f"global_step{step}"


@pytest.mark.parametrize("stage", ["dpo", "grpo", "kto"])
def test_trl_stage3_trainers_under_zero3(stage, assets, sft_runs, rm_runs, tmp_path):
    """DPO, GRPO and KTO (TRL's trainers) under ZeRO-3, 2 processes: they train (the merged policy differs from the SFT
    model), checkpoint with DeepSpeed's shards and end with a policy that loads. (Not compared with DDP here.)"""
    from safetensors.torch import load_file

    sft = os.path.join(sft_runs[1][0], "merged")
    common = ["--model_name_or_path", sft, "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1",
              "--logging_steps", "1", "--report_to", "none", "--overwrite_output_dir", "true"]
    if stage in ("dpo", "kto"):  # KTO: 12 ranked lists -> 72 labelled examples; 2 a process (its KL term needs > 1)
        args = ["--config", f"{RECIPES}/{stage}.yaml", "--dataset_name", assets["rm"], "--max_samples", "12",
                "--eval_split_size", "4", "--per_device_train_batch_size", "2", *common]
    else:  # 4 completions per process and step: 2 prompts x 4 generations over both processes
        args = ["--config", f"{RECIPES}/grpo.yaml", "--dataset_name", assets["prompts"], "--reward_model_path",
                os.path.join(rm_runs[1][0], "merged"), "--max_samples", "16", "--eval_split_size", "4",
                "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
                *common]
    out = str(tmp_path / stage)
    run(stage, "zero3", out, args)
    assert metrics(out)["global_step"] == 2 and checkpoints(out) == [1, 2]
    assert_zero_checkpoints(out)
    before, after = (load_file(os.path.join(d, "model.safetensors")) for d in (sft, os.path.join(out, "merged")))
    assert any(not torch.equal(before[k], after[k]) for k in after)
    load_and_score(os.path.join(out, "merged"), "lm", os.path.join(out, "merged"))


def test_reward_baseline_auto_under_zero3_is_one_line(assets, sft_runs, rm_runs, tmp_path):
    out = tmp_path / "out"
    proc = run("ppo", "zero3", str(out), ppo_args(assets, sft_runs, rm_runs), check=False)
    assert proc.returncode != 0 and not out.exists()
    assert ("reward_baseline: 'auto' cannot run under DeepSpeed ZeRO-3 (one process would "
            "sample from weights sharded over all of them); set a number") in proc.stderr


def sft_under(config: str, assets, out):
    """The demo SFT recipe under ``accelerate launch`` with ``config``, 2 processes, as ``make sft ACCEL=...`` runs it."""
    return launch("sft", ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
                          assets["base_model"], "--output_dir", str(out)], NPROC, config=config, use_cpu_env=False,
                  check=False)


def test_mixed_precision_clash_is_one_line_before_anything_is_written(assets, tmp_path):
    config = tmp_path / "zero2_bf16.yaml"
    config.write_text(open(CONFIGS["zero2"]).read().replace("mixed_precision: 'no'", "mixed_precision: bf16"))
    out = tmp_path / "out"
    proc = sft_under(str(config), assets, out)
    assert proc.returncode != 0 and not out.exists()
    assert (f"{RECIPES}/sft.yaml: bf16: false, fp16: false, but the accelerate config says "
            "mixed_precision: bf16; the recipe decides precision") in proc.stderr


def test_fsdp_without_gpus_stops_in_one_line(assets, tmp_path):
    if torch.accelerator.is_available():
        pytest.skip("needs a machine without GPUs")
    out = tmp_path / "out"
    proc = sft_under(CONFIGS["fsdp"], assets, out)
    assert proc.returncode != 0 and not out.exists()
    assert ("ACCEL=fsdp: accelerate runs FSDP only on GPUs and this machine has none (it would "
            "run DDP instead); use ACCEL=zero3 (DeepSpeed ZeRO-3) or ACCEL=multi_cpu here") in proc.stderr
