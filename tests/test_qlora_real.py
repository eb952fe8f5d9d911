"""QLoRA for real on the CPU: SFT, RM and PPO with a 4-bit NF4 base (bitsandbytes' CPU backend) on real weights.

The stock Qwen2.5-Coder-0.5B-Instruct directory (`real_model`) goes through the recipes of recipes/qwen2.5-0.5b-cpu
with ``--load_in_4bit true --bnb_4bit_quant_type nf4 --dtype float32`` (fp32 compute: the CPU backend dequantizes
each 4-bit weight to the compute dtype and runs a plain matmul, and fp32 is the fast CPU dtype; the LoRA adapters are
fp32 too, `rlhf_trl.models.fp32_adapters_for_fp32_compute`). Smoke sizes (one optimizer step of 2 rows / 1 pair,
2 PPO updates of 2 episodes x 8 tokens); the assertions are about behaviour:

  - the models the trainers train are bitsandbytes ``Linear4bit`` in every targeted linear layer, on the CPU;
  - training changed the LoRA weights (B after one step, A too after two) and the reward model's score head;
  - merged/ is a plain unquantized model that transformers reloads, and it reproduces the adapter-on-4-bit model up
    to the 4-bit dequantization error, measured on the same input (see `test_sft_merged_matches_the_4bit_adapter`);
  - PPO completes its 2 updates and writes plain merged policy and value models.

Skipped when bitsandbytes is missing or its CPU backend does not work here, or when the real model is absent.
"""

import json
import os

import pytest
import torch
from conftest import REPO, SHARED
from transformers import TrainerCallback

pytestmark = pytest.mark.slow
bnb = pytest.importorskip("bitsandbytes", reason="QLoRA tests need bitsandbytes >= 0.50: pip install -e '.[dev]'")

RECIPES = REPO / "recipes" / "qwen2.5-0.5b-cpu"
QLORA = ["--load_in_4bit", "true", "--bnb_4bit_quant_type", "nf4", "--dtype", "float32", "--report_to", "none"]
IM_END = 151645
TEXT = "问：用 Python 写一个函数，返回列表的和。\n\n答：def total(xs):\n    return sum(xs)"


@pytest.fixture(scope="module", autouse=True)
def cpu_backend():
    from rlhf_trl.models import _bnb_cpu_4bit_problem

    problem = _bnb_cpu_4bit_problem()
    if problem is not None:
        pytest.skip(f"bitsandbytes' CPU backend is not usable here: {problem}")


def linear_layer_types(model) -> dict:
    """``{class name: count}`` of the linear layers of the transformer blocks, LoRA wrappers looked through (their
    ``base_layer``) and LoRA's own A / B layers left out."""
    counts = {}
    for name, module in model.named_modules():
        if (".layers." in name and isinstance(module, torch.nn.Linear) and "lora_" not in name
                and not hasattr(module, "base_layer")):
            counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return counts


class Probe(TrainerCallback):
    """A trainer callback that records, at train begin, the linear layer types, the devices and a copy of every
    trainable parameter, and at train end which of them changed and (``ids`` given) the trained model's outputs on
    ``ids`` with the adapter on and off (eval mode, no grad): logits and the last hidden state of each."""

    def __init__(self, ids=None):
        self.ids = ids

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.types = linear_layer_types(model)
        self.devices = {p.device.type for p in model.parameters()}
        self.before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        params = dict(model.named_parameters())
        self.trainable_dtypes = {str(params[n].dtype) for n in self.before}
        self.changed = {n for n, b in self.before.items() if not torch.equal(params[n].detach().float(), b)}
        if self.ids is None:
            return
        model.eval()
        with torch.no_grad():
            on = model(input_ids=self.ids, output_hidden_states=True)
            with model.disable_adapter():
                off = model(input_ids=self.ids, output_hidden_states=True)
        model.train()
        self.out_on, self.out_off = on.logits.float(), off.logits.float()
        self.hidden_on, self.hidden_off = on.hidden_states[-1].float(), off.hidden_states[-1].float()


@pytest.fixture(scope="module")
def ids(real_model):
    from rlhf_trl.models import load_tokenizer

    tok = load_tokenizer(real_model)
    return torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"] + [IM_END]])


@pytest.fixture(scope="module")
def stock(real_model, ids):
    """The stock model, unquantized fp32, on ``ids``: logits and the last hidden state (after the final norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return {"logits": out.logits.float(), "hidden": out.hidden_states[-1].float()}


@pytest.fixture(scope="module")
def qlora_sft(real_model, ids, module_tmp):
    from rlhf_trl import sft

    probe = Probe(ids)
    out = module_tmp("qlora_sft")
    result = sft.main(["--config", str(RECIPES / "sft.yaml"), "--model_name_or_path", real_model,
                       "--output_dir", str(out), "--max_steps", "1", "--warmup_steps", "0", "--max_length", "48",
                       "--gradient_accumulation_steps", "1", "--learning_rate", "1e-3", "--eval_split_size", "1",
                       "--per_device_eval_batch_size", "1", *QLORA], callbacks=[probe])
    return result, probe


@pytest.fixture(scope="module")
def qlora_rm(real_model, ids, module_tmp):
    """The reward model straight on the stock directory (no SFT merge in between: the stages are tested apart)."""
    from rlhf_trl import rm

    probe = Probe(ids)
    out = module_tmp("qlora_rm")
    result = rm.main(["--config", str(RECIPES / "rm.yaml"), "--model_name_or_path", real_model, "--dataset_name",
                      str(SHARED / "data" / "zh" / "oaast_rm_zh.json"), "--dataset_format", "ranked",
                      "--output_dir", str(out), "--max_steps", "1", "--max_length", "64",
                      "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
                      "--learning_rate", "1e-3", "--eval_split_size", "4", *QLORA], callbacks=[probe])
    return result, probe


def assert_plain_model_dir(path):
    """A merged/ directory: no quantization config, no 4-bit storage (uint8) or quant-state tensors, fp32 weights."""
    from safetensors import safe_open

    config = json.load(open(os.path.join(path, "config.json")))
    assert "quantization_config" not in config
    dtypes, names = set(), []
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                for key in st.keys():
                    names.append(key)
                    dtypes.add(str(st.get_slice(key).get_dtype()))
    assert dtypes == {"F32"}, dtypes
    assert not [n for n in names if "quant" in n or "absmax" in n or "lora_" in n]


def test_sft_trains_lora_on_a_4bit_base(qlora_sft):
    result, probe = qlora_sft
    assert probe.types == {"Linear4bit": 24 * 7}, probe.types  # every q/k/v/o/gate/up/down of the 24 blocks
    assert probe.devices == {"cpu"}
    assert probe.trainable_dtypes == {"torch.float32"}  # fp32 compute -> fp32 adapters
    lora_a = {n for n in probe.before if "lora_A" in n}
    lora_b = {n for n in probe.before if "lora_B" in n}
    assert len(lora_a) == len(lora_b) == 24 * 7 and set(probe.before) == lora_a | lora_b  # only LoRA trains
    # one step from LoRA's init (B = 0): every B moved; A's gradient is B^T (...) = 0, so A moves from step 2 on
    assert probe.changed == lora_b
    assert result["metrics"]["global_step"] == 1 and result["metrics"]["eval_loss"] > 0


def test_sft_merged_matches_the_4bit_adapter(qlora_sft, stock, ids):
    """merged/ = adapter merged into the unquantized base, reloaded with plain transformers.

    It cannot equal the trained model (adapter on the NF4 base) exactly: the two bases differ by the 4-bit
    dequantization error, which the trained model's own outputs with the adapter off show on this input
    (``quant = |4-bit base - stock|``, a few logits units at most). The adapter adds the same update to both bases,
    so ``|merged - trained|`` must stay within that error (x1.25: the update acts on activations that already differ
    by it; measured: error 4.07, gap 4.15 logits), and the adapter's effect seen on the unquantized side (``merged -
    stock``) must be the one seen on the 4-bit side (``trained - 4-bit base``): same direction (cosine > 0.85, 0.92
    measured: the same weights act on activations ~10% apart) and size (norm ratio 0.8-1.25, 0.98 measured). A merge
    that dropped the adapter (delta 0) or mis-scaled it (lora_alpha / r off: ratio 2) passes the first check but
    fails this one.
    """
    from transformers import AutoModelForCausalLM

    result, probe = qlora_sft
    assert_plain_model_dir(result["merged"])
    merged = AutoModelForCausalLM.from_pretrained(result["merged"], dtype=torch.float32).eval()
    assert not getattr(merged, "is_loaded_in_4bit", False)
    assert linear_layer_types(merged) == {"Linear": 24 * 7}
    with torch.no_grad():
        m = merged(input_ids=ids).logits.float()
    quant = (probe.out_off - stock["logits"]).abs().max()
    gap = (probe.out_on - m).abs().max()
    print(f"SFT logits: 4-bit error {float(quant):.4f}, merged vs trained {float(gap):.4f}")
    assert 0 < quant < 10, quant
    assert gap <= 1.25 * quant, (gap, quant)
    delta_fp, delta_4bit = (m - stock["logits"]).flatten(), (probe.out_on - probe.out_off).flatten()
    cos = torch.nn.functional.cosine_similarity(delta_fp, delta_4bit, dim=0)
    ratio = delta_fp.norm() / delta_4bit.norm()
    assert delta_4bit.abs().max() > 1e-3  # the step moved the model
    print(f"SFT adapter effect: cosine {float(cos):.4f}, norm ratio {float(ratio):.4f}, "
          f"max {float(delta_4bit.abs().max()):.4f}")
    assert cos > 0.85 and 0.8 < ratio < 1.25, (cos, ratio)


def test_rm_trains_lora_and_head_on_a_4bit_base(qlora_rm):
    result, probe = qlora_rm
    assert probe.types == {"Linear4bit": 24 * 7}, probe.types
    assert probe.devices == {"cpu"}
    lora_b = {n for n in probe.before if "lora_B" in n}
    head = {n for n in probe.before if "score" in n}
    assert len(lora_b) == 24 * 7 and head and probe.changed == lora_b | head  # (A: zero gradient at step 1)
    assert result["metrics"]["global_step"] == 1


def test_rm_merged_matches_the_4bit_adapter(qlora_rm, stock, ids):
    """The merged reward model's score vs the trained one's (adapter + trained score head on the 4-bit base).

    ``score = w . h`` (h: the last hidden state, after the final norm, at the last token; w: the trained head), so
    ``merged - trained = w . (h_stock - h_4bit base)`` (the dequantization error seen through the head, measured
    here from the trained model with its adapter off) ``+ (a_fp - a_4bit)``, where ``a_fp = merged - w . h_stock``
    and ``a_4bit = trained - w . h_4bit base`` are the adapter's effect on each base. The same LoRA weights act on
    activations that differ by the 4-bit error, so the two effects agree to within 40% of ``a_4bit`` (measured: 6-12%
    on the score; the SFT logits' effects agree to cosine ~0.91, a relative deviation ~0.4). A merge that dropped the
    adapter (``a_fp`` ~ 0) or mis-scaled it (ratio 2) is off by ~100% of ``a_4bit``.
    """
    from transformers import AutoModelForSequenceClassification

    result, probe = qlora_rm
    assert_plain_model_dir(result["merged"])
    merged = AutoModelForSequenceClassification.from_pretrained(result["merged"], dtype=torch.float32).eval()
    assert linear_layer_types(merged) == {"Linear": 24 * 7}
    with torch.no_grad():
        m = float(merged(input_ids=ids).logits[0, 0])
        w = merged.score.weight.float()[0]
        q = float(probe.out_on[0, 0])  # a sequence classifier's logits: [batch, 1] at the last token
        assert abs(float(w @ probe.hidden_on[0, -1]) - q) < 1e-3  # the score is w . h of that hidden state
        quant = float(w @ (stock["hidden"][0, -1] - probe.hidden_off[0, -1]))
        a_4bit = q - float(w @ probe.hidden_off[0, -1])
        a_fp = m - float(w @ stock["hidden"][0, -1])
    print(f"RM score: trained {q:.4f}, merged {m:.4f}, 4-bit error through the head {quant:.4f}, adapter effect "
          f"4-bit {a_4bit:.4f} / unquantized {a_fp:.4f}")
    assert abs(a_4bit) > 0.1  # one step at 1e-3 moved the score (~3.6 measured)
    assert abs(a_fp - a_4bit) <= 0.4 * abs(a_4bit), (q, m, quant, a_4bit, a_fp)


def test_ppo_runs_two_updates_on_4bit_models(real_model, qlora_rm, tmp_path):
    """PPO with the stock directory as the policy and the QLoRA reward model (shared with the value model through
    value_use_peft + share_reward_value_base), all loaded in 4 bits: 2 updates, both adapters trained, plain
    merged policy and value model."""
    from bitsandbytes.nn import Linear4bit
    from peft import PeftModel

    from rlhf_trl import ppo

    probe = Probe()
    result = ppo.main(["--config", str(RECIPES / "ppo.yaml"), "--sft_model_path", real_model,
                       "--reward_model_path", qlora_rm[0]["merged"], "--output_dir", str(tmp_path / "ppo"),
                       "--total_episodes", "4", "--per_device_train_batch_size", "2", "--response_length", "8",
                       "--local_rollout_forward_batch_size", "2", "--max_prompt_length", "32",
                       "--eval_split_size", "2", "--per_device_eval_batch_size", "2", "--log_samples_every", "0",
                       "--reward_baseline", "0.0", "--save_merged_checkpoints", "false", "--value_use_peft", "true",
                       *QLORA], callbacks=[probe])
    trainer = result["trainer"]
    assert trainer.state.global_step == 2
    policy, value = trainer.model.policy, trainer.model.value_model
    for model in (policy, value):
        assert isinstance(model, PeftModel)
        assert sum(isinstance(m, Linear4bit) for m in model.modules()) == 24 * 7
    assert probe.types == {"Linear4bit": 2 * 24 * 7}, probe.types  # policy + value model (reward: the same base)
    lora = {n for n in probe.before if "lora_" in n}
    assert {n.split(".")[0] for n in lora} == {"policy", "value_model"}
    assert lora <= probe.changed  # 2 updates: B moved at the first, A at the second
    assert_plain_model_dir(result["merged"])
    assert_plain_model_dir(result["value_model"])
