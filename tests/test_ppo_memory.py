"""The PPO engine's memory measures change no number: policy and value losses back-propagated one after the other
(one model's activations alive at a time) and the reward model's weights kept on disk between rollouts
(``offload_reward_model``) give bit-identical weights and logs to TRL's single joint backward with the reward model
in memory."""

import glob
import os

import pytest
import torch
from conftest import import_ppo
from safetensors.torch import load_file
from test_ppo import ppo_argv
from transformers import TrainerCallback

from rlhf_trl import ppo_engine

pytestmark = pytest.mark.slow  # whole runs of a stage (minutes on 2 cores)

COMMON = ["--total_episodes", "16", "--save_strategy", "no", "--num_ppo_epochs", "2", "--num_mini_batches", "2"]
TIMING = ("eps",)


def weights(run):
    return {name: load_file(os.path.join(run[name], "model.safetensors")) for name in ("merged", "value_model")}


def assert_same_run(a, b):
    wa, wb = weights(a), weights(b)
    for name in wa:
        assert wa[name].keys() == wb[name].keys()
        for k in wa[name]:
            assert torch.equal(wa[name][k], wb[name][k]), (name, k)
    logs = [[{k: v for k, v in h.items() if k not in TIMING} for h in r["trainer"].state.log_history] for r in (a, b)]
    assert logs[0] == logs[1]


@pytest.fixture(scope="module")
def default_run(assets, sft_run, rm_run, tmp_path_factory):
    return import_ppo().main(ppo_argv(assets, sft_run, rm_run, tmp_path_factory.mktemp("ppo_default"), *COMMON))


def test_split_backward_equals_the_joint_backward(assets, sft_run, rm_run, tmp_path, default_run, monkeypatch):
    assert default_run["trainer"].split_backward  # one process: the split path is the default
    init = ppo_engine.PPOEngine.__init__

    def joint(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.split_backward = False  # TRL's pg_loss + vf_coef * vf_loss through one backward

    monkeypatch.setattr(ppo_engine.PPOEngine, "__init__", joint)
    run = import_ppo().main(ppo_argv(assets, sft_run, rm_run, tmp_path, *COMMON))
    assert not run["trainer"].split_backward
    assert_same_run(default_run, run)


class SeesOffloadedRewardModel(TrainerCallback):
    """Records, after each update, how many reward-model weights are in memory and which offload files exist."""

    def __init__(self):
        self.trainer, self.seen = None, []

    def on_step_end(self, args, state, control, **kwargs):
        numel = sum(p.numel() for p in self.trainer.reward_model.parameters())
        self.seen.append((numel, sorted(os.path.basename(p) for p in glob.glob(f"{args.output_dir}/.tmp-offload-*"))))


def test_offloaded_reward_model_changes_nothing(assets, sft_run, rm_run, tmp_path, default_run, monkeypatch):
    seen = SeesOffloadedRewardModel()
    init = ppo_engine.PPOEngine.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.trainer = self

    monkeypatch.setattr(ppo_engine.PPOEngine, "__init__", remember)
    run = import_ppo().main(ppo_argv(assets, sft_run, rm_run, tmp_path, *COMMON, "--offload_reward_model", "true",
                                     "--num_sample_generations", "2"), callbacks=[seen])
    assert seen.seen == [(0, [".tmp-offload-reward-model-0.safetensors"])] * 2  # on disk between uses
    assert not glob.glob(f"{tmp_path}/.tmp-offload-*")  # removed at the end
    assert sum(p.numel() for p in run["trainer"].reward_model.parameters()) > 0  # an ordinary module again
    assert_same_run(default_run, run)


def test_offload_is_refused_for_a_reward_model_shared_with_the_value_model(assets, sft_run, rm_run, tmp_path):
    with pytest.raises(ValueError, match=r"^offload_reward_model: the reward model shares weights with the value "
                                         r"model \(share_reward_value_base\); set `offload_reward_model: false`$"):
        import_ppo().main(ppo_argv(assets, sft_run, rm_run, tmp_path, *COMMON, "--offload_reward_model", "true",
                                   "--value_use_peft", "true", "--share_reward_value_base", "true"))
    assert not glob.glob(f"{tmp_path}/.tmp-offload-*")
