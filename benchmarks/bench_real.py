"""PPO on real weights: where one update's time and memory go (issue 12; the baseline of the PPO-loop issue).

Run: ``make bench-real`` (or ``python benchmarks/bench_real.py [--model DIR] [--size small|large] [--updates N]``).
Writes ``bench_real.json`` and ``bench_real.md`` into ``--output_dir`` (default ``outputs/bench-real``).

Model: a stock Qwen2.5 Instruct directory (default: ``../shared/models/fetch_qwen2.5-0.5b.sh``, Qwen2.5-Coder-0.5B-
Instruct, 630M parameters, vocabulary 151,936), used as the policy (LoRA, reference = adapter off) and as the reward
and value model (the same weights as a one-label sequence classifier with a fresh score head: what a benchmark
needs). Prompts (``--prompt_set``): ``short``, the real zh prompts of
``../shared/data/zh/cvalues_responsibility_prompts.jsonl`` (~25 tokens); ``long`` (the default of ``--size issue``,
whose setting reads "prompts <= 256 tokens"), real zh task statements of at least 256 tokens (the last human turn of
``dpo_zh_demo.json`` / ``reward_dpo_zh_500.jsonl``), so that every prompt is cut to the limit; generated ones without
``../shared``. Rendered with the 问/答 template, at most 256 tokens (kept from the right). fp32 on the CPU.

Variants, each one PPO run in its own process (so that peak RSS is its own), same prompts, seed and settings:
  plain_trl        TRL 1.12's ``PPOTrainer`` driven by a plain script (benchmarks/plain_trl.py): full value model;
                   run from its own venv with trl==1.12.0 (``--trl112_venv``, default .venv-trl112, built on first
                   use), since the project itself follows current TRL
  rlhf_trl         ``rlhf-trl ppo`` (the project's PPO engine) in TRL's layout (full value model, as TRL does)
  rlhf_trl_fast    the same layout (full value model) with ``offload_reward_model: true`` (the reward model's
                   weights on disk between rollouts) and the CPU measures ``malloc_mmap_threshold: 131072`` (freed
                   tensors go back to the system), ``onednn_decoding: true`` (decoding matmuls through oneDNN),
                   ``fused_lora``, ``fused_kernels``, ``tensor_cache`` and ``rollout_sampler: inverse_cdf``
                   (`CPU_MEASURES`)
  rlhf_trl_low_memory  rlhf_trl_fast plus ``gradient_checkpointing: true``
  rlhf_trl_lean    ``rlhf-trl ppo`` with ``value_use_peft`` + ``share_reward_value_base`` (one copy of weights for
                   reward and value model), ``gradient_checkpointing: true`` and the CPU measures

Every engine variant runs with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU tensors of >= 2 MB on transparent huge
pages), as the ``rlhf-trl`` command runs it; plain_trl runs as a plain script does, without, unless
``--trl_huge_pages``. Each run records which (``huge_pages``).

Per update (the first is a warm-up and is not counted when more than one update runs), split by phase:
  generation    the rollout's ``generate`` (TRL's ``batch_generation``; the engine's ``generate_rollouts``)
  scoring       the no-grad forwards of the rollout: reference log-probs, values, rewards (the engine with
                ``single_value_forward``, its default at 1 epoch x 1 mini-batch: no value forward here, its values
                come from the value model's training forward, `PPOEngine.value_step`, timed as optimisation)
  optimisation  everything else in the update: PPO epochs (forward + backward + AdamW), whitening, GAE, logging
For each phase: seconds; the phase's matmul work (FLOPs, estimated from the parameter counts and token counts: 2 N
per token for a forward, 4 N for a LoRA forward + backward (no weight gradients of frozen weights), 6 N for a full
forward + backward; N split into the transformer body and the 151,936 x hidden LM head, whose logits only the
policy and reference compute: TRL 1.12 over every position, the engine over the response positions only; each variant
is measured against its own work); the achieved FLOP rate; and its ratio to the machine's measured fp32 matmul rate (a 2048^3 matmul
probe in the parent and in each variant's process before its run, the faster counting: the VM's rate moves by tens
of percent over minutes): the distance to the limit. The matmul floor (`update_gemms`, `matmul_floor`): the same
update's layer and LM-head products at their real shapes (decoding's few rows included, where the whole weight is
read per step), each timed alone in the parent between the runs: what any implementation of the update would spend
in matrix products on this machine with these kernels, a lower bound. The floor of all products (`other_gemms`
added): also attention's own products, the LoRA adapters' and gradient checkpointing's recomputed forwards, which
the update runs too (the issue's "matmul work of the update"). The floor is the machine's best; the VM's speed moves
by tens of percent over minutes (the same products 1.04-1.63x of their best two minutes apart: benchmarks/HISTORY.md,
thirteenth set), so each run also times one of the floor's products (`CANARY`) around every phase, outside the
phase's clock, and the report adds the floor at the speed the machine ran the products during the run (`run_speed`,
`add_run_speed`) and the comparison with TRL 1.12 with both runs at their own speed (`add_trl_ratios`): the canary
is compute-bound and sees the cores slow down, not the memory. Peak RSS of each phase (``VmHWM`` reset at each
phase start through ``/proc/self/clear_refs``), in bytes and in copies of one fp32 base model. Largest tensors: the
bytes of the biggest logits tensor each phase produced (``[rows, tokens, 151936]`` fp32: generation keeps the
scores of every step of every row, scoring the reference pass, optimisation the micro-batch's forward).

--size small (default): 4 episodes x 32 new tokens (per_device_train_batch_size 4), 1 PPO epoch: ~70 s per update
here. --size large: 8 episodes x 64 new tokens, run with micro-batches of 2 (per_device_train_batch_size 2 x
gradient_accumulation_steps 4) and rollout forward chunks of 2 so that it fits in 24 GB (TRL at micro-batch 8 took
19.9 GB and 643 s per update). --size issue: the PPO-loop issue's own setting, 8 episodes x 64 new tokens in one
micro-batch of 8 and one rollout chunk of 8, long prompts (TRL 1.12 does not fit in 24 GB at micro-batch 8 there:
run it with ``--trl_micro_batch 4``, 24.7 GB; nothing else may run; ``--engine_micro_batch 4`` runs the engine's
variants the same way). Run it on an otherwise idle machine. Peak RSS is the process's over all its updates: with
``--updates 1`` that is the first update, in which an optimizer's AdamW state is created at its first step (TRL: at
the end of the update); from the second update on it is held throughout, so ``--updates 2`` gives the steady peak.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

from _measure import status_field  # noqa: E402  (benchmarks/ is on sys.path: scripts run from it)
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FETCH = SHARED / "models" / "fetch_qwen2.5-0.5b.sh"
PROMPTS = SHARED / "data" / "zh" / "cvalues_responsibility_prompts.jsonl"
LONG_PROMPTS = (SHARED / "data" / "zh" / "dpo_zh_demo.json", SHARED / "data" / "zh" / "reward_dpo_zh_500.jsonl")
try:
    import rlhf_trl  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(REPO / "src"))

SIZES = {
    "small": dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, local_rollout_forward_batch_size=4,
                  response_length=32),
    "large": dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, local_rollout_forward_batch_size=2,
                  response_length=64),
    "issue": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, local_rollout_forward_batch_size=8,
                  response_length=64),
}
VARIANTS = ("plain_trl", "rlhf_trl", "rlhf_trl_fast", "rlhf_trl_low_memory", "rlhf_trl_lean")
CPU_MEASURES = ["--malloc_mmap_threshold", "131072", "--onednn_decoding", "true", "--fused_lora", "true",
                "--fused_kernels", "true", "--tensor_cache", "true", "--rollout_sampler", "inverse_cdf"]
EXTRA = {"rlhf_trl": [],
         "rlhf_trl_fast": ["--offload_reward_model", "true", *CPU_MEASURES],
         "rlhf_trl_low_memory": ["--offload_reward_model", "true", "--gradient_checkpointing", "true", *CPU_MEASURES],
         "rlhf_trl_lean": ["--value_use_peft", "true", "--share_reward_value_base", "true",
                           "--gradient_checkpointing", "true", *CPU_MEASURES]}
GB = 1e9
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # `layer_linears` order
POLICY_LORA = (16, PROJECTIONS)  # every run's policy adapter: rank, target modules (the child's settings)
VALUE_LORA = (16, ("q_proj", "v_proj"))  # rlhf_trl_lean's value adapter: value_lora_target_modules unset = peft's


# -- the child: one PPO run with phase timers ---------------------------------------------------------------------
def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _system_cpu_seconds() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


# The run-speed canary: one of the floor's products (an MLP product of 512 rows, the slab `gemm_seconds` times),
# ~25 ms, as an `other_gemms`-style key: ``product_seconds(*CANARY)`` times it in the parent, `PhaseMeter` in a run.
CANARY = (1, 512, 896, 4864)
CANARY_REPEATS = 5


class PhaseMeter:
    """Attributes wall time, kernel CPU time (``system_cpu_seconds``: mostly the zeroing of freshly faulted pages),
    peak RSS and the largest logits tensor to generation / scoring / optimisation.

    With ``canary`` (the default) it also times the `CANARY` product (best of `CANARY_REPEATS`, on operands made once)
    each time a phase ends, outside the phase's clock and before its peak RSS is reset: ``<phase>_canary_seconds``
    lists the canaries around each piece of the phase (the one before it started, the one after it ended: two per
    piece) and ``<phase>_canary_piece_seconds`` each piece's seconds (a phase can run in pieces: the few
    milliseconds between an update's end and the next rollout count as the next update's optimisation). The VM's
    speed moves by tens of percent over minutes (benchmarks/HISTORY.md, thirteenth set); `run_speed` turns these into
    how much slower than its best the machine ran the products during each phase."""

    def __init__(self, canary: bool = True):
        self.phase = None
        self._canary = bmm_operands(*CANARY) if canary else None
        self.last_canary = self._measure_canary()
        self.t = time.perf_counter()
        self.sys = _system_cpu_seconds()
        self.cur = self._empty()
        self.updates: list[dict] = []
        self.shape: dict = {}
        self.single_value_forward = False  # the engine's value_step ran: no value forward in scoring
        self.read_cut = False  # the engine's last decoder layer ran at the read positions only (`last_layer`)

    @staticmethod
    def _empty() -> dict:
        out = {f"{p}_{k}": 0 for p in ("generation", "scoring", "optimisation")
               for k in ("seconds", "system_cpu_seconds", "peak_rss_bytes", "largest_logits_bytes")}
        for p in ("generation", "scoring", "optimisation"):
            out[f"{p}_canary_seconds"], out[f"{p}_canary_piece_seconds"] = [], []
        return out

    def _measure_canary(self) -> float | None:
        return None if self._canary is None else best_bmm_seconds(*self._canary, CANARY_REPEATS)

    def enter(self, phase: str) -> None:
        if phase == self.phase:
            return
        self.close()
        self.phase, self.t, self.sys = phase, time.perf_counter(), _system_cpu_seconds()
        _reset_peak()

    def close(self) -> None:
        if self.phase is None:
            return
        piece = time.perf_counter() - self.t
        self.cur[f"{self.phase}_seconds"] += piece
        self.cur[f"{self.phase}_system_cpu_seconds"] += _system_cpu_seconds() - self.sys
        key = f"{self.phase}_peak_rss_bytes"
        self.cur[key] = max(self.cur[key], status_field("VmHWM"))
        canary = self._measure_canary()  # outside the phase's clock; `enter` resets the peak after it
        if canary is not None:
            self.cur[f"{self.phase}_canary_seconds"] += [self.last_canary, canary]
            self.cur[f"{self.phase}_canary_piece_seconds"].append(piece)
            self.last_canary = canary
        self.phase = None

    def tensor(self, logits) -> None:
        if logits is not None and self.phase is not None:
            key = f"{self.phase}_largest_logits_bytes"
            self.cur[key] = max(self.cur[key], logits.numel() * logits.element_size())

    def rollout_shape(self, queries, query_responses) -> None:
        if int(queries.shape[0]) >= self.shape.get("rows", 0):  # a rollout batch (sample tables are off)
            self.shape.update(rows=int(queries.shape[0]), prompt_tokens=int(queries.shape[1]),
                              sequence_tokens=int(query_responses.shape[1]))

    def end_update(self) -> None:
        self.close()
        self.updates.append(self.cur)
        self.cur = self._empty()
        self.enter("optimisation")  # until the next rollout starts, time counts as the update's own work


def _hook_trl(meter: "PhaseMeter") -> None:
    """Phase timers around TRL 1.12's PPOTrainer module functions (the plain_trl variant, in its own venv)."""
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_trainer

    original = {n: getattr(ppo_trainer, n) for n in ("batch_generation", "get_reward", "forward")}

    def batch_generation(model_, queries, chunk, pad, config):
        meter.enter("generation")
        out_ = original["batch_generation"](model_, queries, chunk, pad, config)
        meter.tensor(out_[1])
        meter.rollout_shape(queries, out_[0])
        meter.enter("scoring")
        return out_

    def get_reward(*args, **kwargs):
        if torch.is_grad_enabled():
            meter.enter("optimisation")
        return original["get_reward"](*args, **kwargs)

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():  # the PPO epochs' forward (policy and value model together)
            meter.enter("optimisation")
        out_ = original["forward"](*args, **kwargs)
        policy_output = out_[0] if isinstance(out_, tuple) else out_  # training: (policy output, values)
        meter.tensor(getattr(policy_output, "logits", None))
        return out_

    ppo_trainer.batch_generation, ppo_trainer.get_reward, ppo_trainer.forward = batch_generation, get_reward, forward


def _hook_engine(meter: "PhaseMeter") -> None:
    """Phase timers around the project's PPO engine: its rollout generation, its PPO epochs, and every vocabulary-
    sized logits tensor it forms (`ppo_math.selective_log_softmax` sees each one)."""
    from rlhf_trl import last_layer, ppo_engine, ppo_math

    generate, optimise, select = ppo_engine.generate_rollouts, ppo_engine.PPOEngine.optimise, \
        ppo_math.selective_log_softmax
    value_step = ppo_engine.PPOEngine.value_step

    def generate_rollouts(policy, queries, *args, **kwargs):
        meter.enter("generation")
        out_ = generate(policy, queries, *args, **kwargs)
        meter.rollout_shape(queries, out_[0])
        meter.enter("scoring")
        return out_

    def optimise_(self, *args, **kwargs):
        meter.enter("optimisation")
        return optimise(self, *args, **kwargs)

    def value_step_(self, *args, **kwargs):  # single_value_forward: the value model's training, before the policy's
        meter.enter("optimisation")
        meter.single_value_forward = True
        return value_step(self, *args, **kwargs)

    def selective_log_softmax(logits, index):
        meter.tensor(logits)
        return select(logits, index)

    def suffix_forward(*args, **kwargs):  # the last decoder layer at the read positions only
        meter.read_cut = True
        return suffix(*args, **kwargs)

    suffix = last_layer.suffix_forward
    last_layer.suffix_forward = suffix_forward
    ppo_engine.generate_rollouts, ppo_engine.PPOEngine.optimise = generate_rollouts, optimise_
    ppo_engine.PPOEngine.value_step = value_step_
    ppo_math.selective_log_softmax = selective_log_softmax


def child(variant: str, model: str, prompts: str, work: Path, out: Path, size: dict, updates: int) -> None:
    import torch
    from transformers import TrainerCallback

    meter = PhaseMeter()
    (_hook_trl if variant == "plain_trl" else _hook_engine)(meter)

    class UpdateEnd(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.enter("optimisation")
            meter.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            meter.end_update()

    batch = size["per_device_train_batch_size"] * size["gradient_accumulation_steps"]
    settings = {**{k: str(v) for k, v in size.items()}, "total_episodes": str(batch * updates),
                "num_ppo_epochs": "1", "num_mini_batches": "1", "learning_rate": "1e-5", "temperature": "0.7",
                "kl_coef": "0.05", "missing_eos_penalty": "1.0", "seed": "42", "report_to": "none",
                "save_strategy": "no", "logging_steps": "1", "output_dir": str(work / variant), "use_cpu": "true",
                "num_sample_generations": "0",
                "sft_model_path": model, "reward_model_path": model, "dataset_name": prompts,
                "max_prompt_length": "256", "use_peft": "true", "lora_r": str(POLICY_LORA[0]), "lora_alpha": "32",
                "lora_target_modules": " ".join(POLICY_LORA[1]),
                "dtype": "float32", "eval_split_size": "4", "per_device_eval_batch_size": "2",
                "overwrite_output_dir": "true"}
    probe = matmul_probe(repeats=10)  # this process's own rate: the VM's steal time moves it by up to 40% over minutes
    t0 = time.perf_counter()
    rss_start = status_field("VmRSS")
    if variant == "plain_trl":
        sys.path.insert(0, str(REPO / "benchmarks"))
        import plain_trl

        cfg = {k: v for k, v in settings.items() if k not in ("dtype", "overwrite_output_dir", "eval_split_size")}
        argv = ["ppo"] + [x for k, v in cfg.items() for x in (f"--{k}", v)]
        stage, parsed = plain_trl.parse(argv)
        parsed["lora_target_modules"] = settings["lora_target_modules"].split()
        parsed["stop_token"], parsed["eval_split_size"], parsed["dtype"] = "eos", 4, "float32"
        parsed["callbacks"] = [UpdateEnd()]
        plain_trl.ppo(parsed)
    else:
        from rlhf_trl import ppo

        extra = EXTRA[variant]
        argv = ["--config", str(REPO / "recipes" / "qwen2.5-0.5b-cpu" / "ppo.yaml"), "--dataset_format", "prompt",
                "--value_use_peft", "false", "--share_reward_value_base", "false", "--reward_baseline", "0.0",
                "--log_samples_every", "0", *extra]
        for k, v in settings.items():
            argv += [f"--{k}", *v.split()] if k == "lora_target_modules" else [f"--{k}", v]
        ppo.main(argv, callbacks=[UpdateEnd()])
    meter.close()
    json.dump({"variant": variant, "huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1",
               "single_value_forward": meter.single_value_forward, "read_cut": meter.read_cut,
               "updates": meter.updates, "shape": meter.shape, "seconds": time.perf_counter() - t0,
               "peak_rss_bytes": max([status_field("VmHWM")] + [u[k] for u in meter.updates for k in u
                                                             if k.endswith("peak_rss_bytes")]),
               "rss_start_bytes": rss_start, "threads": torch.get_num_threads(), "matmul_probe_flops": probe,
               "settings": size},
              open(out, "w"), indent=2)


# -- the parent: probe, runs, figures -------------------------------------------------------------------------------
def matmul_probe(n: int = 2048, repeats: int = 5) -> float:
    """The machine's fp32 matmul rate (FLOP/s): best of ``repeats`` n x n x n products."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def model_config(model_dir: str) -> dict:
    """A model directory's config.json as a dict."""
    return json.load(open(os.path.join(model_dir, "config.json")))


def param_counts(cfg: dict) -> dict:
    """Parameters of the transformer body and of the LM head (vocabulary x hidden), from a config.json's dict."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    per_layer = sum(i * o for i, o in layer_linears(cfg))  # q, k, v, o, gate / up / down
    kv = sum(i * o for name, (i, o) in zip(PROJECTIONS, layer_linears(cfg)) if name in ("k_proj", "v_proj"))
    return {"body": layers * per_layer, "head": vocab * h, "embedding": vocab * h,
            "total": layers * per_layer + vocab * h * (1 if cfg.get("tie_word_embeddings") else 2),
            "cut": per_layer - kv}  # one layer's q, o and MLP: what the engine's last layer runs at read positions only


def phase_flops(n: dict, shape: dict, size: dict, lean: bool, full_head: bool = True,
                single_value_forward: bool = False, read_cut: bool = False) -> dict:
    """Estimated matmul FLOPs of one update's phases (see the module docstring). ``full_head``: the policy's and
    reference's LM head runs over every position (TRL 1.12's ``forward``); else over the response positions only
    (the engine's `response_logprobs`). ``single_value_forward``: the engine's values come from the value model's
    training forward (`PPOEngine.value_step`): scoring has no value forward. ``read_cut``: the engine's
    `rlhf_trl.last_layer` (policy, reference and value model fed ``S - 1`` tokens, their last layer's projections but
    k and v, ``n["cut"]`` parameters, at the ``R`` read positions only; the reward model's at one position per row).
    Each variant is measured against its own work."""
    rows, prompt, seq = shape["rows"], shape["prompt_tokens"], shape["sequence_tokens"]
    new = seq - prompt
    body, head = n["body"], n["head"]
    head_tokens = seq if full_head else new
    # body parameter-tokens of one forward over the read positions `new` (the reward model: 1) of `seq - 1` tokens
    fed, reward = ((body * (seq - 1) - n["cut"] * (seq - 1 - new)) * rows, (body * seq - n["cut"] * (seq - 1)) * rows
                   ) if read_cut else (body * rows * seq, body * rows * seq)
    generation = 2 * body * rows * seq + 2 * head * rows * new  # prefill + decode (logits only for new tokens)
    scoring = (2 * fed + 2 * head * rows * head_tokens  # reference
               + 2 * reward + (0 if single_value_forward else 2 * fed))  # reward (and value) model
    optimisation = 4 * fed + 4 * head * rows * head_tokens + (4 if lean else 6) * fed
    return {"generation": generation, "scoring": scoring, "optimisation": optimisation}


def layer_linears(cfg: dict) -> list[tuple[int, int]]:
    """``(in_features, out_features)`` of one Qwen2 decoder layer's projections: q, k, v, o, gate, up, down."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]


def update_gemms(cfg: dict, shape: dict, settings: dict, lean: bool, full_head: bool = True,
                 single_value_forward: bool = False, read_cut: bool = False) -> dict:
    """The matrix products of one PPO update, by phase: ``{phase: {(m, k, n): count}}``, an ``[m, k] @ [k, n]``
    product ``count`` times. ``shape``: ``rows`` episodes, ``prompt_tokens`` P, ``sequence_tokens`` S (R = S - P new
    tokens); ``settings``: ``local_rollout_forward_batch_size`` c (rows per generate call and per scoring forward),
    ``per_device_train_batch_size`` (rows per micro-batch). A linear layer ``in -> out`` over T tokens: forward
    ``(T, in, out)``, input gradient ``(T, out, in)``, weight gradient ``(out, T, in)`` (trained weights only).
      generation    per call: prefill of c x P tokens (LM head on each row's last token), then R - 1 decoding steps
                    of c rows through the body and the LM head
      scoring       per chunk of c rows: reference (body over c x S tokens, LM head over c x R, TRL 1.12: c x S),
                    reward model (body), value model (body; not with ``single_value_forward``)
      optimisation  per micro-batch: LoRA policy forward + input gradients (body and LM head), value model forward
                    + input gradients (+ weight gradients when trained in full, not ``lean``)
    ``read_cut`` (the engine, `rlhf_trl.last_layer`): policy, reference and value model over c x (S - 1) tokens,
    their last layer's projections but k and v over c x R; the reward model's over c (one position per row).
    LoRA adapters, score heads, attention's own products (``QK^T``, ``PV``: ~4% of a forward at 320 tokens) and
    gradient checkpointing's recomputed forwards are left out (`other_gemms` lists them but the score heads): the
    FLOPs are `phase_flops`'s."""
    rows, prompt, seq = shape["rows"], shape["prompt_tokens"], shape["sequence_tokens"]
    new, layers = seq - prompt, cfg["num_hidden_layers"]
    chunk = min(int(settings.get("local_rollout_forward_batch_size", rows)), rows)
    micro = min(int(settings.get("per_device_train_batch_size", rows)), rows)
    head = (cfg["hidden_size"], cfg["vocab_size"])
    out = {"generation": {}, "scoring": {}, "optimisation": {}}

    def add(phase, m, k, n, count):
        key = (int(m), int(k), int(n))
        out[phase][key] = out[phase].get(key, 0) + int(count)

    def linear(phase, tokens, dims, count, dx=False, dw=False):
        i, o = dims
        add(phase, tokens, i, o, count)
        if dx:
            add(phase, tokens, o, i, count)
        if dw:
            add(phase, o, tokens, i, count)

    def body(phase, tokens, count, dx=False, dw=False, read=None):
        """``read``: the last layer's projections but k and v over ``read`` tokens only."""
        for name, dims in zip(PROJECTIONS, layer_linears(cfg)):
            if read is None or name in ("k_proj", "v_proj"):
                linear(phase, tokens, dims, count * layers, dx, dw)
            else:
                linear(phase, tokens, dims, count * (layers - 1), dx, dw)
                linear(phase, read, dims, count, dx, dw)

    calls, micro_batches = -(-rows // chunk), -(-rows // micro)
    body("generation", chunk * prompt, calls)
    linear("generation", chunk, head, calls * new)
    body("generation", chunk, calls * (new - 1))
    fed = seq - 1 if read_cut else seq  # tokens fed per row to policy, reference and value model

    def read(tokens):  # the last layer's read tokens (None: all of them)
        return tokens if read_cut else None

    body("scoring", chunk * fed, calls * (1 if single_value_forward else 2), read=read(chunk * new))  # ref (+ value)
    body("scoring", chunk * seq, calls, read=read(chunk))  # reward model: one position per row
    linear("scoring", chunk * (seq if full_head else new), head, calls)
    body("optimisation", micro * fed, micro_batches, dx=True, read=read(micro * new))  # LoRA policy: no base dW
    linear("optimisation", micro * (seq if full_head else new), head, micro_batches, dx=True)
    body("optimisation", micro * fed, micro_batches, dx=True, dw=not lean, read=read(micro * new))
    return out


def gemm_seconds(m: int, k: int, n: int, repeats: int = 5, slab: tuple[int, int, int] = (512, 4864, 4864),
                 cold_bytes: int = 1 << 30) -> float:
    """Seconds of one fp32 ``[m, k] @ [k, n]`` on this machine: the best of ``repeats`` runs and of the two operand
    layouts a linear layer uses (``x @ W.T`` and ``x @ W``), and for at most 64 rows (decoding) also of oneDNN's
    ``mkldnn_linear`` (what `rlhf_trl.cpu.onednn_decoding` routes decoding through). Over 64 rows, a product larger
    than ``slab`` is timed on a ``slab``-sized block of it and scaled by the FLOPs (the rate is flat at those sizes),
    so that the LM head's ``[tokens, 896] @ [896, 151936]`` costs a fraction of a second to time.

    Decoding reads every weight whole for a few rows, and a decoding step reads all of the model's (2.5 GB for
    Qwen2.5-0.5B in fp32) before it needs the same matrix again, so each one comes from memory, never from the
    cache. For at most 64 rows the runs therefore cycle through `cold_weight_copies` distinct weights (together at
    least ``cold_bytes``, beyond any last-level cache), each run on the next: timing one weight again and again
    would find a 17 MB MLP matrix in the cache and give a floor no decoding step can reach (measured on the 2-core
    Xeon VM of benchmarks/HISTORY.md's sixth set: an 8-row MLP product 0.78 ms cached, 1.15 ms from memory; an
    attention projection 0.11 vs 0.24 ms; the LM head 32.9 vs 34.7 ms)."""
    import itertools

    import torch

    decoding = m <= 64
    mm, kk, nn = (m, k, n) if decoding else (min(m, slab[0]), min(k, slab[1]), min(n, slab[2]))
    copies = cold_weight_copies(nn, kk, cold_bytes) if decoding else 1
    a = torch.randn(mm, kk)
    # (product, stored weight's shape): nn.Linear's [n, k] read transposed, the same weight stored [k, n], oneDNN
    layouts = [(lambda w: a @ w.t(), (nn, kk)), (lambda w: a @ w, (kk, nn))]
    if decoding and torch.backends.mkldnn.is_available():
        from rlhf_trl.cpu import onednn_linear

        layouts.append((lambda w: onednn_linear(a, w, None), (nn, kk)))
    best = float("inf")
    for product, shape in layouts:
        turn = itertools.cycle([torch.randn(*shape) for _ in range(copies)])

        def kernel(product=product, turn=turn):
            return product(next(turn))

        for _ in range(copies):  # every copy touched once: no first-touch page faults in the timed runs
            kernel()
        best = min(best, *(_timed(kernel) for _ in range(repeats)))
        del turn, kernel  # this layout's copies go before the next layout's are made: 1 GiB at a time
    return best * (m * k * n) / (mm * kk * nn)


def cold_weight_copies(n: int, k: int, cold_bytes: int = 1 << 30) -> int:
    """How many distinct fp32 ``[n, k]`` weights `gemm_seconds` cycles through so that together they hold at least
    ``cold_bytes`` (at least 2)."""
    return max(2, -(-cold_bytes // (4 * n * k)))


def other_gemms(cfg: dict, shape: dict, settings: dict, lean: bool, full_head: bool = True,
                single_value_forward: bool = False, fused_lora: bool = False, recompute: bool = False,
                read_cut: bool = False) -> dict:
    """The matrix products of one PPO update that `update_gemms` leaves out, by phase: ``{phase: {(b, m, k, n):
    count}}``, ``b`` products ``[m, k] @ [k, n]`` (a batched product over sequences x heads; b = 1: a plain one)
    ``count`` times (a float: a causal attention product over a square counts 1/2, the half no implementation needs).
      attention     ``QK^T`` and ``PV`` of every forward (prefill, each decoding step against its cache, the scoring
                    forwards, the training forwards) and the four input-gradient products of each training backward
      LoRA          the adapters' own products (rank r, `POLICY_LORA`; the value model's `VALUE_LORA` with ``lean``):
                    per token in generation without ``fused_lora`` (with it: one ``B @ A`` merge per projection per
                    ``generate`` call), forward + input and weight gradients in training; none in scoring (the
                    reference and a shared base's reward are the adapter switched off)
      recompute     with gradient checkpointing, each training forward's body (layers, attention, LoRA) once more
    The same arguments as `update_gemms` (plus ``fused_lora`` and ``recompute``, `variant_extras`); ``read_cut`` is
    not modelled here (attention and adapters at full length: the last layer's share of them is under 0.5%)."""
    rows, prompt, seq = shape["rows"], shape["prompt_tokens"], shape["sequence_tokens"]
    new, layers, heads = seq - prompt, cfg["num_hidden_layers"], cfg["num_attention_heads"]
    d = cfg["hidden_size"] // heads
    chunk = min(int(settings.get("local_rollout_forward_batch_size", rows)), rows)
    micro = min(int(settings.get("per_device_train_batch_size", rows)), rows)
    calls, micro_batches = -(-rows // chunk), -(-rows // micro)
    dims = dict(zip(PROJECTIONS, layer_linears(cfg)))
    out = {"generation": {}, "scoring": {}, "optimisation": {}}

    def add(phase, b, m, k, n, count):
        key = (int(b), int(m), int(k), int(n))
        out[phase][key] = out[phase].get(key, 0) + count

    def attention(phase, seqs, queries, keys, count, backward=False):
        half = 0.5 if queries == keys else 1.0  # causal over a square: half of it
        b = seqs * heads
        add(phase, b, queries, d, keys, count * layers * half)  # Q K^T
        add(phase, b, queries, keys, d, count * layers * half)  # P V
        if backward:  # dP = dO V^T; dV = P^T dO, dQ = dS K, dK = dS^T Q
            add(phase, b, queries, d, keys, count * layers * half)
            add(phase, b, keys, queries, d, 3 * count * layers * half)

    def lora(phase, tokens, adapter, count, backward=False):
        r, targets = adapter
        for name in targets:
            i, o = dims[name]
            add(phase, 1, tokens, i, r, count * layers)  # x A^T
            add(phase, 1, tokens, r, o, count * layers)  # (x A^T) B^T
            if backward:
                add(phase, 1, tokens, o, r, count * layers)  # dY B
                add(phase, 1, o, tokens, r, count * layers)  # dB = dY^T (x A^T)
                add(phase, 1, r, tokens, i, count * layers)  # dA = (dY B)^T x
                add(phase, 1, tokens, r, i, count * layers)  # dx += (dY B) A

    def body_forward(phase, tokens, count):
        for i, o in layer_linears(cfg):
            add(phase, 1, tokens, i, o, count * layers)

    attention("generation", chunk, prompt, prompt, calls)
    for step in range(1, new):  # decoding step t feeds token t against prompt + t cached positions
        attention("generation", chunk, 1, prompt + step, calls)
    if fused_lora:
        for name in POLICY_LORA[1]:
            i, o = dims[name]
            add("generation", 1, o, POLICY_LORA[0], i, calls * layers)  # B @ A, once per generate call
    else:
        lora("generation", chunk * prompt, POLICY_LORA, calls)
        lora("generation", chunk, POLICY_LORA, calls * (new - 1))
    value_in_scoring = not single_value_forward
    attention("scoring", chunk, seq, seq, calls * (3 if value_in_scoring else 2))  # reference, reward (, value)
    if lean and value_in_scoring:
        lora("scoring", chunk * seq, VALUE_LORA, calls)
    tokens = micro * seq
    for adapter in (POLICY_LORA, VALUE_LORA if lean else None):
        attention("optimisation", micro, seq, seq, micro_batches, backward=True)
        if adapter:
            lora("optimisation", tokens, adapter, micro_batches, backward=True)
        if recompute:
            body_forward("optimisation", tokens, micro_batches)
            attention("optimisation", micro, seq, seq, micro_batches)
            if adapter:
                lora("optimisation", tokens, adapter, micro_batches)
    return out


def product_seconds(*key: int, repeats: int = 5) -> float:
    """Seconds of one product of the floor: an `other_gemms` key ``(b, m, k, n)``, ``b`` fp32 ``[m, k] @ [k, n]``
    products in one ``torch.bmm``, the best of ``repeats`` runs on warm operands (the lower bound: attention's
    operands are a few MB, an adapter's weights a few hundred KB); an `update_gemms` key ``(m, k, n)``:
    `gemm_seconds`."""
    if len(key) == 3:
        return gemm_seconds(*key, repeats=repeats)
    return best_bmm_seconds(*bmm_operands(*key), repeats)


def bmm_operands(b: int, m: int, k: int, n: int):
    """Random fp32 operands ``[b, m, k]``, ``[b, k, n]`` of one ``torch.bmm``, warmed by one product (`PhaseMeter`
    keeps the `CANARY`'s for the run: no fresh pages at each phase's end)."""
    import torch

    x, y = torch.randn(b, m, k), torch.randn(b, k, n)
    torch.bmm(x, y)
    return x, y


def best_bmm_seconds(x, y, repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``torch.bmm(x, y)``, in seconds."""
    import torch

    return min(_timed(lambda: torch.bmm(x, y)) for _ in range(repeats))


def matmul_floor(gemms: dict, timings: dict, timer=gemm_seconds) -> dict:
    """Seconds of each phase's products (`update_gemms` or `other_gemms`) timed one shape at a time: a lower bound for
    any implementation of the update on this machine with these kernels. ``timings`` caches ``{key: seconds}`` (keys
    ``(m, k, n)`` or ``(b, m, k, n)``) across variants (filled here with ``timer(*key)``)."""
    floor = {}
    for phase, products in gemms.items():
        for key in products:
            if key not in timings:
                timings[key] = timer(*key)
        floor[phase] = sum(count * timings[key] for key, count in products.items())
    return floor


def trl_size(size: dict, micro: int) -> dict:
    """``size`` with micro-batches of ``micro`` episodes and the same episodes per update (rollout chunks as before:
    they run without gradients)."""
    batch = size["per_device_train_batch_size"] * size["gradient_accumulation_steps"]
    if batch % micro:
        raise SystemExit(f"bench_real: micro-batch {micro} (--trl_micro_batch / --engine_micro_batch) does not divide "
                         f"the batch of {batch} episodes")
    return dict(size, per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro)


def micro_batch(args, variant: str) -> int | None:
    """The micro-batch a variant runs at: ``--trl_micro_batch`` for plain_trl, ``--engine_micro_batch`` for the
    engine's variants (None: the size's own)."""
    return args.trl_micro_batch if variant == "plain_trl" else args.engine_micro_batch


def run_settings(run: dict, size: dict, micro: int | None) -> dict:
    """The settings a variant's run used (micro-batches, rollout chunks): those its ``<variant>.json`` recorded, so
    that a run reused with other ``--*_micro_batch`` flags keeps its own floor; else (a run saved before runs recorded
    them) ``size`` at ``micro`` (`trl_size`; None: the size's own)."""
    return run.get("settings") or (trl_size(size, micro) if micro else size)


def child_env(variant: str, trl_huge_pages: bool = False) -> dict:
    """The environment of a variant's process: an engine variant's with ``THP_MEM_ALLOC_ENABLE=1``, as the
    ``rlhf-trl`` command runs every stage; plain_trl's with ``0``, as a plain script runs, unless ``trl_huge_pages``."""
    huge_pages = variant != "plain_trl" or trl_huge_pages
    return dict(os.environ, THP_MEM_ALLOC_ENABLE="1" if huge_pages else "0")


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def variant_work(run: dict) -> dict:
    """What one run's update computes, for `phase_flops` and `update_gemms`: ``lean`` (a LoRA value model),
    ``full_head`` (TRL 1.12's logits at every position), ``single_value_forward`` (no value forward in scoring) and
    ``read_cut`` (the last decoder layer at the read positions only: engine runs since `rlhf_trl.last_layer`)."""
    return {"lean": run["variant"] == "rlhf_trl_lean", "full_head": run["variant"] == "plain_trl",
            "single_value_forward": run.get("single_value_forward", False), "read_cut": run.get("read_cut", False)}


def variant_extras(run: dict) -> dict:
    """What `other_gemms` needs beyond `variant_work`: ``fused_lora`` (the rollout generates on merged copies: no
    adapter products per token) and ``recompute`` (gradient checkpointing: each training forward runs twice)."""
    extra = EXTRA.get(run["variant"], [])
    return {"fused_lora": "--fused_lora" in extra, "recompute": "--gradient_checkpointing" in extra}


def timed_updates(run: dict) -> list[dict]:
    """A run's timed updates: all but the first (the warm-up), or the one update of a single-update run."""
    return run["updates"][1:] if len(run["updates"]) > 1 else run["updates"]


def summarise(run: dict, n: dict, size: dict, probe: float, base_bytes: int) -> dict:
    """One variant's figures; its FLOP rates against the higher of ``probe`` (the parent's) and the rate its own
    process measured before the run: the machine's best, so that a slow probe never flatters a variant."""
    probe = max(probe, run.get("matmul_probe_flops", 0.0))
    timed = timed_updates(run)
    flops = phase_flops(n, run["shape"], size, **variant_work(run))
    out = {"updates_timed": len(timed), "shape": run["shape"], "threads": run["threads"],
           "huge_pages": run.get("huge_pages", False), "single_value_forward": run.get("single_value_forward", False),
           "peak_rss_bytes": run["peak_rss_bytes"], "peak_rss_model_copies": run["peak_rss_bytes"] / base_bytes}
    total = 0.0
    for phase in ("generation", "scoring", "optimisation"):
        sec = median(u[f"{phase}_seconds"] for u in timed)
        total += sec
        out[phase] = {
            "seconds": sec, "system_cpu_seconds": median(u.get(f"{phase}_system_cpu_seconds", 0.0) for u in timed),
            "gflop": flops[phase] / 1e9, "gflop_per_second": flops[phase] / sec / 1e9,
            "fraction_of_matmul_rate": flops[phase] / sec / probe,
            "peak_rss_bytes": max(u[f"{phase}_peak_rss_bytes"] for u in timed),
            "peak_rss_model_copies": max(u[f"{phase}_peak_rss_bytes"] for u in timed) / base_bytes,
            "largest_logits_bytes": max(u[f"{phase}_largest_logits_bytes"] for u in timed),
        }
    out["seconds_per_update"] = total
    out["matmul_probe_gflop_per_second"] = probe / 1e9
    out["matmul_seconds_at_probe_rate"] = sum(flops.values()) / probe
    out["seconds_vs_matmul_work"] = total / out["matmul_seconds_at_probe_rate"]
    return out


def load_timings(path: Path) -> dict:
    """``{(m, k, n) or (b, m, k, n): seconds}`` from a `save_timings` file; empty when there is none."""
    if not path.is_file():
        return {}
    return {tuple(row[:-1]): row[-1] for row in json.loads(path.read_text())}


def save_timings(path: Path, timings: dict) -> None:
    path.write_text(json.dumps([[*key, sec] for key, sec in sorted(timings.items())]))


def add_floor(out: dict, run: dict, cfg: dict, settings: dict, timings: dict, timer=None) -> None:
    """Adds to a variant's summary ``out`` its matmul floor (`update_gemms` of its own run: shape, micro-batches,
    LM-head span, value forward) in seconds per phase and in all, and ``seconds_vs_matmul_floor``; and the floor of
    all its products (`other_gemms` too: attention, LoRA, recomputed forwards), ``matmul_floor_all_seconds`` and
    ``seconds_vs_matmul_floor_all``. ``timer(*key)``: seconds of one product, ``(m, k, n)`` or ``(b, m, k, n)``."""
    timer = timer or product_seconds
    gemms = update_gemms(cfg, run["shape"], settings, **variant_work(run))
    floor = matmul_floor(gemms, timings, timer)
    out["matmul_floor_seconds"] = dict(floor, total=sum(floor.values()))
    out["seconds_vs_matmul_floor"] = out["seconds_per_update"] / out["matmul_floor_seconds"]["total"]
    other = matmul_floor(other_gemms(cfg, run["shape"], settings, **variant_work(run), **variant_extras(run)),
                         timings, timer)
    every = {phase: floor[phase] + other[phase] for phase in floor}
    out["matmul_floor_all_seconds"] = dict(every, total=sum(every.values()))
    out["seconds_vs_matmul_floor_all"] = out["seconds_per_update"] / out["matmul_floor_all_seconds"]["total"]


def canaries(run: dict) -> list[float]:
    """Every `CANARY` timing a run recorded (none for a run saved before runs recorded them)."""
    return [c for u in run["updates"] for k, v in u.items() if k.endswith("_canary_seconds") for c in v]


def phase_canary(canaries_: list[float], pieces: list[float] | None) -> float:
    """One phase's canary in one update: each piece's faster canary (the one before it or the one after it: a brief
    stall at one end does not count against the machine), weighted by the piece's seconds (``pieces``; equal weights
    for a run saved without them)."""
    fastest = [min(canaries_[i], canaries_[i + 1]) for i in range(0, len(canaries_), 2)]
    weights = pieces if pieces and len(pieces) == len(fastest) and sum(pieces) > 0 else [1.0] * len(fastest)
    return sum(w * c for w, c in zip(weights, fastest)) / sum(weights)


def run_speed(run: dict, canary_best: float) -> dict | None:
    """How much slower than its best (``canary_best`` seconds, the fastest `CANARY` timing of the machine) the
    machine ran the products during each phase of ``run``: per phase, its `phase_canary` over ``canary_best``, the
    median over the timed updates (as `summarise` takes the phase's seconds). ``{phase: x}``, each >= 1 when
    ``canary_best`` is the best; None for a run without canaries."""
    timed = timed_updates(run)
    speed = {}
    for phase in ("generation", "scoring", "optimisation"):
        x = [phase_canary(c, u.get(f"{phase}_canary_piece_seconds")) / canary_best
             for u in timed if (c := u.get(f"{phase}_canary_seconds"))]
        if not x:
            return None
        speed[phase] = median(x)
    return speed


def add_run_speed(out: dict, speed: dict | None) -> None:
    """Adds to a variant's summary ``out`` (after `add_floor`) the floor of all its products at the speed the machine
    ran them during the run (`run_speed`: each phase's floor times its slowdown),
    ``matmul_floor_all_at_run_speed_seconds`` and ``seconds_vs_matmul_floor_all_at_run_speed``, and ``run_speed``
    (per phase and ``update``: the floor-weighted slowdown of the whole update). Nothing without canaries."""
    if speed is None or "matmul_floor_all_seconds" not in out:
        return
    floor = out["matmul_floor_all_seconds"]
    at_speed = {phase: floor[phase] * x for phase, x in speed.items()}
    out["matmul_floor_all_at_run_speed_seconds"] = dict(at_speed, total=sum(at_speed.values()))
    out["seconds_vs_matmul_floor_all_at_run_speed"] = out["seconds_per_update"] / sum(at_speed.values())
    out["run_speed"] = dict(speed, update=sum(at_speed.values()) / floor["total"])


def add_trl_ratios(variants: dict) -> None:
    """Each summary of ``variants`` against plain_trl's: ``seconds_vs_plain_trl``, ``peak_rss_vs_plain_trl`` and,
    where both runs timed canaries, ``seconds_vs_plain_trl_at_run_speed``: each side's seconds divided by its own
    `run_speed` (the update's), i.e. both as at the machine's best speed. Nothing without a plain_trl run."""
    trl = variants.get("plain_trl", {})
    if "seconds_per_update" not in trl:
        return
    for r in variants.values():
        if "seconds_per_update" in r:
            r["seconds_vs_plain_trl"] = r["seconds_per_update"] / trl["seconds_per_update"]
            r["peak_rss_vs_plain_trl"] = r["peak_rss_bytes"] / trl["peak_rss_bytes"]
            if "run_speed" in r and "run_speed" in trl:
                r["seconds_vs_plain_trl_at_run_speed"] = (r["seconds_per_update"] / r["run_speed"]["update"]) / (
                    trl["seconds_per_update"] / trl["run_speed"]["update"])


def write_markdown(bench: dict, path: Path) -> None:
    shapes = [r["shape"] for r in bench["variants"].values() if "shape" in r]
    tokens = (f", prompts {shapes[0]['prompt_tokens']} + response <= {shapes[0]['sequence_tokens'] - shapes[0]['prompt_tokens']}"
              f" tokens" if shapes else "")
    lines = [f"# PPO on real weights ({bench['model_name']}, {bench['size']}: {bench['settings']}, "
             f"{bench.get('prompt_set', 'short')} prompts{tokens})", "",
             f"fp32 matmul probe: {bench['matmul_gflop_per_second']:.1f} GFLOP/s; one base model in fp32: "
             f"{bench['base_model_bytes'] / GB:.2f} GB", "",
             "| variant | s/update | generation s | scoring s | optimisation s | x matmul work | matmul floor s (x) "
             "| all products' floor s (x) | peak RSS GB (copies) | gen / score / opt peak copies "
             "| largest logits MB (gen / score / opt) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in bench["variants"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:80]} |")
            continue
        g, s, o = r["generation"], r["scoring"], r["optimisation"]
        lines.append(
            f"| {name} | {r['seconds_per_update']:.1f} | {g['seconds']:.1f} ({g['fraction_of_matmul_rate']:.0%}) | "
            f"{s['seconds']:.1f} ({s['fraction_of_matmul_rate']:.0%}) | {o['seconds']:.1f} "
            f"({o['fraction_of_matmul_rate']:.0%}) | {r['seconds_vs_matmul_work']:.2f} | "
            + (f"{r['matmul_floor_seconds']['total']:.1f} ({r['seconds_vs_matmul_floor']:.2f}) | "
               if "matmul_floor_seconds" in r else "- | ") +
            (f"{r['matmul_floor_all_seconds']['total']:.1f} ({r['seconds_vs_matmul_floor_all']:.2f}) | "
             if "matmul_floor_all_seconds" in r else "- | ") +
            f"{r['peak_rss_bytes'] / GB:.1f} ({r['peak_rss_model_copies']:.1f}) | "
            f"{g['peak_rss_model_copies']:.1f} / {s['peak_rss_model_copies']:.1f} / {o['peak_rss_model_copies']:.1f} | "
            f"{g['largest_logits_bytes'] / 1e6:.0f} / {s['largest_logits_bytes'] / 1e6:.0f} / "
            f"{o['largest_logits_bytes'] / 1e6:.0f} |")
    for name, r in bench["variants"].items():
        if r.get("settings") and r["settings"] != bench["settings"]:
            lines += ["", f"{name} ran with {r['settings']} (`--trl_micro_batch` / `--engine_micro_batch`: the same "
                          "episodes per update in smaller micro-batches)."]
    thp = [k for k, r in bench["variants"].items() if r.get("huge_pages")]
    lines += ["", "Transparent huge pages for PyTorch's CPU tensors (`THP_MEM_ALLOC_ENABLE=1`, what `rlhf-trl` sets): "
              + (", ".join(thp) if thp else "none") + "."]
    lines += ["", "Phase percentages: achieved FLOP rate / matmul probe rate (per variant, the higher of the probe above "
              "and the one its own process measured before its run: " + ", ".join(
                  f"{k} {r['matmul_probe_gflop_per_second']:.1f}" for k, r in bench["variants"].items()
                  if "matmul_probe_gflop_per_second" in r) + " GFLOP/s). `x matmul work`: seconds per update / "
              "(estimated matmul FLOPs of the update / probe rate). Peak RSS copies: peak RSS / bytes of one fp32 "
              "base model (the figure includes the Python and library baseline). See benchmarks/bench_real.py."]
    lines += ["", "Matmul floor: the update's layer and LM-head products (`update_gemms`: the variant's own shapes, "
              "micro-batches and LM-head span) each timed alone in the parent between the runs, the best of two "
              "operand layouts (and of oneDNN for decoding's few rows), summed (per phase in bench_real.json); "
              "attention's products, elementwise passes, AdamW and sampling left out: a lower bound for any "
              "implementation of the same update here. (x): s/update / floor. All products' floor: the same plus "
              "the products `update_gemms` leaves out (`other_gemms`): attention's QK^T and PV (and their input "
              "gradients; half of each causal square), the LoRA adapters' own products, and with gradient "
              "checkpointing the recomputed forwards; each timed alone the same way."]
    paced = {k: r for k, r in bench["variants"].items() if "run_speed" in r}
    if paced:
        lines += ["", "At the machine's speed during each run (the `CANARY` product, "
                  f"{'x'.join(map(str, CANARY[1:]))}, timed around every phase; its best: "
                  f"{bench['canary_best_seconds'] * 1e3:.1f} ms):", "",
                  "| variant | run speed: generation / scoring / optimisation / update (x slower than best) "
                  "| all products' floor at run speed s (x) | vs plain_trl, both at their run speed |",
                  "|---|---|---|---|"]
        for name, r in paced.items():
            v = r["run_speed"]
            lines.append(f"| {name} | {v['generation']:.2f} / {v['scoring']:.2f} / {v['optimisation']:.2f} / "
                         f"{v['update']:.2f} | {r['matmul_floor_all_at_run_speed_seconds']['total']:.1f} "
                         f"({r['seconds_vs_matmul_floor_all_at_run_speed']:.2f}) | "
                         + (f"{r['seconds_vs_plain_trl_at_run_speed']:.2f}x |"
                            if "seconds_vs_plain_trl_at_run_speed" in r else "- |"))
    trl = bench["variants"].get("plain_trl", {})
    if "seconds_per_update" in trl and any("seconds_vs_plain_trl" in r for k, r in bench["variants"].items()
                                           if k != "plain_trl"):
        floor = {k: r["matmul_floor_seconds"]["total"] for k, r in bench["variants"].items()
                 if k != "plain_trl" and "matmul_floor_seconds" in r}
        floors = [f"{k} {s:.1f} s ({s / trl['seconds_per_update']:.2f}x)" for k, s in floor.items()]
        lines += ["", f"vs plain_trl ({trl['seconds_per_update']:.1f} s/update): "
                  + ", ".join(f"{k} {r['seconds_vs_plain_trl']:.2f}x s, {r['peak_rss_vs_plain_trl']:.2f}x peak RSS"
                              for k, r in bench["variants"].items()
                              if k != "plain_trl" and "seconds_vs_plain_trl" in r)
                  + (". Matmul floors: " + ", ".join(floors) if floors else "") + "."]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def resolve_model(model: str | None) -> str:
    if model:
        return model
    if not FETCH.is_file():
        sys.exit(f"bench_real: no --model and no {FETCH}")
    proc = subprocess.run(["bash", str(FETCH)], capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable))
    if proc.returncode != 0:
        sys.exit(f"bench_real: {FETCH} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return proc.stdout.strip().splitlines()[-1]


def long_prompts(model: str, n: int = 64, min_tokens: int = 256) -> list[dict]:
    """Real zh prompts of at least ``min_tokens`` tokens (the issue's "prompts <= 256 tokens" filled to the limit):
    the last human turn of ``dpo_zh_demo.json`` and ``reward_dpo_zh_500.jsonl`` (task statements with passages,
    code, examples), counted with the model's tokenizer; empty when ``../shared`` is absent."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = []
    for path in LONG_PROMPTS:
        if not path.is_file():
            continue
        rows = json.load(open(path, encoding="utf-8")) if path.suffix == ".json" else \
            [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
        texts += [[c["value"] for c in r["conversations"] if c["from"] == "human"][-1] for r in rows]
    long = [t for t in texts if len(tok(f"问：{t}\n\n答：", add_special_tokens=False)["input_ids"]) >= min_tokens]
    return [{"instruction": t} for t in long[:n]]


def write_prompts(path: Path, prompt_set: str = "short", model: str | None = None, n: int = 64) -> str:
    """The benchmark's prompt file (``instruction`` rows): ``short`` = the cvalues prompts (~25 tokens), ``long`` =
    `long_prompts` (every prompt cut to ``max_prompt_length`` 256 tokens); generated ones without ``../shared``."""
    rows = []
    if prompt_set == "long":
        rows = long_prompts(model, n)
    elif PROMPTS.is_file():
        rows = [{"instruction": json.loads(line)["prompt"]} for line in open(PROMPTS, encoding="utf-8")][:n]
    if not rows:
        rows = [{"instruction": f"请简单介绍一下第{i}个中国城市的历史和文化。" * (12 if prompt_set == "long" else 1)}
                for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(path)


TRL112_REQUIREMENTS = ["torch==2.13.0", "trl==1.12.0", "transformers>=5.24,<6", "peft>=0.21", "accelerate>=1.15",
                       "datasets>=5.2", "tokenizers>=0.22", "pyyaml", "pandas", "rich"]


def trl112_python(venv: Path) -> str:
    """The python of a venv holding trl 1.12.0 (the last release with PPOTrainer), built on first use (~2 min with
    the package registry reachable). The plain_trl variant needs no rlhf_trl import."""
    python = venv / "bin" / "python"
    ok = python.is_file() and subprocess.run([str(python), "-c", "import trl, sys; sys.exit(trl.__version__ != '1.12.0')"],
                                             capture_output=True).returncode == 0
    if not ok:
        print(f"bench_real: building {venv} (trl==1.12.0) for the plain_trl variant ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL112_REQUIREMENTS], check=True)
    return str(python)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a Qwen2 / Qwen2.5 directory (default: fetch the 0.5B Instruct)")
    p.add_argument("--output_dir", default="outputs/bench-real")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--prompt_set", choices=("short", "long"), default=None,
                   help="short: the cvalues prompts (~25 tokens); long: real prompts of >= 256 tokens, cut to 256 "
                        "(default: long for --size issue, whose setting says prompts <= 256 tokens; else short)")
    p.add_argument("--updates", type=int, default=2, help="PPO updates per variant (the first is a warm-up)")
    p.add_argument("--keep_runs", action="store_true", help="keep each variant's output_dir (runs/<variant>: the "
                   "merged policy and value model, ~4 GB); by default removed once its figures are read")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--trl_micro_batch", type=int, default=None,
                   help="plain_trl only: micro-batches of this many episodes (per_device_train_batch_size, with "
                        "gradient_accumulation_steps making up the same batch) when the size's one does not fit in "
                        "memory: TRL 1.12 at --size issue with long prompts is killed for memory at 8 (24 GB)")
    p.add_argument("--engine_micro_batch", type=int, default=None,
                   help="the engine's variants: micro-batches of this many episodes (as --trl_micro_batch), e.g. "
                        "to compare both at TRL's micro-batch")
    p.add_argument("--trl_huge_pages", action="store_true",
                   help="plain_trl only: run it with THP_MEM_ALLOC_ENABLE=1 (PyTorch's large CPU tensors on "
                        "transparent huge pages), as `rlhf-trl` runs the engine; by default it runs as a plain script "
                        "does, without")
    p.add_argument("--reuse", action="store_true", help="summarise a variant's earlier <output_dir>/<variant>.json "
                   "(same size and prompts) instead of running it again: one table from runs made one at a time; the matmul "
                   "floor's shapes are timed again and the faster of that and the saved timing counts")
    p.add_argument("--trl112_venv", default=str(REPO / ".venv-trl112"),
                   help="venv with trl==1.12.0 for the plain_trl variant (built if missing)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out_dir = Path(args.output_dir)
    size = SIZES[args.size]
    if args.child:
        if micro_batch(args, args.child):
            size = trl_size(size, micro_batch(args, args.child))
        child(args.child, args.model, args.prompts, out_dir / "runs", Path(args.out), size, args.updates)
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = resolve_model(args.model)
    prompt_set = args.prompt_set or ("long" if args.size == "issue" else "short")
    prompts = write_prompts(out_dir / "prompts.jsonl", prompt_set, model)
    probe = matmul_probe(repeats=10)
    cfg = model_config(model)
    n = param_counts(cfg)
    # (m, k, n) -> seconds: each product shape timed once, in the parent, between variants. With --reuse the shapes
    # are timed again and the faster of that and the earlier timing (matmul_floor_timings.v2.json) counts: the VM's
    # rate moves by tens of percent over minutes, and a floor is the machine's best.
    # v2: decoding's products timed on uncached weights; the first file's cached timings would win every minimum
    timings_path = out_dir / "matmul_floor_timings.v2.json"
    earlier = load_timings(timings_path) if args.reuse else {}
    timings: dict = {}

    def timer(*key):
        return min(product_seconds(*key), earlier.get(key, float("inf")))
    base_bytes = 4 * n["total"]  # fp32 weights of one base model (embeddings and LM head included)
    bench = {"model": model, "model_name": os.path.basename(model.rstrip("/")), "size": args.size, "settings": size,
             "prompt_set": prompt_set,
             "updates": args.updates, "matmul_gflop_per_second": probe / 1e9, "parameters": n,
             "base_model_bytes": base_bytes, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
             "variants": {}}
    runs = {}
    for variant in args.variants.split(","):
        run_json = out_dir / f"{variant}.json"
        python = sys.executable
        if variant == "plain_trl":  # TRL 1.12's PPOTrainer lives only in trl 1.12: its own venv
            python = trl112_python(Path(args.trl112_venv))
            bench["trl112_venv"] = args.trl112_venv
        cmd = [python, __file__, "--child", variant, "--model", model, "--prompts", prompts,
               "--out", str(run_json), "--output_dir", str(out_dir), "--size", args.size, "--updates", str(args.updates)]
        micro = micro_batch(args, variant)
        if micro:
            cmd += [f"--{'trl' if variant == 'plain_trl' else 'engine'}_micro_batch", str(micro)]
        reused = args.reuse and run_json.is_file()
        print(f"bench_real: {variant}: reusing {run_json}" if reused else f"bench_real: {variant} ...", flush=True)
        t = time.perf_counter()
        if not reused:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(variant, args.trl_huge_pages))
            if proc.returncode != 0:
                bench["variants"][variant] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
                (out_dir / f"{variant}.log").write_text(proc.stderr)
                continue
        run = runs[variant] = json.load(open(run_json))
        settings = run_settings(run, size, micro)
        bench["variants"][variant] = summarise(run, n, size, probe, base_bytes)
        bench["variants"][variant]["settings"] = settings
        add_floor(bench["variants"][variant], run, cfg, settings, timings, timer)
        save_timings(timings_path, {**earlier, **timings})
        if not reused:
            bench["variants"][variant]["wall_seconds"] = time.perf_counter() - t
        if not args.keep_runs:  # a run's merged policy and value model: ~4 GB each, not needed for the figures
            shutil.rmtree(out_dir / "runs" / variant, ignore_errors=True)
    # the machine's best canary: the parent's timing now, the saved one and every run's own (a floor is the best)
    canary_best = min([timer(*CANARY)] + [c for run in runs.values() for c in canaries(run)])
    timings[CANARY] = canary_best
    save_timings(timings_path, {**earlier, **timings})
    bench["canary_best_seconds"] = canary_best
    for variant, run in runs.items():
        add_run_speed(bench["variants"][variant], run_speed(run, canary_best))
    add_trl_ratios(bench["variants"])
    (out_dir / "bench_real.json").write_text(json.dumps(bench, indent=2))
    write_markdown(bench, out_dir / "bench_real.md")
    print((out_dir / "bench_real.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
