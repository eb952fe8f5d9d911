"""GPU check: a few timed steps of each stage (SFT, RM, PPO) on a Qwen2.5-0.5B-shaped model, in bf16.

Builds everything locally (no hub, no ../shared): a byte-level BPE tokenizer trained on the demo task's text
(`rlhf_trl.tiny.train_bpe_tokenizer`), a random-init Qwen2 of Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads,
2 KV heads, intermediate 4864, vocab 151936, tied embeddings; `rlhf_trl.tiny.build_tiny_qwen2`) and synthetic
data from `rlhf_trl.demo_task` padded to ``--seq_len`` tokens. Then it runs ``rlhf_trl.sft.main``,
``rlhf_trl.rm.main`` and ``rlhf_trl.ppo.main`` with the recipe set ``--recipes`` (default ``recipes/qwen2.5-0.5b``:
LoRA, gradient checkpointing, the recipe's batch sizes) plus overrides (a few steps, bf16, no eval / saves), times
every step with a `TrainerCallback` and writes one JSON file (default ``outputs/gpu_check/gpu_check.json``):

    {"device", "device_type", "versions": {python, torch, transformers, trl, peft, accelerate, datasets}, "dtype",
     "shape", "model": {hidden_size, num_layers, ..., vocab_size, parameters}, "tokenizer_vocab", "recipes",
     "stages": {"sft"|"rm"|"ppo": {"steps", "steps_requested", "step_seconds", "seconds_per_step_median"
                (first warm-up step excluded), "tokens_per_step", "tokens_per_second", "peak_memory_gib",
                "memory_kind", "stage_seconds", "last_log", ...}},
     "total_seconds"}

Tokens: SFT and RM count the input tokens of each batch, padding included (TrainingArguments'
include_num_input_tokens_seen; chosen and rejected both count for RM); PPO counts each update's episodes x (mean
prompt tokens + response_length), the rollout length (a random-init policy hardly ever samples EOS).
Memory: on CUDA ``torch.cuda.max_memory_allocated`` over the whole stage (loading, training, merging); on CPU the
peak resident set size of this process during the stage (sampled every 20 ms).

Shapes: ``--shape 0.5b`` (default where CUDA is available) or ``--shape tiny`` / ``--tiny`` (default without CUDA:
hidden 64, 2 layers, vocab 1024, the demo recipes; well under 2 minutes on 2 CPU cores; tested by
tests/test_gpu_check.py).

Run here:  ``make gpu-check`` or ``benchmarks/gpu_check.sh [--tiny] [--output PATH]``
Run on a GPU machine: see the header of benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
try:
    import rlhf_trl  # noqa: F401
except ImportError:  # not installed (e.g. a GPU machine's system python): use the source tree
    sys.path.insert(0, str(REPO / "src"))

logger = logging.getLogger("gpu_check")

# Qwen/Qwen2.5-0.5B's config.json, minus the weights
QWEN25_05B = dict(
    hidden_size=896, num_layers=24, num_heads=14, num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=1024,
    max_position_embeddings=512, tie_word_embeddings=True,
)
SHAPES = {
    # model, recipe set, SFT/RM steps, PPO updates, tokens per SFT row / RM side, prompt tokens, response tokens
    "0.5b": dict(model=QWEN25_05B, recipes="recipes/qwen2.5-0.5b", steps=6, ppo_steps=4, seq_len=512,
                 prompt_len=128, response_length=128),
    "tiny": dict(model=TINY, recipes="recipes/demo", steps=3, ppo_steps=3, seq_len=48, prompt_len=16,
                 response_length=8),
}
WORK_MARKER = ".gpu_check_work"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=["auto", *SHAPES], default="auto",
                   help="model shape and defaults; auto: 0.5b where CUDA is available, else tiny")
    p.add_argument("--tiny", dest="shape", action="store_const", const="tiny", help="same as --shape tiny")
    p.add_argument("--output", default="outputs/gpu_check/gpu_check.json", help="where to write the JSON result")
    p.add_argument("--work_dir", default="outputs/gpu_check/work",
                   help="scratch directory for the model, data and stage outputs (emptied first)")
    p.add_argument("--recipes", help="recipe set to start from (default: the shape's)")
    p.add_argument("--steps", type=int, help="optimizer steps of SFT and of RM (default: the shape's; >= 2)")
    p.add_argument("--ppo_steps", type=int, help="PPO updates (default: the shape's; >= 2)")
    p.add_argument("--seq_len", type=int, help="tokens per SFT row and per RM side (prompt + response)")
    p.add_argument("--prompt_len", type=int, help="tokens per PPO prompt")
    p.add_argument("--response_length", type=int, help="PPO response tokens")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and autocast")
    p.add_argument("--stages", default="sft,rm,ppo", choices=["sft", "sft,rm", "sft,rm,ppo"],
                   metavar="sft|sft,rm|sft,rm,ppo", help="stages to run (each needs the ones before it)")
    p.add_argument("--keep_work_dir", action="store_true", help="keep the models written under --work_dir")
    args = p.parse_args(argv)

    import torch

    if args.shape == "auto":
        args.shape = "0.5b" if torch.cuda.is_available() else "tiny"
    for key, value in SHAPES[args.shape].items():
        if key != "model" and getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 2 or args.ppo_steps < 2:
        p.error("--steps and --ppo_steps must be >= 2 (the first step is a warm-up, excluded from the median)")
    args.stages = args.stages.split(",")
    return args


# -- measuring -------------------------------------------------------------------------------------------------------
def _step_timer_class():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step / PPO update: the interval between consecutive ``on_step_end`` calls
        (the first from ``on_train_begin``), with the GPU synchronized; also input tokens and episodes per step."""

        def __init__(self):
            self.seconds, self.tokens, self.episodes = [], [], []
            self.logs = []

        def _now(self):
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = self._now()
            self._tokens = state.num_input_tokens_seen or 0
            self._episode = getattr(state, "episode", 0) or 0

        def on_step_end(self, args, state, control, **kwargs):
            now = self._now()
            self.seconds.append(now - self._last)
            self._last = now
            tokens, episode = state.num_input_tokens_seen or 0, getattr(state, "episode", 0) or 0
            self.tokens.append(tokens - self._tokens)
            self.episodes.append(episode - self._episode)
            self._tokens, self._episode = tokens, episode

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                self.logs.append(dict(logs))

    return StepTimer()


class PeakMemory:
    """Peak memory over a ``with`` block: CUDA ``max_memory_allocated`` or, on CPU, the process's peak RSS."""

    def __init__(self):
        import torch

        self.cuda = torch.cuda.is_available()
        self.kind = "cuda_max_memory_allocated" if self.cuda else "cpu_peak_rss"
        self.peak_bytes = 0
        self.reserved_bytes = None

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak_bytes = max(self.peak_bytes, self._rss())

    def __enter__(self):
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak_bytes = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()
            self.reserved_bytes = torch.cuda.max_memory_reserved()
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, self._rss())
        return False


def stage_summary(name: str, requested: int, timer, memory: PeakMemory, seconds: float, prompt_tokens: float = 0.0,
                  response_length: int = 0) -> dict:
    """Per-stage numbers for the JSON file; the first (warm-up) step is left out of the median and the rates."""
    timed = timer.seconds[1:] if len(timer.seconds) > 1 else timer.seconds
    if name == "ppo":  # episodes x rollout length (prompt + response)
        tokens = [e * (prompt_tokens + response_length) for e in timer.episodes]
    else:  # input tokens (padded batches) the trainer counted
        tokens = list(timer.tokens)
    timed_tokens = tokens[1:] if len(tokens) > 1 else tokens
    out = {
        "steps": len(timer.seconds),
        "steps_requested": requested,
        "step_seconds": [round(s, 4) for s in timer.seconds],
        "seconds_per_step_median": round(statistics.median(timed), 4) if timed else None,
        "tokens_per_step": round(statistics.median(timed_tokens), 1) if timed_tokens else None,
        "tokens_per_second": round(sum(timed_tokens) / sum(timed), 1) if timed and sum(timed) > 0 else None,
        "peak_memory_gib": round(memory.peak_bytes / 2**30, 3),
        "memory_kind": memory.kind,
        "stage_seconds": round(seconds, 2),
    }
    if memory.reserved_bytes is not None:
        out["peak_reserved_gib"] = round(memory.reserved_bytes / 2**30, 3)
    if name == "ppo":
        out["episodes_per_step"] = statistics.median(timer.episodes[1:] or timer.episodes)
        out["episodes_per_second"] = round(sum(timer.episodes[1:]) / sum(timed), 2) if len(timer.episodes) > 1 else None
        out["prompt_tokens_mean"] = round(prompt_tokens, 1)
        out["response_length"] = response_length
    last = {}
    for log in timer.logs:  # the latest value of each numeric key
        last.update({k: v for k, v in log.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    out["last_log"] = last
    return out


def cpu_name() -> str:
    """The CPU model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


# -- assets ----------------------------------------------------------------------------------------------------------
def prepare_work_dir(path: str) -> None:
    """Empty ``path`` if it is a previous gpu_check work directory (never an unrelated non-empty directory)."""
    if os.path.isdir(path) and os.listdir(path):
        if not os.path.exists(os.path.join(path, WORK_MARKER)):
            raise SystemExit(f"gpu_check: --work_dir {path} is not empty and not a gpu_check work directory")
        shutil.rmtree(path)
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, WORK_MARKER), "w").close()


def _write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def build_data(tokenizer, work: str, n_sft: int, n_rm: int, n_prompts: int, seq_len: int, prompt_len: int,
               seed: int = 0) -> dict:
    """Demo-task rows made long: answers of several demo sentences, about ``seq_len`` tokens per SFT row and per RM
    side (prompt included), PPO prompts of about ``prompt_len`` tokens. Returns paths and the mean prompt tokens."""
    from rlhf_trl import demo_task
    from rlhf_trl.data import DEFAULT_PROMPT_TEMPLATE

    rng = random.Random(seed)
    topics = demo_task.TRAIN_TOPICS

    def ntok(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    sample = [demo_task.answer(rng.choice(topics), rng.choice((1, -1)), rng) for _ in range(100)]
    per_sentence = max(1.0, sum(ntok(s) for s in sample) / len(sample))
    prompt_overhead = ntok(DEFAULT_PROMPT_TEMPLATE.format(question=demo_task.question(topics[0], rng)))

    def text(topic: str, sentiment: int, tokens: int) -> str:
        k = max(1, int(tokens / per_sentence))
        return "".join(demo_task.answer(topic, sentiment, rng) for _ in range(k))

    response_tokens = max(1, seq_len - prompt_overhead - 1)  # -1: EOS
    sft, rm = [], []
    for i in range(n_sft):
        t = rng.choice(topics)
        sft.append({"instruction": demo_task.question(t, rng), "input": "",
                    "output": text(t, 1 if i % 2 else -1, response_tokens)})
    for _ in range(n_rm):
        t = rng.choice(topics)
        rm.append({"prompt": demo_task.question(t, rng), "chosen": text(t, 1, response_tokens),
                   "rejected": text(t, -1, response_tokens)})
    prompts = []
    for _ in range(n_prompts):
        t = rng.choice(topics)
        context = text(t, rng.choice((1, -1)), prompt_len - prompt_overhead) if prompt_len > 2 * prompt_overhead else ""
        prompts.append({"instruction": context + demo_task.question(t, rng)})
    prompt_tokens = [min(prompt_len, ntok(DEFAULT_PROMPT_TEMPLATE.format(question=p["instruction"]))) for p in prompts]
    return {
        "sft": _write_jsonl(os.path.join(work, "sft.jsonl"), sft),
        "rm": _write_jsonl(os.path.join(work, "rm_pairs.jsonl"), rm),
        "prompts": _write_jsonl(os.path.join(work, "prompts.jsonl"), prompts),
        "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens),
    }


def _recipe(recipes: str, stage: str) -> tuple[str, dict]:
    import yaml

    path = os.path.join(recipes, f"{stage}.yaml")
    with open(path, encoding="utf-8") as f:
        return path, yaml.safe_load(f) or {}


def _flags(**kv) -> list[str]:
    argv = []
    for k, v in kv.items():
        argv += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return argv


# -- main ------------------------------------------------------------------------------------------------------------
def run_check(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    from rlhf_trl import ppo, rm, sft
    from rlhf_trl.tiny import build_tiny_qwen2, train_bpe_tokenizer

    start = time.time()
    cuda = torch.cuda.is_available()
    shape = dict(SHAPES[args.shape]["model"])
    recipes = args.recipes if os.path.isabs(args.recipes) or os.path.isdir(args.recipes) else str(REPO / args.recipes)
    work = os.path.abspath(args.work_dir)
    prepare_work_dir(work)

    # tokenizer and model, built locally
    from rlhf_trl import demo_task

    tokenizer = train_bpe_tokenizer(demo_task.corpus(), os.path.join(work, "tokenizer"), vocab_size=600)
    base = os.path.join(work, "base_model")
    t0 = time.time()
    model = build_tiny_qwen2(
        tokenizer, base, hidden_size=shape.pop("hidden_size"), num_layers=shape.pop("num_layers"),
        num_heads=shape.pop("num_heads"), intermediate_size=shape.pop("intermediate_size"),
        max_position_embeddings=shape.pop("max_position_embeddings"), seed=0, **shape,
    )
    cfg = model.config
    model_info = {
        "architecture": type(model).__name__, "hidden_size": cfg.hidden_size, "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings), "parameters": model.num_parameters(),
    }
    del model
    gc.collect()
    build_seconds = time.time() - t0

    # data sized to the recipes' batches
    recipe = {s: _recipe(recipes, s) for s in ("sft", "rm", "ppo")}

    def batch(stage: str) -> int:
        r = recipe[stage][1]
        return int(r.get("per_device_train_batch_size", 8)) * int(r.get("gradient_accumulation_steps", 1))

    ppo_batch = batch("ppo")
    n_eval_prompts = int(recipe["ppo"][1].get("per_device_eval_batch_size", 8))
    data = build_data(
        tokenizer, work, n_sft=args.steps * batch("sft"), n_rm=args.steps * batch("rm"),
        n_prompts=ppo_batch * args.ppo_steps + n_eval_prompts, seq_len=args.seq_len, prompt_len=args.prompt_len,
    )

    common = dict(overwrite_output_dir=True, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                  dtype=args.dtype, bf16=args.dtype == "bfloat16", use_cpu=not cuda)
    trainer_common = dict(eval_strategy="no", eval_split_size=0, max_steps=args.steps, dataloader_num_workers=0,
                          include_num_input_tokens_seen=True)
    out_dirs = {s: os.path.join(work, s) for s in ("sft", "rm", "ppo")}
    max_length = args.seq_len + args.seq_len // 4 + 8  # rows are built to ~seq_len tokens: none dropped or cut
    argvs = {
        "sft": _flags(**common, **trainer_common, dataset_name=data["sft"], dataset_format="alpaca",
                      model_name_or_path=base, output_dir=out_dirs["sft"], max_length=max_length),
        "rm": _flags(**common, **trainer_common, dataset_name=data["rm"], dataset_format="pairwise",
                     model_name_or_path=os.path.join(out_dirs["sft"], "merged"), output_dir=out_dirs["rm"],
                     max_length=max_length),
        "ppo": _flags(**common, dataset_name=data["prompts"], dataset_format="prompt", eval_split_size=n_eval_prompts,
                      max_prompt_length=args.prompt_len, sft_model_path=os.path.join(out_dirs["sft"], "merged"),
                      reward_model_path=os.path.join(out_dirs["rm"], "merged"), output_dir=out_dirs["ppo"],
                      total_episodes=ppo_batch * args.ppo_steps, response_length=args.response_length,
                      reward_baseline="0.0", log_samples_every=0),
    }
    modules = {"sft": sft, "rm": rm, "ppo": ppo}
    requested = {"sft": args.steps, "rm": args.steps, "ppo": args.ppo_steps}

    stages = {}
    for name in args.stages:
        timer = _step_timer_class()
        logger.info("gpu_check: %s, %d steps", name, requested[name])
        t0 = time.time()
        with PeakMemory() as memory:
            result = modules[name].main(["--config", recipe[name][0], *argvs[name]], callbacks=[timer])
            result.pop("trainer", None)
            del result
        stages[name] = stage_summary(name, requested[name], timer, memory, time.time() - t0,
                                     data["prompt_tokens_mean"], args.response_length)
        logger.info("gpu_check: %s %s", name, json.dumps({k: v for k, v in stages[name].items() if k != "last_log"}))

    import accelerate
    import datasets
    import peft
    import trl

    report = {
        "ok": all(s["steps"] == s["steps_requested"] for s in stages.values()),
        "device": torch.cuda.get_device_name(0) if cuda else cpu_name(),
        "device_type": "cuda" if cuda else "cpu",
        "cpu_threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "trl": trl.__version__, "peft": peft.__version__,
            "accelerate": accelerate.__version__, "datasets": datasets.__version__,
        },
        "dtype": args.dtype,
        "shape": args.shape,
        "model": model_info,
        "tokenizer_vocab": len(tokenizer),
        "recipes": os.path.relpath(recipes, REPO) if recipes.startswith(str(REPO)) else recipes,
        "seq_len": args.seq_len,
        "prompt_len": args.prompt_len,
        "model_build_seconds": round(build_seconds, 2),
        "stages": stages,
        "total_seconds": round(time.time() - start, 2),
    }
    if not args.keep_work_dir:
        for d in ("base_model", *out_dirs):
            shutil.rmtree(os.path.join(work, d), ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    report = run_check(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(json.dumps(report, indent=2))
    print(f"gpu_check: wrote {args.output} in {report['total_seconds']:.0f} s", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
