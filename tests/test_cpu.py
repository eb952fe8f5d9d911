"""`rlhf_trl.cpu`: decoding-size matmuls go through oneDNN inside `onednn_decoding` and agree with MKL to fp32
rounding (larger or gradient-carrying calls, and everything after the block, are MKL's, bit for bit); a malloc mmap
threshold returns freed tensors to the system; `fuse_lora` layers compute peft's outputs and gradients; the
`rlhf-trl` command puts large tensors on transparent huge pages."""

import functools
import os
from contextlib import contextmanager, nullcontext
import subprocess
import sys

import pytest
import torch
from conftest import import_ppo
from peft import LoraConfig, get_peft_model
from test_ppo import ppo_argv
from transformers import AutoModelForCausalLM

from rlhf_trl import cpu
from rlhf_trl import ppo_engine
from rlhf_trl.models import load_tokenizer


@pytest.fixture
def policy(assets):
    return lora_model(assets).eval()


@pytest.fixture
def calls(monkeypatch):
    """The rows of every matmul routed through oneDNN (skips the test on a PyTorch without oneDNN)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch built without oneDNN")
    seen = []

    def counted(x, weight, bias):
        seen.append(x.numel() // x.shape[-1])
        return real(x, weight, bias)

    real = cpu.onednn_linear
    monkeypatch.setattr(cpu, "onednn_linear", counted)
    return seen


def test_decoding_steps_go_through_onednn_and_agree_with_mkl(policy, calls):
    ids = torch.randint(3, 200, (8, 1))
    with torch.no_grad():
        before = policy(input_ids=ids).logits
        with cpu.onednn_decoding(policy, min_weight_elements=0) as same:
            assert same is policy
            inside = policy(input_ids=ids).logits
        after = policy(input_ids=ids).logits
    linears = [m for m in policy.modules() if type(m) is torch.nn.Linear]
    assert len(calls) == len(linears) and set(calls) == {8}  # base layers, LoRA A / B and the LM head, 8 rows each
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, before)
    assert not any("forward" in vars(m) for m in policy.modules())


def test_small_weights_keep_the_default_kernels(policy, calls):
    ids = torch.randint(3, 200, (8, 1))
    big = [m for m in policy.modules() if type(m) is torch.nn.Linear and m.weight.numel() >= 64 * 64]
    assert 0 < len(big) < len([m for m in policy.modules() if type(m) is torch.nn.Linear])
    with torch.no_grad(), cpu.onednn_decoding(policy, min_weight_elements=64 * 64):
        assert all(("forward" in vars(m)) == (m in big) for m in policy.modules() if type(m) is torch.nn.Linear)
        policy(input_ids=ids)
    assert len(calls) == len(big)


def test_large_and_gradient_calls_keep_the_default_kernels(policy, calls):
    ids = torch.randint(3, 200, (8, 9))  # 72 rows > max_rows 64
    with torch.no_grad():
        before = policy(input_ids=ids).logits
        with cpu.onednn_decoding(policy, min_weight_elements=0):
            large = policy(input_ids=ids).logits
    assert calls == [] and torch.equal(large, before)
    short = ids[:, :1]
    grad_before = policy(input_ids=short).logits
    with cpu.onednn_decoding(policy, min_weight_elements=0):
        grad_inside = policy(input_ids=short).logits
    assert calls == [] and torch.equal(grad_inside, grad_before) and grad_inside.requires_grad


def test_onednn_linear_takes_dense_tensors_with_the_converting_kernels_values(monkeypatch):
    """`onednn_linear` calls oneDNN's dense-in, dense-out linear (no conversion of input and output per call) and
    gives what ``mkldnn_linear`` on converted tensors gives, bit for bit (with and without bias, 2-D, 3-D and
    non-contiguous input); without that op it falls back to the converting one."""
    if cpu._LINEAR_POINTWISE is None:
        pytest.skip("this PyTorch has no mkldnn._linear_pointwise (or no oneDNN)")
    torch.manual_seed(0)
    weight, bias = torch.randn(384, 96), torch.randn(384)
    for x in (torch.randn(8, 96), torch.randn(8, 1, 96), torch.randn(96, 5).t()):
        for b in (bias, None):
            dense = cpu.onednn_linear(x, weight, b)
            converted = torch._C._nn.mkldnn_linear(x.reshape(-1, 96).contiguous().to_mkldnn(), weight, b).to_dense()
            assert dense.shape == (*x.shape[:-1], 384) and dense.layout == torch.strided
            assert torch.equal(dense, converted.reshape(dense.shape))
            monkeypatch.setattr(cpu, "_LINEAR_POINTWISE", None)
            assert torch.equal(cpu.onednn_linear(x, weight, b), dense)
            monkeypatch.undo()


def test_disabled_or_raising_blocks_leave_the_model_as_it_was(policy, calls):
    ids = torch.randint(3, 200, (2, 1))
    with torch.no_grad(), cpu.onednn_decoding(policy, enabled=False, min_weight_elements=0):
        policy(input_ids=ids)
    assert calls == []
    with pytest.raises(RuntimeError, match="boom"), cpu.onednn_decoding(policy, min_weight_elements=0):
        assert all("forward" in vars(m) for m in policy.modules() if type(m) is torch.nn.Linear)
        raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in policy.modules())


def test_rollouts_sample_the_same_tokens_with_log_probs_to_rounding(assets, policy, calls):
    tok = load_tokenizer(assets["tokenizer"])
    queries = torch.randint(3, 200, (4, 6))
    config = ppo_engine.sampling_config(ppo_engine.PPOConfig(output_dir="unused", response_length=12, bf16=False), None,
                                        tok.pad_token_id)
    torch.manual_seed(1)
    mkl = ppo_engine.generate_rollouts(policy, queries, tok.pad_token_id, config, 4)
    assert calls == []
    torch.manual_seed(1)
    with cpu.onednn_decoding(policy, min_weight_elements=0):
        dnn = ppo_engine.generate_rollouts(policy, queries, tok.pad_token_id, config, 4)
    assert set(calls) == {24, 4}  # the prefill (4 prompts x 6 tokens) and the decoding steps (4 rows)
    assert torch.equal(dnn[0], mkl[0])
    torch.testing.assert_close(dnn[1], mkl[1], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two PPO runs (~6 s)
def test_the_recipe_keys_reach_the_rollouts(assets, sft_run, rm_run, tmp_path, calls, monkeypatch):
    ppo = import_ppo()
    # the tiny model's weights are all below the default size limit: take every linear
    monkeypatch.setattr(ppo_engine, "onednn_decoding", functools.partial(cpu.onednn_decoding, min_weight_elements=0))
    thresholds = []  # recorded, not applied: the test process keeps glibc's default

    @contextmanager
    def raised(nbytes):
        thresholds.append(("generate", nbytes))
        yield

    monkeypatch.setattr(ppo_engine, "mmap_threshold_raised", raised)
    monkeypatch.setattr(ppo, "set_malloc_mmap_threshold", lambda nbytes: thresholds.append(("run", nbytes)))
    monkeypatch.setattr(ppo, "install_tensor_cache", lambda headroom: thresholds.append(("cache", headroom)))
    ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "off", "--total_episodes", "8", "--save_strategy", "no"))
    assert calls == [] and thresholds == [("run", 0), ("generate", 0)]  # one update of 8 episodes
    thresholds.clear()
    ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path / "on", "--total_episodes", "8", "--save_strategy", "no",
                      "--onednn_decoding", "true", "--malloc_mmap_threshold", "131072", "--tensor_cache", "true",
                      "--tensor_cache_headroom_mb", "64"))
    assert calls and max(calls) <= 64
    assert thresholds == [("run", 131072), ("cache", 64 << 20), ("generate", 131072)]


def lora_model(assets, r=4, alpha=8, dropout=0.0):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(assets["base_model"], dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():  # a non-zero adapter, so that its product counts
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.train()


def forward_backward(model, ids):
    """Logits ``[b, T, vocab]`` and every gradient (LoRA weights)."""
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("r, alpha, exact", [(4, 8, True), (3, 5, False)])
def test_fused_lora_computes_pefts_outputs_and_gradients(assets, r, alpha, exact):
    """One in-place addmm per layer instead of peft's product, scaled copy and sum: outputs bit for bit when the
    scaling (alpha / r) is a power of two, else to fp32 rounding; gradients to fp32 rounding (autograd sums the
    input's gradient in another order); a disabled adapter is the base model, bit for bit."""
    peft_model, fused = lora_model(assets, r, alpha), lora_model(assets, r, alpha)
    layers = sum(type(m).__name__ == "Linear" and hasattr(m, "lora_A") for m in fused.modules())
    assert cpu.fuse_lora(fused) == layers > 0
    ids = torch.randint(0, 100, (2, 9))
    (a, grads_a), (b, grads_b) = forward_backward(peft_model, ids), forward_backward(fused, ids)
    assert grads_a.keys() == grads_b.keys() and any("lora_A" in k for k in grads_a)
    assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6 * a.abs().max().item())
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-4, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    with peft_model.disable_adapter(), fused.disable_adapter(), torch.no_grad():
        assert torch.equal(peft_model(input_ids=ids).logits, fused(input_ids=ids).logits)


def test_fused_lora_leaves_dropout_and_autocast_to_peft(assets):
    """LoRA dropout and autocast take peft's own forward: the same random mask, the same bf16 outputs."""
    peft_model, fused = lora_model(assets, dropout=0.5), lora_model(assets, dropout=0.5)
    cpu.fuse_lora(fused)
    ids = torch.randint(0, 100, (2, 9))
    for ctx in (nullcontext, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        with ctx():
            torch.manual_seed(1)
            a = peft_model(input_ids=ids).logits
            torch.manual_seed(1)
            b = fused(input_ids=ids).logits
        assert torch.equal(a, b)


def lora_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]


def test_lora_merged_computes_pefts_outputs_and_gives_every_weight_back(assets):
    """Inside `lora_merged` each adapted layer runs one product with ``W + scaling * B @ A`` (a copy): logits and
    sampled tokens as peft's to fp32 rounding; on exit every layer has its own weight parameter back, untouched
    (bit for bit, the same object), also after an exception, and the model computes peft's logits bit for bit."""
    model, ids = lora_model(assets, 4, 6).eval(), torch.randint(0, 100, (2, 9))
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    layers = lora_layers(model)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with cpu.lora_merged(model):
            assert all(m.merged for m in layers)
            assert all(m.base_layer.weight is not params[n + ".base_layer.weight"][0]
                       for n, m in model.named_modules() if m in layers)
            got = model(input_ids=ids).logits
            torch.manual_seed(3)
            sampled = model.generate(input_ids=ids, do_sample=True, max_new_tokens=6, pad_token_id=0)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert not torch.equal(got, expected)  # a merged product, not peft's three
        torch.manual_seed(3)
        assert torch.equal(sampled, model.generate(input_ids=ids, do_sample=True, max_new_tokens=6, pad_token_id=0))
        with pytest.raises(RuntimeError, match="inside"):
            with cpu.lora_merged(model):
                raise RuntimeError("inside")
        assert torch.equal(model(input_ids=ids).logits, expected)
    assert not any(m.merged for m in layers)
    after = dict(model.named_parameters())
    assert after.keys() == params.keys()
    for n, (p, value) in params.items():
        assert after[n] is p and torch.equal(p, value), n


def test_lora_merged_leaves_dropout_and_disabled_adapters_alone(assets):
    """A layer with LoRA dropout, or one whose adapter is disabled, keeps peft's forward and its weight; off, the
    block changes nothing."""
    for model, disabled in ((lora_model(assets, dropout=0.5), False), (lora_model(assets), True)):
        weights = [m.base_layer.weight for m in lora_layers(model)]
        with model.disable_adapter() if disabled else nullcontext(), cpu.lora_merged(model):
            assert not any(m.merged for m in lora_layers(model))
            assert all(m.base_layer.weight is w for m, w in zip(lora_layers(model), weights))
    model = lora_model(assets)
    with cpu.lora_merged(model, enabled=False):
        assert not any(m.merged for m in lora_layers(model))


@pytest.mark.slow  # one PPO update (~3 s)
def test_the_fused_lora_key_reaches_the_policy(assets, sft_run, rm_run, tmp_path, monkeypatch):
    from transformers import TrainerCallback

    ppo, forwards, merged, after = import_ppo(), [], [], []

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            forwards.extend(m.forward for m in lora_layers(model.policy))

        def on_step_end(self, args, state, control, model=None, **kwargs):  # after the update's training
            after.extend(m.merged for m in lora_layers(model.policy))

    def generate_rollouts(policy, *args):  # the rollout's generate sees merged adapters, training does not
        merged.append([m.merged for m in lora_layers(policy)])
        return real(policy, *args)

    real = ppo_engine.generate_rollouts
    monkeypatch.setattr(ppo_engine, "generate_rollouts", generate_rollouts)
    ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "8", "--save_strategy", "no",
                      "--fused_lora", "true"), callbacks=[Seen()])
    assert forwards and all(getattr(f, "__func__", None) is cpu._fused_lora_forward for f in forwards)
    assert merged and all(all(flags) and flags for flags in merged)
    assert after and not any(after)


def base_model(assets):
    return AutoModelForCausalLM.from_pretrained(assets["base_model"])


def test_fused_kernels_compute_the_layers_outputs_and_gradients_and_keep_less(assets):
    """`fuse_kernels`: every Qwen2 MLP's silu(gate) * up and every RMSNorm in one kernel pass forward and one
    backward: logits and every gradient (the norms' weights included) as PyTorch's to fp32 rounding, the same numbers
    every run; the backward keeps one ``[tokens, intermediate]`` tensor less per layer (silu(gate)) and each norm
    keeps its input and one number per row; NaN gates give NaN, as PyTorch's silu; other dtypes, strided inputs and
    autocast take PyTorch's operations, bit for bit."""
    plain, fused = base_model(assets), base_model(assets)
    mlps = [m for m in fused.modules() if type(m).__name__ == "Qwen2MLP"]
    norms = [m for m in fused.modules() if type(m).__name__ == "Qwen2RMSNorm"]
    assert len(mlps) == fused.config.num_hidden_layers and len(norms) == 2 * len(mlps) + 1
    assert cpu.fuse_kernels(fused) == len(mlps) + len(norms)
    if cpu._fused_lib is None:
        pytest.skip("no C++ compiler with OpenMP here: fuse_kernels changed nothing")
    assert cpu.fuse_kernels(fused) == 0  # already fused
    ids = torch.randint(0, 100, (2, 9))
    (a, grads_a), (b, grads_b) = forward_backward(plain, ids), forward_backward(fused, ids)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and any("norm" in k for k in grads_a)
    for k in grads_a:
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    again = forward_backward(fused, ids)
    assert torch.equal(again[0], b) and all(torch.equal(again[1][k], grads_b[k]) for k in grads_b)

    def kept(model):  # (number, bytes) of the tensors the graph keeps for the backward
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            model(input_ids=ids).logits.sum()
        return sum(sizes)

    tokens, hidden = ids.numel(), fused.config.hidden_size
    intermediate = tokens * fused.config.intermediate_size * 4  # bytes of one [tokens, intermediate] fp32 tensor
    # per norm PyTorch's operations keep x twice (pow, mul), rsqrt twice (its own output, mul), x * rsqrt and the
    # weight; the kernel keeps x, the weight and 1 / rms per row (fp32: 4 bytes each)
    norm_plain = 4 * (3 * tokens * hidden + 2 * tokens + hidden)
    norm_fused = 4 * (tokens * hidden + tokens + hidden)
    assert kept(plain) - kept(fused) == len(mlps) * intermediate + len(norms) * (norm_plain - norm_fused)
    gate = torch.tensor([float("nan"), -100.0, 0.0, 3.0, 100.0])
    torch.testing.assert_close(cpu.swiglu(gate, torch.ones(5)), torch.nn.functional.silu(gate), equal_nan=True)
    gate, up = torch.randn(3, 8, 16), torch.randn(3, 8, 16)
    for g, u in ((gate.double(), up.double()), (gate.transpose(1, 2), up.transpose(1, 2))):
        assert torch.equal(cpu.swiglu(g, u), torch.nn.functional.silu(g) * u)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(cpu.swiglu(gate, up), torch.nn.functional.silu(gate) * up)
    norm, x = norms[0], torch.randn(3, hidden, 8)
    for x in (x.transpose(1, 2).double(), x.transpose(1, 2)):  # fp64; strided
        assert torch.equal(norm(x), type(norm).forward(norm, x))


def test_fused_kernels_without_a_compiler_leave_the_model_alone(assets, tmp_path, monkeypatch, caplog):
    """No C++ compiler: one warning naming the cause, no module changed, the run goes on with PyTorch's ops."""
    import logging

    monkeypatch.setattr(cpu, "_fused_lib", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setattr(cpu, "_tensor_cache_build_dir", lambda: tmp_path / "ext")
    model = base_model(assets)
    with caplog.at_level(logging.WARNING, logger="rlhf_trl.cpu"):
        assert cpu.fuse_kernels(model) == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"fused_kernels: building fused_kernels.cpp with {tmp_path / 'no-such-c++'} failed: [Errno 2] No such file or "
        f"directory: '{tmp_path / 'no-such-c++'}'; PyTorch's own operations stay"]
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.slow  # one PPO update (~3 s)
def test_the_fused_kernels_key_reaches_every_model(assets, sft_run, rm_run, tmp_path):
    """``fused_kernels: true``: the policy's (and so the reference's), the value model's and the reward model's MLPs
    and RMSNorms all run the kernels."""
    from transformers import TrainerCallback

    ppo, seen = import_ppo(), {}

    def forwards(model):
        return {type(x).__name__: vars(x).get("forward") for x in model.modules()
                if type(x).__name__ in ("Qwen2MLP", "Qwen2RMSNorm")}

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["policy"], seen["value"] = forwards(model.policy), forwards(model.value_model)

    trainer = ppo.main(ppo_argv(assets, sft_run, rm_run, tmp_path, "--total_episodes", "8", "--save_strategy", "no",
                                "--fused_kernels", "true"), callbacks=[Seen()])["trainer"]
    if cpu._fused_lib is None:
        pytest.skip("no C++ compiler with OpenMP here")
    seen["reward"] = forwards(trainer.reward_model)
    for name, found in seen.items():
        assert getattr(found.get("Qwen2MLP"), "__func__", None) is cpu._fused_mlp_forward, name
        assert getattr(found.get("Qwen2RMSNorm"), "__func__", None) is cpu._fused_rms_norm_forward, name


MEASURE = """
import sys, torch
from rlhf_trl.cpu import mmap_threshold_raised, set_malloc_mmap_threshold
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
def freed_mb(n):  # RSS that n - 1 freed 1 MB tensors give back at once (the last stays: the heap's top is held)
    held = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(n)]
    keep, before = held[-1], rss()
    del held
    return keep, (before - rss()) / 2**20
"""

FREED = MEASURE + """
if sys.argv[1] == "set":
    assert set_malloc_mmap_threshold(131072)
big = torch.ones(16 << 20, dtype=torch.uint8)
del big  # freeing a 16 MB mmapped block raises glibc's default threshold
print(freed_mb(300)[1])  # 299 MB in 1 MB tensors
"""


def run_measure(script: str, *args: str, env: dict | None = None) -> list[float]:
    """Numbers the ``python -c script`` subprocess prints (``env``: its environment, default ours)."""
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                         env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return [float(x) for x in out.stdout.split()]


@pytest.mark.parametrize("mode", ["default", "set"])
def test_malloc_mmap_threshold_returns_freed_tensors_to_the_system(mode):
    returned_mb = run_measure(FREED, mode)[-1]
    if mode == "set":
        assert returned_mb > 250  # the 299 freed 1 MB tensors left the process
    else:
        assert returned_mb < 50  # glibc's default keeps them in the heap: what the setting is for


def test_malloc_mmap_threshold_must_not_be_negative():
    with pytest.raises(ValueError, match=r"^malloc_mmap_threshold must be >= 0 bytes, got -1$"):
        cpu.set_malloc_mmap_threshold(-1)
    assert cpu.set_malloc_mmap_threshold(0) is False  # 0: glibc's default, nothing set


RAISED = MEASURE + """
assert set_malloc_mmap_threshold(131072)
with mmap_threshold_raised(131072):
    keep, inside = freed_mb(100)
    before = rss()
print(inside, (before - rss()) / 2**20, freed_mb(400)[1])
"""


def test_mmap_threshold_raised_keeps_freed_blocks_for_reuse_then_trims_and_restores():
    """Inside the block (the rollout's generate) freed tensors stay in the heap for the next step to reuse; on exit
    malloc_trim hands them back, and the run's own threshold applies again (glibc first reuses the heap's free
    blocks, ~100 MB here, then maps the rest, which goes back when freed)."""
    inside, on_exit, after = run_measure(RAISED)
    assert inside < 20  # 99 MB kept in the heap while generating
    assert on_exit > 80  # trimmed when the block ends
    assert after > 250  # the 128 KB threshold is back: 399 freed tensors, all but the ~100 reused blocks, leave


def test_mmap_threshold_raised_is_a_no_op_at_zero_and_restores_after_an_error(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "_glibc_call", lambda name, *args: calls.append((name, *args)) or True)
    with cpu.mmap_threshold_raised(0):
        pass
    assert calls == []  # 0: glibc's own threshold is never touched
    with pytest.raises(KeyError):
        with cpu.mmap_threshold_raised(131072):
            raise KeyError("boom")
    assert calls == [("mallopt", -3, 32 << 20), ("mallopt", -3, 131072), ("malloc_trim", 0)]


THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE_PROBE = ("import rlhf_trl.cli, torch; t = torch.ones(64 << 20); print([int(line.split()[1]) for line in "
                   "open('/proc/self/smaps_rollup') if line.startswith('AnonHugePages')][0])")


def _thp_mode() -> str | None:
    try:
        text = open(THP_MODE).read()
    except OSError:
        return None
    return text[text.find("[") + 1:text.find("]")] if "[" in text else None


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason=f"no transparent huge pages here ({THP_MODE})")
def test_the_command_puts_large_cpu_tensors_on_huge_pages():
    """`rlhf_trl.cli` sets THP_MEM_ALLOC_ENABLE=1 before torch's first allocation: a 256 MB tensor of the command's
    process lies on huge pages; THP_MEM_ALLOC_ENABLE=0 from the user keeps 4 KB pages (kernel mode ``madvise``)."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert run_measure(HUGE_PAGE_PROBE, env=env)[-1] > 0
    if _thp_mode() == "madvise":
        assert run_measure(HUGE_PAGE_PROBE, env=dict(env, THP_MEM_ALLOC_ENABLE="0"))[-1] == 0
