"""Tokenizer pad handling, stage-input checks, and the quantization (QLoRA) plumbing of the model loaders
(`rlhf_trl.models`). Saving sharded final models: test_checkpoints.py; a PEFT reward model's scores: test_scoring.py."""

import os

import pytest
import torch
from conftest import REPO, reward_stand_in

from rlhf_trl import models
from rlhf_trl.models import StageInputError, load_tokenizer, require_model_dir
from rlhf_trl.atomic import atomic_dir


def test_pad_equal_to_eos_is_replaced(tokenizer, tmp_path):
    """Qwen base tokenizers use one token for pad and EOS; PPO needs them distinct."""
    tokenizer.save_pretrained(tmp_path)
    import json

    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pad_token"] = cfg["eos_token"]
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert tok.pad_token == "<|pad|>"  # an existing special token of the vocabulary, no resize needed
    assert len(tok) == len(tokenizer)


def test_explicit_pad_equal_to_eos_is_refused(assets):
    with pytest.raises(ValueError, match=r"pad_token .<\|endoftext\|>. is an EOS token \(EOS ids \[0\]\); PPO needs them distinct"):
        load_tokenizer(assets["tokenizer"], pad_token="<|endoftext|>")


def test_padding_side(assets):
    assert load_tokenizer(assets["tokenizer"], padding_side="left").padding_side == "left"


def test_require_model_dir(tmp_path, assets):
    assert require_model_dir(assets["base_model"], "base model") == assets["base_model"]
    assert require_model_dir("Qwen/Qwen2.5-0.5B", "base model") == "Qwen/Qwen2.5-0.5B"  # hub id passes through
    with pytest.raises(StageInputError, match="not found.*run `make sft`"):
        require_model_dir(str(tmp_path / "none"), "SFT model", "make sft")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(StageInputError, match="holds no weights"):
        require_model_dir(str(tmp_path / "empty"), "SFT model")
    for unset in (None, ""):  # a recipe without the key (or no recipe at all): one line, not a traceback
        with pytest.raises(StageInputError, match=r"^SFT model: no path is set; name it in the recipe"):
            require_model_dir(unset, "SFT model", "make sft")


def test_a_reward_model_is_refused_as_a_policy(rm_run):
    """A sequence classifier (reward or value model) loaded as a causal LM would sample from a random LM head."""
    with pytest.raises(StageInputError, match=r"is a Qwen2ForSequenceClassification \(a reward or value model\), "
                                              r"not a causal LM; give a policy"):
        models.load_causal_lm(rm_run["merged"])


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(str(target)) as tmp:
            open(f"{tmp}/half", "w").write("x")
            raise RuntimeError("crash")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_dir(str(target)) as tmp:
        open(f"{tmp}/full", "w").write("x")
    assert (target / "full").exists()


# -- quantization (QLoRA): clear errors on a machine without bitsandbytes / GPU, and the config reaching the loader --
def model_config(**kwargs):
    from trl import ModelConfig

    return ModelConfig(**kwargs)


def test_no_quantization_needs_nothing():
    assert models.recipe_quantization_config(model_config()) is None


@pytest.mark.parametrize("key", ["load_in_4bit", "load_in_8bit"])
def test_quantized_model_is_trained_through_lora_only(key):
    with pytest.raises(ValueError, match=f"^{key}: true needs use_peft: true: .*LoRA.*set use_peft: true, or {key}"):
        models.recipe_quantization_config(model_config(**{key: True}, use_peft=False, dtype="bfloat16"))


def test_quantized_value_model_is_trained_through_lora_only():
    lora = {"use_peft": True, "value_use_peft": False}
    with pytest.raises(ValueError, match="^load_in_4bit: true needs value_use_peft: true: the value model is trained"):
        models.recipe_quantization_config(model_config(load_in_4bit=True, use_peft=True, dtype="bfloat16"), lora)


def test_4bit_needs_an_explicit_compute_dtype():
    with pytest.raises(ValueError, match="load_in_4bit: true needs an explicit dtype"):
        models.recipe_quantization_config(model_config(load_in_4bit=True, use_peft=True, dtype="auto"))


NO_BNB = ("{key}: true needs the bitsandbytes package, which is not installed here; install it "
          "(pip install -e '.[qlora]'), or set {key}: false")
CPU_BACKEND = ("load_in_4bit: true on the CPU ({where}) needs a working bitsandbytes CPU backend; bitsandbytes 0.44.1 "
               "cannot quantize on the CPU: RuntimeError: no CPU kernel; upgrade it (pip install -U 'bitsandbytes>=0.50'), "
               "run on a CUDA machine, or set load_in_4bit: false")
CPU_8BIT = ("load_in_8bit: true needs a CUDA GPU ({where}); on the CPU only load_in_4bit runs: set load_in_4bit: true "
            "instead, run on a CUDA machine, or set load_in_8bit: false")
NO_CUDA, USE_CPU = "torch.cuda.is_available() is False", "the recipe sets use_cpu: true"
KBIT_CASES = [  # (key, bitsandbytes installed, CPU backend works, CUDA available, use_cpu, the one error line or None)
    ("load_in_4bit", False, False, False, False, NO_BNB.format(key="load_in_4bit")),
    ("load_in_4bit", False, False, True, False, NO_BNB.format(key="load_in_4bit")),
    ("load_in_8bit", False, False, True, False, NO_BNB.format(key="load_in_8bit")),
    ("load_in_4bit", True, False, True, False, None),  # CUDA: the CPU backend is not asked
    ("load_in_8bit", True, False, True, False, None),
    ("load_in_4bit", True, True, False, False, None),  # CPU, working backend: 4-bit runs
    ("load_in_4bit", True, True, True, True, None),
    ("load_in_4bit", True, False, False, False, CPU_BACKEND.format(where=NO_CUDA)),
    ("load_in_4bit", True, False, True, True, CPU_BACKEND.format(where=USE_CPU)),
    ("load_in_8bit", True, True, False, False, CPU_8BIT.format(where=NO_CUDA)),
    ("load_in_8bit", True, True, True, True, CPU_8BIT.format(where=USE_CPU)),
]


@pytest.mark.parametrize("key, bnb, backend, cuda, use_cpu, error", KBIT_CASES)
def test_kbit_needs_bitsandbytes_and_on_the_cpu_its_4bit_backend(monkeypatch, key, bnb, backend, cuda, use_cpu, error):
    """CUDA as before (bitsandbytes installed is enough); on the CPU 4 bits need a working bitsandbytes CPU backend and
    8 bits are refused. Each refusal is one exact line naming the key, what is missing and the fix."""
    monkeypatch.setattr(models, "_has_bitsandbytes", lambda: bnb)
    monkeypatch.setattr(models, "_bnb_cpu_4bit_problem",
                        lambda: None if backend else "bitsandbytes 0.44.1 cannot quantize on the CPU: RuntimeError: "
                                                     "no CPU kernel")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = model_config(**{key: True}, use_peft=True, dtype="bfloat16")
    if error is None:
        config = models.recipe_quantization_config(args, use_cpu=use_cpu)
        assert getattr(config, key) is True
        return
    with pytest.raises(ValueError) as exc:
        models.recipe_quantization_config(args, use_cpu=use_cpu)
    assert str(exc.value) == error
    assert "\n" not in str(exc.value)


def test_cpu_4bit_check_quantizes_for_real():
    """The CPU check is a real NF4 round trip through bitsandbytes: it passes where bitsandbytes >= 0.50 is installed
    (the dev extra, x86_64) and names the import failure where it is not."""
    models._bnb_cpu_4bit_problem.cache_clear()
    problem = models._bnb_cpu_4bit_problem()
    if models._has_bitsandbytes():
        assert problem is None
    else:
        assert problem.startswith("bitsandbytes ? cannot quantize on the CPU: ModuleNotFoundError: "), problem


def test_cpu_4bit_check_reports_a_failing_backend(monkeypatch):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes
    import bitsandbytes.functional

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for CPU\nsecond line")

    monkeypatch.setattr(bitsandbytes.functional, "quantize_4bit", broken)
    models._bnb_cpu_4bit_problem.cache_clear()
    try:
        problem = models._bnb_cpu_4bit_problem()
    finally:
        models._bnb_cpu_4bit_problem.cache_clear()
    assert problem == f"bitsandbytes {bitsandbytes.__version__} cannot quantize on the CPU: RuntimeError: no kernel for CPU"


def test_this_machine_gets_the_clear_error_not_an_import_error():
    """Without a CUDA GPU the loaders refuse 8 bits themselves (one line), whether bitsandbytes is installed or not."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    from transformers import BitsAndBytesConfig

    with pytest.raises(ValueError, match="^load_in_8bit: true needs (a CUDA GPU|the bitsandbytes package)"):
        models.load_causal_lm("unused", quantization_config=BitsAndBytesConfig(load_in_8bit=True))


@pytest.mark.parametrize("device, expected", [("cpu", {"": "cpu"}), ("cuda", {"": 3})])
def test_quantized_models_load_on_the_run_device(monkeypatch, device, expected):
    """The run's device (accelerate's PartialState, set up from use_cpu by the stages): the CPU, or this process's GPU."""
    import accelerate
    from types import SimpleNamespace

    state = SimpleNamespace(device=torch.device(device), local_process_index=3)
    monkeypatch.setattr(accelerate, "PartialState", lambda: state)
    assert models.kbit_device_map() == expected


class _Loaded(Exception):
    """Raised by the fake from_pretrained once it has recorded its arguments."""


@pytest.mark.parametrize("stage", ["sft", "rm", "ppo"])
def test_qlora_recipe_reaches_from_pretrained(stage, assets, tmp_path, monkeypatch):
    """The 4-bit settings of recipes/qwen2.5-0.5b-qlora/<stage>.yaml arrive at from_pretrained as TRL's
    BitsAndBytesConfig, with a device map that puts the model whole on the run's device: the CPU under use_cpu."""
    import importlib

    import transformers
    from transformers import BitsAndBytesConfig

    seen = []

    def fake_from_pretrained(path, *args, **kwargs):
        seen.append(kwargs)
        raise _Loaded(path)

    auto = transformers.AutoModelForSequenceClassification if stage == "rm" else transformers.AutoModelForCausalLM
    monkeypatch.setattr(auto, "from_pretrained", fake_from_pretrained)
    monkeypatch.setattr(models, "require_kbit_support", lambda *args, **kwargs: None)  # bitsandbytes or not
    recipe = os.path.join(REPO, "recipes", "qwen2.5-0.5b-qlora", f"{stage}.yaml")
    argv = ["--config", recipe, "--bf16", "false", "--use_cpu", "true", "--output_dir", str(tmp_path / "out"),
            "--dataset_format", "auto", "--report_to", "none"]
    if stage == "ppo":
        argv += ["--dataset_name", assets["prompts"], "--sft_model_path", assets["base_model"],
                 "--reward_model_path", reward_stand_in(assets), "--eval_split_size", "8", "--per_device_eval_batch_size", "4"]
    else:
        argv += ["--dataset_name", assets[stage], "--model_name_or_path", assets["base_model"]]
    with pytest.raises(_Loaded):
        importlib.import_module(f"rlhf_trl.{stage}").main(argv)
    config = seen[0]["quantization_config"]
    assert isinstance(config, BitsAndBytesConfig)
    assert config.load_in_4bit and not config.load_in_8bit
    assert config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert seen[0]["device_map"] == {"": "cpu"}
    assert not (tmp_path / "out").exists()


QLORA_CLI_CASES = [  # (stage, extra args, the start of the one error line after "rlhf-trl <stage>: error: ")
    ("sft", ["--use_peft", "false"], "load_in_4bit: true needs use_peft: true"),
    ("rm", ["--use_peft", "false"], "load_in_4bit: true needs use_peft: true"),
    ("ppo", ["--value_use_peft", "false"], "load_in_4bit: true needs value_use_peft: true"),
    ("sft", ["--load_in_4bit", "false", "--load_in_8bit", "true"], "load_in_8bit: true needs "),  # --use_cpu true
    ("ppo", ["--save_merged_checkpoints", "true"], "load_in_4bit / load_in_8bit: set save_merged_checkpoints: false"),
]


@pytest.mark.parametrize("stage, extra, start", QLORA_CLI_CASES, ids=["sft_no_lora", "rm_no_lora", "ppo_value_no_lora",
                                                                      "sft_8bit_on_cpu", "ppo_merged_checkpoints"])
def test_qlora_recipe_errors_are_one_line(stage, extra, start, assets, tmp_path, capsys):
    from rlhf_trl.cli import run_stage

    recipe = os.path.join(REPO, "recipes", "qwen2.5-0.5b-qlora", f"{stage}.yaml")
    argv = ["--config", recipe, "--bf16", "false", "--use_cpu", "true", "--output_dir", str(tmp_path / "out"),
            "--dataset_format", "auto", "--report_to", "none", *extra]
    if stage == "ppo":
        argv += ["--dataset_name", assets["prompts"], "--sft_model_path", assets["base_model"],
                 "--reward_model_path", reward_stand_in(assets), "--eval_split_size", "8", "--per_device_eval_batch_size", "4"]
    else:
        argv += ["--dataset_name", assets[stage], "--model_name_or_path", assets["base_model"]]
    with pytest.raises(SystemExit) as exc:
        run_stage(stage, argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlhf-trl")]
    assert exc.value.code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith(f"rlhf-trl {stage}: error: {start}"), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bnb, backend, expected", [
    (False, True, NO_BNB.format(key="load_in_4bit")),
    (True, False, CPU_BACKEND.format(where=USE_CPU)),
], ids=["no_bitsandbytes", "cpu_backend_unusable"])
def test_cpu_qlora_recipe_without_a_usable_bitsandbytes_is_one_line(bnb, backend, expected, assets, tmp_path, capsys,
                                                                    monkeypatch):
    """A use_cpu: true QLoRA run stops before loading anything, with the exact line saying what is missing."""
    from rlhf_trl.cli import run_stage

    monkeypatch.setattr(models, "_has_bitsandbytes", lambda: bnb)
    monkeypatch.setattr(models, "_bnb_cpu_4bit_problem",
                        lambda: None if backend else "bitsandbytes 0.44.1 cannot quantize on the CPU: RuntimeError: "
                                                     "no CPU kernel")
    recipe = os.path.join(REPO, "recipes", "qwen2.5-0.5b-qlora", "sft.yaml")
    with pytest.raises(SystemExit) as exc:
        run_stage("sft", ["--config", recipe, "--bf16", "false", "--use_cpu", "true", "--dtype", "float32",
                          "--output_dir", str(tmp_path / "out"), "--dataset_format", "auto", "--report_to", "none",
                          "--dataset_name", assets["sft"], "--model_name_or_path", assets["base_model"]])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlhf-trl")]
    assert exc.value.code == 2 and "Traceback" not in err
    assert lines == [f"rlhf-trl sft: error: {expected}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["causal_lm", "sequence_classifier"])
def test_adapter_on_a_quantized_base_is_merged_into_an_unquantized_copy(kind, assets, tokenizer, tmp_path, monkeypatch):
    """QLoRA outputs: merge_and_save reloads the base unquantized, merges the adapter there and saves that (4-bit
    weights would round the update away); the trained model is returned untouched. The quantized base is simulated."""
    from peft import LoraConfig, PeftModel, get_peft_model

    load = getattr(models, f"load_{kind}")
    base = load(assets["base_model"], torch.float32)
    models.resize_for_tokenizer(base, tokenizer)
    task = "CAUSAL_LM" if kind == "causal_lm" else "SEQ_CLS"
    model = get_peft_model(base, LoraConfig(task_type=task, r=4, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))  # a non-zero update, as after training
    monkeypatch.setattr(models, "is_quantized", lambda m: True)
    out = tmp_path / "merged"
    returned = models.merge_and_save(model, tokenizer, str(out))
    assert returned is model and isinstance(returned, PeftModel)
    assert not (out / "adapter_config.json").exists()
    merged = load(str(out), torch.float32).eval()
    ids = torch.tensor([tokenizer("今天天气很好").input_ids + [tokenizer.eos_token_id]])
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert torch.allclose(expected, got, atol=1e-5), (expected - got).abs().max()


def test_saved_model_directories_get_the_usual_mode(tmp_path):
    """atomic_dir writes under a private temporary name; the final directory has the umask's mode, not 0700."""
    from rlhf_trl.atomic import atomic_dir

    umask = os.umask(0o022)
    try:
        with atomic_dir(str(tmp_path / "merged")) as tmp:
            open(os.path.join(tmp, "config.json"), "w").write("{}")
    finally:
        os.umask(umask)
    assert (os.stat(tmp_path / "merged").st_mode & 0o777) == 0o755
