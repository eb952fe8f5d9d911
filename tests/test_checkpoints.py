"""`rlhf_trl.checkpoints` on hand-made files: `checkpoint_problem` finds what damages a ``checkpoint-N`` (truncated,
missing, overwritten or grown files, with or without its manifest, sharded and DeepSpeed layouts); `resolve_resume`
takes the newest intact checkpoint and says which it skipped; `set_aside_damaged` moves only newer damaged ones; an
earlier run set aside by ``overwrite_output_dir`` comes back byte-identical or is dropped; `complete_checkpoints`
orders by step; `save_final_model` under sharded (ZeRO-3) weights saves through the trainer's gather and merges a
LoRA model from its saved adapter.

The same damage through the stages' ``resume_from_checkpoint`` is in test_damaged_checkpoints.py; SIGKILL at every
file operation of a save in test_fault_injection.py; a full disk in test_write_failures.py."""

import json
import logging
import os

import pytest
import torch
from conftest import make_checkpoint, tree_hashes, truncate

from rlhf_trl.checkpoints import (
    EARLIER_RUN,
    MANIFEST,
    checkpoint_problem,
    checkpoint_step,
    complete_checkpoints,
    drop_earlier_run,
    resolve_resume,
    restore_earlier_run,
    set_aside_damaged,
    set_earlier_run_aside,
)
from rlhf_trl.models import StageInputError


# ----------------------------------------------------------------------------------------------------------------
# checkpoint_problem on hand-made checkpoints
# ----------------------------------------------------------------------------------------------------------------
def test_manifest_lists_every_file_with_its_size(tmp_path):
    ckpt = make_checkpoint(tmp_path / "checkpoint-2", value_model=True)
    files = json.load(open(os.path.join(ckpt, MANIFEST)))["files"]
    assert set(files) == {"trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors",
                          "value_model/model.safetensors", "value_model/config.json"}
    assert files["optimizer.pt"] == os.path.getsize(os.path.join(ckpt, "optimizer.pt"))
    assert checkpoint_problem(ckpt) is None


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_intact_checkpoint_has_no_problem(tmp_path, manifest):
    assert checkpoint_problem(make_checkpoint(tmp_path / "checkpoint-2", manifest=manifest)) is None


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_truncated_safetensors(tmp_path, manifest):
    ckpt = make_checkpoint(tmp_path / "c", manifest=manifest)
    full = truncate(os.path.join(ckpt, "model.safetensors"))
    assert checkpoint_problem(ckpt) == f"model.safetensors is truncated ({full // 2} of {full} bytes)"


def test_truncated_safetensors_inside_its_header(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    with open(os.path.join(ckpt, "model.safetensors"), "r+b") as f:
        f.truncate(20)
    assert checkpoint_problem(ckpt).startswith("model.safetensors is truncated (20 bytes")


@pytest.mark.parametrize("manifest, name, added, says", [
    (False, "model.safetensors", 10, "its header describes"),  # no manifest: the safetensors header gives the size
    (True, "scheduler.pt", 1, f"{MANIFEST} lists"),  # a file grown after the manifest was written
], ids=["safetensors-header", "manifest"])
def test_file_with_bytes_added(tmp_path, manifest, name, added, says):
    ckpt = make_checkpoint(tmp_path / "c", manifest=manifest)
    path = os.path.join(ckpt, name)
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0" * added)
    assert checkpoint_problem(ckpt) == f"{name} has {size + added} bytes, {says} {size}"


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "trainer_state.json"])
def test_missing_file(tmp_path, manifest, name):
    ckpt = make_checkpoint(tmp_path / "c", manifest=manifest)
    os.remove(os.path.join(ckpt, name))
    assert checkpoint_problem(ckpt) == f"{name} is missing"


def test_missing_weights_without_manifest(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    os.remove(os.path.join(ckpt, "model.safetensors"))
    assert checkpoint_problem(ckpt).startswith("model weights are missing")


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("garbage", [b"not json {", b"\xff\xfe\x00garbage", b""], ids=["text", "binary", "empty"])
def test_unreadable_state_file(tmp_path, manifest, garbage):
    ckpt = make_checkpoint(tmp_path / "c", manifest=manifest)
    with open(os.path.join(ckpt, "trainer_state.json"), "wb") as f:
        f.write(garbage)
    assert checkpoint_problem(ckpt).startswith("trainer_state.json cannot be read: ")


def test_truncated_torch_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=True)
    full = truncate(os.path.join(ckpt, "optimizer.pt"))
    assert checkpoint_problem(ckpt) == f"optimizer.pt is truncated ({full // 2} of {full} bytes)"
    os.remove(os.path.join(ckpt, MANIFEST))  # an older run's checkpoint: the zip archive is incomplete
    assert checkpoint_problem(ckpt).startswith("optimizer.pt cannot be read: incomplete zip archive")


def test_torch_file_overwritten(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    with open(os.path.join(ckpt, "rng_state.pth"), "wb") as f:
        f.write(b"nonsense")
    assert checkpoint_problem(ckpt) == "rng_state.pth cannot be read: not a torch file (no zip archive)"
    open(os.path.join(ckpt, "rng_state.pth"), "wb").close()
    assert checkpoint_problem(ckpt) == "rng_state.pth is empty"


def test_same_size_garbage_in_a_torch_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=True)
    path = os.path.join(ckpt, "optimizer.pt")
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(b"x" * size)
    assert checkpoint_problem(ckpt).startswith("optimizer.pt cannot be read")


def test_nested_files_are_checked(tmp_path):
    """PPO's value_model/ (and merged/): listed in the manifest and checked like the top-level files."""
    ckpt = make_checkpoint(tmp_path / "c", value_model=True)
    full = truncate(os.path.join(ckpt, "value_model", "model.safetensors"))
    assert checkpoint_problem(ckpt) == f"value_model/model.safetensors is truncated ({full // 2} of {full} bytes)"
    os.remove(os.path.join(ckpt, "value_model", "model.safetensors"))
    assert checkpoint_problem(ckpt) == "value_model/model.safetensors is missing"


def test_unreadable_manifest(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c")
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        f.write('{"files": ')
    assert checkpoint_problem(ckpt).startswith(f"{MANIFEST} cannot be read: ")
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        f.write('{"files": ["optimizer.pt"]}')
    assert checkpoint_problem(ckpt).startswith(f"{MANIFEST} cannot be read: ")


def test_sharded_weights_index_names_a_missing_shard(tmp_path):
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    os.rename(os.path.join(ckpt, "model.safetensors"), os.path.join(ckpt, "model-00001-of-00002.safetensors"))
    with open(os.path.join(ckpt, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}, f)
    assert checkpoint_problem(ckpt) == ("model-00002-of-00002.safetensors is missing (listed in "
                                        "model.safetensors.index.json)")


def test_deepspeed_checkpoint_without_manifest(tmp_path):
    """DeepSpeed keeps optimizer (and, under ZeRO-3, weights) in global_step*/, not optimizer.pt / model files."""
    ckpt = make_checkpoint(tmp_path / "c", manifest=False)
    for name in ("optimizer.pt", "scheduler.pt", "model.safetensors"):
        os.remove(os.path.join(ckpt, name))
    os.makedirs(os.path.join(ckpt, "global_step2"))
    states = os.path.join(ckpt, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": {}}, states)
    assert checkpoint_problem(ckpt) is None
    truncate(states)
    assert checkpoint_problem(ckpt).startswith("global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt cannot be read")


# ----------------------------------------------------------------------------------------------------------------
# resolve_resume and set_aside_damaged on hand-made checkpoints
# ----------------------------------------------------------------------------------------------------------------
def test_resume_true_takes_the_newest_intact_checkpoint_and_says_so(tmp_path, caplog):
    for step in (10, 20, 30, 40):
        make_checkpoint(tmp_path / f"checkpoint-{step}")
    os.remove(tmp_path / "checkpoint-40" / "optimizer.pt")
    (tmp_path / "checkpoint-30" / "trainer_state.json").write_text("garbage")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl"):
        assert resolve_resume("true", str(tmp_path)) == str(tmp_path / "checkpoint-20")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == "checkpoint-40 is damaged (optimizer.pt is missing); resuming from checkpoint-20"
    assert warnings[1].startswith("checkpoint-30 is damaged (trainer_state.json cannot be read: ")
    assert warnings[1].endswith("); resuming from checkpoint-20") and len(warnings) == 2
    caplog.clear()
    make_checkpoint(tmp_path / "checkpoint-50")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl"):  # the newest is intact: no warning
        assert resolve_resume("last", str(tmp_path)) == str(tmp_path / "checkpoint-50")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_resume_true_with_every_checkpoint_damaged_fails_in_one_line(tmp_path):
    for step in (2, 4):
        make_checkpoint(tmp_path / f"checkpoint-{step}")
    truncate(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    os.remove(tmp_path / "checkpoint-4" / "optimizer.pt")
    before = tree_hashes(tmp_path)
    with pytest.raises(StageInputError) as exc:
        resolve_resume("true", str(tmp_path))
    assert str(exc.value).startswith(f"resume_from_checkpoint=true: no intact checkpoint in '{tmp_path}' (newest "
                                     "checkpoint-4: optimizer.pt is missing)")
    assert "\n" not in str(exc.value)
    assert tree_hashes(tmp_path) == before


def test_resume_from_a_damaged_path_fails_naming_it(tmp_path):
    ckpt = make_checkpoint(tmp_path / "checkpoint-4")
    truncate(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(StageInputError, match=r"checkpoint '.*checkpoint-4' is damaged \(model.safetensors is "
                                              r"truncated \(\d+ of \d+ bytes\)\)"):
        resolve_resume(ckpt, str(tmp_path))


def test_set_aside_moves_only_newer_damaged_checkpoints(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path / f"checkpoint-{step}")
    os.remove(tmp_path / "checkpoint-1" / "optimizer.pt")  # older than the resume point: left alone
    os.remove(tmp_path / "checkpoint-4" / "optimizer.pt")
    with caplog.at_level(logging.WARNING, logger="rlhf_trl"):
        moved = set_aside_damaged(str(tmp_path), str(tmp_path / "checkpoint-2"))
    assert moved == [str(tmp_path / "damaged-checkpoint-4")]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "damaged-checkpoint-4"]
    assert "moved the damaged checkpoint-4 (optimizer.pt is missing) aside to damaged-checkpoint-4" in caplog.text


def test_resume_values_that_mean_no_resume_and_missing_checkpoints(tmp_path):
    for value in (None, "", "false", "No", "0", "none"):
        assert resolve_resume(value, str(tmp_path)) is None
    with pytest.raises(StageInputError, match=r"resume_from_checkpoint=true, but '.*' holds no checkpoint-N directory"):
        resolve_resume("true", str(tmp_path))
    with pytest.raises(StageInputError, match=r"checkpoint '.*checkpoint-7' not found"):
        resolve_resume(str(tmp_path / "checkpoint-7"), str(tmp_path))


def test_complete_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-100", "damaged-checkpoint-3", "checkpoint-x",
                 ".tmp-checkpoint-11"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-5").write_text("a file, not a checkpoint")
    assert complete_checkpoints(str(tmp_path)) == [str(tmp_path / f"checkpoint-{n}") for n in (9, 10, 100)]
    assert checkpoint_step(str(tmp_path / "checkpoint-12") + "/") == 12
    assert [checkpoint_step(n) for n in ("damaged-checkpoint-3", "checkpoint-x", ".tmp-checkpoint-11")] == [None] * 3


# ----------------------------------------------------------------------------------------------------------------
# an earlier run set aside by overwrite_output_dir
# ----------------------------------------------------------------------------------------------------------------
def earlier_run(out):
    """A finished run's directory: two checkpoints, merged weights, the recipe, TensorBoard events, and a file of the
    user's that is not the run's."""
    make_checkpoint(out / "checkpoint-2")
    make_checkpoint(out / "checkpoint-4")
    (out / "merged").mkdir()
    (out / "merged" / "model.safetensors").write_bytes(b"weights")
    (out / "run_config.yaml").write_text("learning_rate: 1.0e-05\n")
    (out / "runs").mkdir()
    (out / "runs" / "events.old").write_text("old")
    (out / "notes.txt").write_text("mine")
    return out


def test_an_earlier_run_set_aside_comes_back_byte_identical(tmp_path, caplog):
    out = earlier_run(tmp_path / "out")
    before = tree_hashes(out)
    set_earlier_run_aside(str(out))
    assert sorted(os.listdir(out)) == [EARLIER_RUN, "notes.txt"]  # only the run's files are set aside
    (out / "runs").mkdir()  # what the new run wrote before it failed
    (out / "runs" / "events.new").write_text("new")
    (out / ".tmp-checkpoint-1").mkdir()
    with caplog.at_level(logging.WARNING, logger="rlhf_trl"):
        restore_earlier_run(str(out))
    assert tree_hashes(out) == before
    assert "put back the earlier run" in caplog.text
    restore_earlier_run(str(out))  # repeatable: nothing set aside, nothing changed
    assert tree_hashes(out) == before


def test_a_dropped_earlier_run_leaves_the_new_run_and_the_users_files(tmp_path):
    out = earlier_run(tmp_path / "out")
    set_earlier_run_aside(str(out))
    make_checkpoint(out / "checkpoint-1")
    drop_earlier_run(str(out))
    assert sorted(os.listdir(out)) == ["checkpoint-1", "notes.txt"]


def test_nothing_is_set_aside_without_an_earlier_run(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    set_earlier_run_aside(str(tmp_path))
    assert os.listdir(tmp_path) == ["notes.txt"]


# ----------------------------------------------------------------------------------------------------------------
# save_final_model under sharded weights (DeepSpeed ZeRO-3), on one process
# ----------------------------------------------------------------------------------------------------------------
class _FakeShardedTrainer:
    """What `save_final_model` uses of a trainer whose weights are sharded (DeepSpeed ZeRO-3), on one process."""

    def __init__(self, model):
        from types import SimpleNamespace

        self.model = model
        self.accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)),
                                           wait_for_everyone=lambda: None)
        self.saved_to = []

    def is_world_process_zero(self):
        return True

    def save_model(self, path):  # the real one gathers the 16-bit weights from every process first
        self.saved_to.append(path)
        self.model.save_pretrained(path)


def test_sharded_full_model_is_saved_through_the_trainer_gather(sft_run, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf_trl.checkpoints import save_final_model, weights_are_sharded

    model = AutoModelForCausalLM.from_pretrained(sft_run["merged"])
    trainer = _FakeShardedTrainer(model)
    assert weights_are_sharded(trainer)
    out = tmp_path / "merged"
    back = save_final_model(trainer, tokenizer, str(out), None, sft_run["merged"], "causal_lm")
    assert trainer.saved_to and trainer.saved_to[0] != str(out)  # staged, then renamed into place
    assert sorted(os.listdir(tmp_path)) == ["merged"] and (out / "tokenizer_config.json").exists()
    for a, b in zip(model.parameters(), back.parameters()):
        assert torch.equal(a, b)


def test_sharded_lora_model_is_merged_from_the_saved_adapter(sft_run, rm_run, tmp_path, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from rlhf_trl.checkpoints import save_final_model

    trainer = _FakeShardedTrainer(model=None)  # sharded LoRA: only the adapter on disk is used
    out = tmp_path / "merged"
    back = save_final_model(trainer, tokenizer, str(out), os.path.join(rm_run["output_dir"], "adapter"),
                            sft_run["merged"], "sequence_classifier")
    expected = AutoModelForSequenceClassification.from_pretrained(rm_run["merged"])
    for (name, a), b in zip(expected.named_parameters(), back.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
