"""Classic PPO layouts: the value as a head on the policy's backbone (``value_head``, TRL 0.x's
AutoModelForCausalLMWithValueHead) and the pretraining / SFT loss mixed into PPO (PPO-ptx, ``ptx_dataset``)."""

import os

import pytest
import torch
from conftest import RECIPES, crash_after
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf_trl import ppo
from rlhf_trl.policy_value import VALUE_HEAD_FILE, ValueHead, load_value_head


def argv(assets, sft_run, rm_run, out, *extra):
    return ["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
            sft_run["merged"], "--reward_model_path", rm_run["merged"], "--output_dir", str(out),
            "--log_samples_every", "0", "--logging_steps", "1", *extra]


def head(folder) -> dict:
    return load_file(os.path.join(folder, VALUE_HEAD_FILE))


def test_value_head_trains_is_saved_everywhere_and_reloads(assets, sft_run, rm_run, tmp_path):
    """One backbone: no value model is loaded or written; the head moves from zero, every checkpoint, ``adapter/``
    and ``merged/`` carry it, and `load_value_head` on the merged policy gives the trainer's values."""
    res = ppo.main(argv(assets, sft_run, rm_run, tmp_path, "--value_head", "true", "--total_episodes", "64",
                        "--save_steps", "1"))
    trainer = res["trainer"]
    assert isinstance(trainer.unwrapped.value_model, ValueHead) and res["value_model"] is None
    assert sum(p.numel() for p in trainer.unwrapped.value_model.parameters()) == trainer.policy_model.config.hidden_size + 1
    assert not (tmp_path / "value_model").exists() and not (tmp_path / "checkpoint-1" / "value_model").exists()
    first, final = head(tmp_path / "checkpoint-1"), head(tmp_path / "merged")
    assert set(final) == {"v_head.summary.weight", "v_head.summary.bias"}
    assert final["v_head.summary.weight"].abs().sum() > 0  # it started at zero
    assert not torch.equal(first["v_head.summary.weight"], final["v_head.summary.weight"])
    for folder in (tmp_path / "checkpoint-1" / "merged", tmp_path / "checkpoint-2", tmp_path / "adapter"):
        assert head(folder).keys() == final.keys(), folder
    assert torch.equal(head(tmp_path / "adapter")["v_head.summary.weight"], final["v_head.summary.weight"])
    assert torch.equal(head(tmp_path / "checkpoint-2")["v_head.summary.bias"], final["v_head.summary.bias"])
    # the merged policy and its head, loaded on their own, give the trained values
    from rlhf_trl.scoring import response_values

    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    loaded = load_value_head(policy, str(tmp_path / "merged"))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        mine = response_values(loaded, ids, 4, 0)
        theirs = response_values(trainer.unwrapped.value_model, ids, 4, 0)
    assert torch.allclose(mine, theirs, atol=1e-5)
    # `rlhf-trl merge` of the adapter carries the head into the merged directory
    from rlhf_trl import merge

    merge.main(["--adapter", str(tmp_path / "adapter"), "--output", str(tmp_path / "remerged")])
    assert torch.equal(head(tmp_path / "remerged")["v_head.summary.weight"], final["v_head.summary.weight"])
    # the policy learned: its merged weights differ from the SFT model's
    sft = load_file(os.path.join(sft_run["merged"], "model.safetensors"))
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert any(not torch.equal(sft[k], merged[k]) for k in sft if k in merged)


def test_value_head_on_a_fully_trained_policy(assets, sft_run, rm_run, tmp_path):
    """Without LoRA the reference is a frozen copy; the head and every policy weight train, the reference does not."""
    res = ppo.main(argv(assets, sft_run, rm_run, tmp_path, "--value_head", "true", "--use_peft", "false",
                        "--learning_rate", "1e-4", "--total_episodes", "32", "--save_strategy", "no"))
    trainer = res["trainer"]
    sft = load_file(os.path.join(sft_run["merged"], "model.safetensors"))
    ref = trainer.ref_model.state_dict()
    assert all(torch.equal(ref[k], sft[k]) for k in sft if k in ref)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert any(not torch.equal(sft[k], merged[k]) for k in sft if k in merged)
    assert head(tmp_path / "merged")["v_head.summary.weight"].abs().sum() > 0 and not (tmp_path / "adapter").exists()


def test_value_head_runs_with_reward_functions_alone(assets, sft_run, tmp_path):
    """No reward model to start a value model from: the head needs none."""
    res = ppo.main(["--config", f"{RECIPES}/ppo.yaml", "--dataset_name", assets["prompts"], "--sft_model_path",
                    sft_run["merged"], "--reward_model_path", "", "--reward_funcs",
                    "rlhf_trl.demo_task:ground_truth_reward", "--value_head", "true", "--output_dir", str(tmp_path),
                    "--total_episodes", "32", "--save_strategy", "no", "--log_samples_every", "0"])
    assert res["trainer"].reward_model is None and (tmp_path / "merged" / VALUE_HEAD_FILE).exists()


@pytest.mark.slow  # two PPO runs
@pytest.mark.parametrize("extra", [["--value_head", "true"], ["--ptx_coef", "0.5"]], ids=["value_head", "ptx"])
def test_value_head_and_ptx_resume_bit_exact(extra, assets, sft_run, rm_run, tmp_path):
    """Straight == crash after checkpoint 2 + resume: policy and head bit for bit,
    the ptx losses of every update equal (the ptx data position and generator are in the checkpoint)."""
    if "--ptx_coef" in extra:
        extra = [*extra, "--ptx_dataset", assets["sft"]]
    common = ["--total_episodes", "128", "--save_steps", "2", *extra]
    straight = ppo.main(argv(assets, sft_run, rm_run, tmp_path / "a", *common))
    with pytest.raises(KeyboardInterrupt):
        ppo.main(argv(assets, sft_run, rm_run, tmp_path / "b", *common), callbacks=[crash_after(2)])
    resumed = ppo.main(argv(assets, sft_run, rm_run, tmp_path / "b", *common, "--resume_from_checkpoint", "true"))
    a, b = load_file(os.path.join(straight["merged"], "model.safetensors")), \
        load_file(os.path.join(resumed["merged"], "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    if "--value_head" in extra:
        assert head(straight["merged"]).keys() and all(
            torch.equal(head(straight["merged"])[k], head(resumed["merged"])[k]) for k in head(straight["merged"]))
    else:
        losses = [[h["loss/ptx_avg"] for h in r["trainer"].state.log_history if "loss/ptx_avg" in h]
                  for r in (straight, resumed)]
        assert len(losses[0]) == 4 and losses[0] == losses[1]


def ptx_loss_of(model_dir, assets) -> float:
    """The SFT loss (nats per answer token) of a saved policy on the demo's SFT rows."""
    from rlhf_trl.data import DataArguments, Template, read_records, sft_features
    from rlhf_trl.models import load_tokenizer
    from rlhf_trl.scoring import pad_right, sft_loss

    tok = load_tokenizer(model_dir)
    args = DataArguments(dataset_name=assets["sft"])
    feats = sft_features(read_records(args, "sft")[:64], tok, Template.from_args(args), 128)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return float(sft_loss(model, pad_right(feats["input_ids"], tok.pad_token_id),
                              pad_right(feats["completion_mask"], 0), tok.pad_token_id))


@pytest.mark.slow  # two PPO runs of 8 updates
def test_ptx_keeps_the_sft_loss_down(assets, sft_run, rm_run, tmp_path):
    """PPO drifts from the SFT data (its SFT loss rises); the same run with ptx ends with a lower SFT loss, and
    logs ``loss/ptx_avg`` every update."""
    common = ["--total_episodes", "256", "--save_strategy", "no"]
    plain = ppo.main(argv(assets, sft_run, rm_run, tmp_path / "plain", *common))
    mixed = ppo.main(argv(assets, sft_run, rm_run, tmp_path / "ptx", *common, "--ptx_dataset", assets["sft"],
                          "--ptx_coef", "1.0"))
    logs = [h for h in mixed["trainer"].state.log_history if "objective/kl" in h]
    assert len(logs) == 8 and all(h["loss/ptx_avg"] > 0 for h in logs)
    assert not any("loss/ptx_avg" in h for h in plain["trainer"].state.log_history)
    sft, without, with_ptx = (ptx_loss_of(d, assets) for d in (sft_run["merged"], plain["merged"], mixed["merged"]))
    assert with_ptx < without, (sft, without, with_ptx)


@pytest.mark.parametrize("extra, message", [
    (["--value_head", "true", "--value_use_peft", "true"],
     "value_head: true puts the value on the policy's backbone, so there is no separate value model for "
     "value_use_peft; remove value_use_peft (or set value_head: false)"),
    (["--value_head", "true", "--value_model_path", "x"],
     "value_head: true puts the value on the policy's backbone, so there is no separate value model for "
     "value_model_path; remove value_model_path (or set value_head: false)"),
    (["--ptx_coef", "0.1"], "ptx_coef is set without ptx_dataset: name the SFT data to mix in (ptx_dataset), or "
                            "remove ptx_coef"),
    (["--ptx_dataset", "x.jsonl", "--ptx_coef", "0"], "ptx_coef must be a positive number, got 0.0"),
], ids=["value_lora", "value_path", "coef_alone", "coef_zero"])
def test_settings_that_make_no_sense_are_refused_in_one_line(extra, message, assets, sft_run, rm_run, tmp_path,
                                                             capsys):
    from rlhf_trl.cli_launch import run_stage

    with pytest.raises(SystemExit) as exc:
        run_stage("ppo", argv(assets, sft_run, rm_run, tmp_path, *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(message), err[-1]
    assert not os.path.exists(tmp_path / "merged")


def test_resuming_with_ptx_a_run_without_is_refused(assets, sft_run, rm_run, tmp_path):
    """The checkpoint has no ptx data position: one line, nothing of the run changed."""
    common = ["--total_episodes", "64", "--save_steps", "1"]
    with pytest.raises(KeyboardInterrupt):
        ppo.main(argv(assets, sft_run, rm_run, tmp_path, *common), callbacks=[crash_after(1)])
    with pytest.raises(ValueError, match="checkpoint-1 was written without ptx_dataset; resume it without ptx_dataset"):
        ppo.main(argv(assets, sft_run, rm_run, tmp_path, *common, "--resume_from_checkpoint", "true",
                      "--ptx_dataset", assets["sft"]))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "runs"]
