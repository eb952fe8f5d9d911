"""Resume is bit-exact: a run killed right after a middle checkpoint and resumed in a fresh process ends with the
uninterrupted run's weights, optimizer and scheduler state, RNG states, data position, KL coefficient, reward
baseline, loop sums and log history (`exactness.assert_runs_equal`: ``torch.equal`` / ``==``, wall-time fields
aside), for SFT, RM and PPO (plain, LoRA value model, shared reward / value base, ``reward_baseline: auto``, and two
processes), and for TRL's DPO, GRPO, RLOO and KTO trainers as the project runs them.

The kill: ``RLHF_TRL_FAULT="<s>:1"`` (`faults`, tests/fault_hooks) SIGKILLs the run at the first file operation of its s-th
checkpoint save, so checkpoint s-1 is the newest on disk, with everything the run wrote after it (PPO's sample table
of the next update, TensorBoard events). One-process runs are forked from a `zygote.Zygote` (a fresh process
each, without the import time); the two-process runs go through ``accelerate launch``.
"""

import os
import shlex

import pytest
from exactness import assert_runs_equal, assert_same, checkpoints, comparable
from zygote import accelerate_launch, tail

pytestmark = pytest.mark.slow

ONE_PROCESS = ["sft", "rm", "ppo", "ppo_value_lora", "ppo_shared_base", "ppo_baseline_auto", "ppo_value_head",
               "ppo_ptx", "dpo", "grpo", "rloo", "kto"]
# resume from the n-th checkpoint (PPO's 2nd: the end of a pass over the prompts; 2 processes: in the second pass)
RESUME_AFTER = {"sft": 1, "rm": 2, "ppo": 1, "ppo_value_lora": 2, "ppo_shared_base": 1, "ppo_baseline_auto": 2,
                "ppo_value_head": 2, "ppo_ptx": 2, "ppo_2proc": 2, "dpo": 1, "grpo": 1, "rloo": 2, "kto": 1}


def run_and_resume(cfg, tmp_path, run) -> None:
    """Uninterrupted run, killed run, resume; then compare. ``run(argv, log, env) -> returncode``."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    log = str(tmp_path / "log.txt")
    assert run([*cfg.argv, "--output_dir", str(straight)], log, None) == 0, tail(log)
    assert checkpoints(straight) == cfg.checkpoints
    n = RESUME_AFTER[cfg.name]
    code = run([*cfg.argv, "--output_dir", str(killed)], log, {"RLHF_TRL_FAULT": f"{n + 1}:1"})
    assert code != 0, "the run was not killed"
    assert checkpoints(killed) == cfg.checkpoints[:n]
    assert run([*cfg.argv, "--output_dir", str(killed), "--resume_from_checkpoint", "true"], log, None) == 0, tail(log)
    assert_runs_equal(straight, killed)


@pytest.mark.parametrize("name", ONE_PROCESS)
def test_one_process_resume_is_bit_exact(name, configs, zygote, tmp_path):
    cfg = configs[name]

    def run(argv, log, env):
        return zygote.run(cfg.stage, argv, log, env)

    run_and_resume(cfg, tmp_path, run)


def test_two_process_ppo_resume_is_bit_exact(configs, tmp_path):
    """Under ``accelerate launch`` (2 processes, gloo): each process restores its own RNG state and data position,
    and the sampler's shared generator (accelerate gives the sampler one under several processes) is restored to
    the state it had when the interrupted pass began: checkpoint-2 lies in the second pass over the prompts."""
    cfg = configs["ppo_2proc"]

    def run(argv, log, env):
        return accelerate_launch(cfg.stage, argv, cfg.nproc, log, env)

    run_and_resume(cfg, tmp_path, run)
    assert os.path.exists(tmp_path / "killed" / "checkpoint-2" / "data_state_rank1.pt")


def test_sample_tables_do_not_change_training(configs, zygote, tmp_path):
    """PPO with a sample table every update ends with the weights, optimizer state and log history of the same run
    without sample tables. (A sample table loops over one eval batch and leaves the loop early; the loader left
    mid-iteration stayed accelerate's active loader, whose end decides when accumulated gradients are applied, so
    the update that ends a pass over the prompts stepped the optimizer differently after a sample table.)"""
    cfg = configs["ppo"]
    log = str(tmp_path / "log.txt")
    argv = [*cfg.argv]
    argv[argv.index("--log_samples_every") + 1] = "0"
    with_tables, without = tmp_path / "with", tmp_path / "without"
    assert zygote.run(cfg.stage, [*cfg.argv, "--output_dir", str(with_tables)], log) == 0, tail(log)
    assert zygote.run(cfg.stage, [*argv, "--output_dir", str(without)], log) == 0, tail(log)
    assert (with_tables / "samples.jsonl").exists() and not (without / "samples.jsonl").exists()
    last = f"checkpoint-{cfg.checkpoints[-1]}"
    for rel in ("adapter/adapter_model.safetensors", "value_model/model.safetensors", f"{last}/optimizer.pt",
                f"{last}/scheduler.pt", f"{last}/data_state.pt", f"{last}/trainer_state.json", "log_history.json"):
        assert_same(comparable(with_tables / rel), comparable(without / rel), rel)


# -- SIGTERM / SIGINT (`rlhf_trl.run_dir`): finish the step, write a checkpoint, one line, exit 143 / 130 -------------
@pytest.mark.parametrize("name,signal_name,step,code", [("sft", "SIGTERM", 4, 143), ("ppo", "SIGINT", 2, 130),
                                                         ("ppo_value_head", "SIGTERM", 1, 143),
                                                         ("ppo_ptx", "SIGTERM", 2, 143)])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resumes_bit_exact(name, signal_name, step, code, configs,
                                                                             zygote, tmp_path):
    """The run sends itself the signal at the end of step ``step`` (PPO: update): that step's checkpoint is written
    (outside the save_steps schedule), the last line on stderr says so and how to resume, the exit status is 128 +
    the signal; the resumed run ends bit-exact with the uninterrupted one."""
    cfg = configs[name]
    straight, stopped, log = tmp_path / "straight", tmp_path / "stopped", str(tmp_path / "log.txt")
    assert zygote.run(cfg.stage, [*cfg.argv, "--output_dir", str(straight)], log) == 0, tail(log)
    open(log, "w").close()
    assert zygote.run(cfg.stage, [*cfg.argv, "--output_dir", str(stopped)], log,
                      signals={"signal": signal_name, "step": step}) == code, tail(log)
    unit = "update" if cfg.stage == "ppo" else "step"
    last = tail(log).strip().splitlines()[-1]
    command = shlex.join([*cfg.argv, "--output_dir", str(stopped)])
    assert last == (f"rlhf-trl {cfg.stage}: stopped by {signal_name} at {unit} {step}: checkpoint-{step} written; "
                    f"resume with `rlhf-trl {cfg.stage} {command} --resume_from_checkpoint true`"), last
    assert checkpoints(stopped)[-1] == step and not (stopped / "merged").exists()
    assert not (stopped / ".rlhf-trl.lock").exists()  # the run ended: its lock is released
    assert zygote.run(cfg.stage, [*cfg.argv, "--output_dir", str(stopped), "--resume_from_checkpoint", "true"],
                      log) == 0, tail(log)
    assert_runs_equal(straight, stopped)


def test_a_second_signal_stops_at_once_leaving_the_last_complete_checkpoint(configs, zygote, tmp_path):
    cfg = configs["ppo"]
    out, log = tmp_path / "out", str(tmp_path / "log.txt")
    code = zygote.run(cfg.stage, [*cfg.argv, "--output_dir", str(out)], log,
                      signals={"signal": "SIGTERM", "step": 2, "again_after": 2.5})
    assert code == -15, tail(log)  # killed by the second SIGTERM: the shell reports 143
    assert checkpoints(out) == [1] and not [n for n in os.listdir(out) if n.startswith(".tmp-checkpoint")]
    assert "second SIGTERM: stopping at once" in tail(log)


def test_two_process_ppo_stopped_by_sigterm_resumes_bit_exact(configs, tmp_path):
    """``accelerate launch`` of 2 processes, SIGTERM to the whole process group (as SLURM sends it) once the first
    checkpoint exists: both processes stop after the same update (the stop is agreed by an all-reduce), its
    checkpoint is complete, and the resumed run ends bit-exact with the uninterrupted one."""
    import signal
    import subprocess
    import sys
    import time

    from zygote import REPO

    cfg = configs["ppo_2proc"]
    straight, stopped, log = tmp_path / "straight", tmp_path / "stopped", str(tmp_path / "log.txt")
    assert accelerate_launch(cfg.stage, [*cfg.argv, "--output_dir", str(straight)], 2, log) == 0, tail(log)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLHF_TRL_FAULT", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true", HF_HUB_OFFLINE="1")
    with open(log, "w") as f:
        proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch",
                                 "--config_file", str(REPO / "recipes/accelerate_configs/multi_cpu.yaml"),
                                 "--num_processes", "2", "-m", "rlhf_trl.cli", cfg.stage, *cfg.argv, "--output_dir",
                                 str(stopped)], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    deadline = time.time() + 600
    while not (stopped / "checkpoint-1").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(300)
    found = checkpoints(stopped)
    assert found and found[-1] < 3 and not (stopped / "merged").exists(), (found, tail(log))
    assert "stopped by SIGTERM at update" in tail(log)
    assert accelerate_launch(cfg.stage, [*cfg.argv, "--output_dir", str(stopped), "--resume_from_checkpoint", "true"],
                             2, log) == 0, tail(log)
    assert_runs_equal(straight, stopped)
