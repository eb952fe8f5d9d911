"""PPO on real weights: the project's engine against TRL 1.12's ``PPOTrainer``, seconds and peak RSS per update.

    make bench-real ARGS="--size issue --updates 4 --trl_updates 1 --trl_micro_batch 4 --engine_micro_batch 4"
    python benchmarks/bench_real.py [--model DIR] [--size small|issue] [--updates N] [--variants a,b] [--reuse]

Run it on an otherwise idle machine. Writes into ``--output_dir`` (default outputs/bench-real): ``bench_real.json``
(every figure), ``bench_real.md`` (the table and the targets' verdict), each variant's run ``<variant>.json``
(``--reuse`` tables a saved one instead of running it again) and its output ``<variant>.log``.

Model: a Qwen2.5 directory (default: ``../shared/models/fetch_qwen2.5-0.5b.sh``, Qwen2.5-Coder-0.5B-Instruct, 630M
parameters) as the policy (LoRA rank 16 on all seven projections; reference = adapter off) and as reward and value
model (the same weights as a one-label classifier); fp32 on the CPU. Prompts: ``short``, the real zh prompts of
``../shared/data/zh/cvalues_responsibility_prompts.jsonl``; ``long`` (the default of ``--size issue``), real zh task
statements of >= 256 tokens (``dpo_zh_demo.json``, ``reward_dpo_zh_500.jsonl``) cut to 256; generated without ../shared.
Sizes: ``small`` (default, quick): 4 episodes x 32 new tokens per update; ``issue`` (the PPO-loop issue's setting): 8
episodes x 64 new tokens. There TRL 1.12 does not fit in 24 GB in one micro-batch of 8: ``--trl_micro_batch 4`` runs
it in 4 x 2 (the same episodes per update), ``--engine_micro_batch 4`` the engine likewise; and TRL is killed for
memory in its second update (``--trl_updates 1``: its one update is its figure).

Variants, each one PPO run in its own process (its peak RSS is its own), same prompts, seed and settings, each in the
environment it is given (no allocator or huge-page setting):
  plain_trl      TRL 1.12's ``PPOTrainer`` driven by benchmarks/plain_trl.py (full value model), from its own venv
                 with trl==1.12.0 (``--trl112_venv``, default .venv-trl112, built on first use)
  rlhf_trl       ``rlhf-trl ppo`` (the project's engine) in TRL's layout: a full value model
  rlhf_trl_lean  ``rlhf-trl ppo`` with ``value_use_peft`` + ``share_reward_value_base`` (a LoRA value model on the
                 reward model's weights: one copy for both) + ``gradient_checkpointing``
Columns: micro-batches (episodes per micro-batch x micro-batches per update); updates run (timed: the first is a
warm-up, not counted, when more than one runs); s / update (the median over the timed updates of the seconds from
one update's end to the next's, the first from the start of training); generation (the rollout's ``generate``: TRL's
``batch_generation``, the engine's ``generate_rollouts``), scoring (the rest of the rollout: no-grad reference,
reward and value forwards, advantages) and optimisation (the PPO epochs, the engine's ``value_step`` too, and
logging), each the median seconds; peak RSS (the process's ``VmHWM`` over its whole run: loading, updates, saving;
TRL's one update peaks before AdamW's state is held throughout, so its figure is if anything low);
s vs TRL and RSS vs TRL (over plain_trl's). Targets (`TARGETS`, a pass/fail table and a verdict line): rlhf_trl s /
update <= 0.85x and peak RSS <= 0.8x of TRL 1.12's, rlhf_trl_lean peak RSS <= 0.4x.
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
from functools import partial
from pathlib import Path
from statistics import median

from _measure import status_field  # noqa: E402  (benchmarks/ is on sys.path: scripts run from it)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FETCH = SHARED / "models" / "fetch_qwen2.5-0.5b.sh"
PROMPTS = SHARED / "data" / "zh" / "cvalues_responsibility_prompts.jsonl"
LONG_PROMPTS = (SHARED / "data" / "zh" / "dpo_zh_demo.json", SHARED / "data" / "zh" / "reward_dpo_zh_500.jsonl")
RECIPE = REPO / "recipes" / "qwen2.5-0.5b-cpu" / "ppo.yaml"

SIZES = {
    "small": dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, local_rollout_forward_batch_size=4,
                  response_length=32),
    "issue": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, local_rollout_forward_batch_size=8,
                  response_length=64),
}
VARIANTS = ("plain_trl", "rlhf_trl", "rlhf_trl_lean")
ENGINE = {"dataset_format": "prompt", "value_use_peft": False, "share_reward_value_base": False,
          "reward_baseline": 0.0, "log_samples_every": 0}  # every engine variant: TRL's layout, no calibration
VARIANT_KEYS = {"rlhf_trl": {},
                "rlhf_trl_lean": {"value_use_peft": True, "share_reward_value_base": True,
                                  "gradient_checkpointing": True}}
TARGETS = (("rlhf_trl", "seconds_vs_plain_trl", 0.85), ("rlhf_trl", "peak_rss_vs_plain_trl", 0.8),
           ("rlhf_trl_lean", "peak_rss_vs_plain_trl", 0.4))
PHASES = ("generation", "scoring", "optimisation")


# -- the child: one PPO run with phase timers -----------------------------------------------------------------------
class PhaseMeter:
    """Wall seconds of generation / scoring / optimisation per update; a phase runs until the next one starts."""

    def __init__(self):
        self.phase, self.t = None, 0.0
        self.cur, self.updates, self.shape = dict.fromkeys(PHASES, 0.0), [], {}

    def enter(self, phase: str) -> None:
        now = time.perf_counter()
        if self.phase is not None:
            self.cur[self.phase] += now - self.t
        self.phase, self.t = phase, now

    def end_update(self) -> None:
        self.enter("optimisation")  # until the next rollout starts, time counts as the next update's optimisation
        self.updates.append(self.cur)
        self.cur = dict.fromkeys(PHASES, 0.0)

    def rolled_out(self, args, out) -> None:  # (model, queries, ...) -> (query_responses, ...): scoring starts
        self.shape = {"rows": int(args[1].shape[0]), "prompt_tokens": int(args[1].shape[1]),
                      "sequence_tokens": int(out[0].shape[1])}
        self.enter("scoring")

    def training(self) -> None:  # TRL's forward / get_reward: the PPO epochs' with autograd on, the rollout's off
        import torch

        if torch.is_grad_enabled():
            self.enter("optimisation")


def _wrap(owner, name: str, before, after=None) -> None:
    """Replaces ``owner.name`` by a function that calls ``before()``, the original, then ``after(args, out)``."""
    original = getattr(owner, name, None)
    if original is None:
        return print(f"bench_real: no {owner.__name__}.{name}: its phase is not split off", file=sys.stderr)

    def wrapped(*args, **kwargs):
        before()
        out = original(*args, **kwargs)
        if after is not None:
            after(args, out)
        return out

    setattr(owner, name, wrapped)


def reward_copy(model: str, out: Path) -> str:
    """The policy's weights as a sequence classifier (a new, untrained score head; speed is what is measured), saved
    once under ``out``: PPO refuses a causal LM as the reward model."""
    if not (out / "config.json").is_file():
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        rm = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=torch.bfloat16)
        tok = AutoTokenizer.from_pretrained(model)
        rm.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        rm.save_pretrained(str(out))
        tok.save_pretrained(str(out))
    return str(out)


def child_settings(model: str, prompts: str, work: str, size: dict, updates: int, reward: str | None = None) -> dict:
    """The settings every variant runs with (TRL 1.12 PPOConfig / model keys), typed; ``reward``: the reward model
    (default: ``model``)."""
    batch = size["per_device_train_batch_size"] * size["gradient_accumulation_steps"]
    return {**size, "total_episodes": batch * updates, "num_ppo_epochs": 1, "num_mini_batches": 1,
            "learning_rate": 1e-5, "temperature": 0.7, "kl_coef": 0.05, "missing_eos_penalty": 1.0, "seed": 42,
            "report_to": "none", "save_strategy": "no", "logging_steps": 1, "output_dir": work, "use_cpu": True,
            "num_sample_generations": 0, "sft_model_path": model, "reward_model_path": reward or model,
            "dataset_name": prompts,
            "max_prompt_length": 256, "use_peft": True, "lora_r": 16, "lora_alpha": 32,
            "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            "dtype": "float32", "eval_split_size": 4, "per_device_eval_batch_size": 2, "stop_token": "eos"}


def engine_argv(variant: str, settings: dict) -> list[str]:
    """``rlhf-trl ppo`` arguments of an engine variant: the CPU recipe, `ENGINE`, ``settings``, `VARIANT_KEYS`."""
    argv = ["--config", str(RECIPE)]
    for key, value in {**ENGINE, **settings, "overwrite_output_dir": True, **VARIANT_KEYS[variant]}.items():
        argv += [f"--{key}", *(value if isinstance(value, list) else
                                [str(value).lower() if isinstance(value, bool) else str(value)])]
    return argv


def child(variant: str, settings: dict, out: Path) -> None:
    import torch
    from transformers import TrainerCallback

    meter = PhaseMeter()

    class UpdateEnd(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            optimisation()

        def on_step_end(self, args, state, control, **kwargs):
            meter.end_update()

    generation, optimisation = partial(meter.enter, "generation"), partial(meter.enter, "optimisation")
    t0 = time.perf_counter()
    if variant == "plain_trl":
        import trl.experimental.ppo.ppo_trainer as ppo_trainer

        _wrap(ppo_trainer, "batch_generation", generation, meter.rolled_out)
        _wrap(ppo_trainer, "forward", meter.training)  # the PPO epochs' policy + value forward
        _wrap(ppo_trainer, "get_reward", meter.training)
        sys.path.insert(0, str(REPO / "benchmarks"))
        import plain_trl

        plain_trl.ppo({**settings, "callbacks": [UpdateEnd()]})
    else:
        from rlhf_trl import ppo, ppo_engine

        _wrap(ppo_engine, "generate_rollouts", generation, meter.rolled_out)
        _wrap(ppo_engine, "value_step", optimisation)  # single_value_forward: the value model's training
        _wrap(ppo_engine.PPOEngine, "optimise", optimisation)
        ppo.main(engine_argv(variant, settings), callbacks=[UpdateEnd()])
    meter.phase = None
    json.dump({"variant": variant, "updates": meter.updates, "shape": meter.shape, "seconds": time.perf_counter() - t0,
               "peak_rss_bytes": status_field("VmHWM"), "threads": torch.get_num_threads(),
               "settings": {k: settings[k] for k in SIZES["small"]}}, open(out, "w"), indent=2)


# -- the parent: runs and the table ---------------------------------------------------------------------------------
def variant_run(args, variant: str) -> tuple[dict, int]:
    """A variant's size settings (``--trl_micro_batch`` / ``--engine_micro_batch``: micro-batches of that many episodes,
    the same episodes per update) and its number of updates (``--trl_updates`` for plain_trl)."""
    size = dict(SIZES[args.size])
    micro = args.trl_micro_batch if variant == "plain_trl" else args.engine_micro_batch
    if micro:
        batch = size["per_device_train_batch_size"] * size["gradient_accumulation_steps"]
        if batch % micro:
            raise SystemExit(f"bench_real: micro-batch {micro} does not divide the batch of {batch} episodes")
        size.update(per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro)
    updates = args.trl_updates if variant == "plain_trl" and args.trl_updates else args.updates
    return size, updates


def summarise(run: dict) -> dict:
    """One variant's figures from its ``<variant>.json``: medians over the timed updates (all but the first, the
    warm-up, when more than one ran), peak RSS."""
    if not run.get("updates"):
        return {"error": "no update finished"}
    timed = run["updates"][1:] if len(run["updates"]) > 1 else run["updates"]
    seconds = [sum(u[p] for p in PHASES) for u in timed]
    return {"updates_run": len(run["updates"]), "updates_timed": len(timed), "update_seconds": seconds,
            "seconds_per_update": median(seconds), **{p: median([u[p] for u in timed]) for p in PHASES},
            "peak_rss_bytes": run["peak_rss_bytes"], "settings": run["settings"], "shape": run.get("shape", {}),
            "threads": run.get("threads")}


def add_ratios(variants: dict) -> None:
    """``seconds_vs_plain_trl`` and ``peak_rss_vs_plain_trl`` of every measured variant (none without plain_trl)."""
    trl = variants.get("plain_trl", {})
    if "seconds_per_update" not in trl:
        return
    for r in variants.values():
        if "seconds_per_update" in r:
            r["seconds_vs_plain_trl"] = r["seconds_per_update"] / trl["seconds_per_update"]
            r["peak_rss_vs_plain_trl"] = r["peak_rss_bytes"] / trl["peak_rss_bytes"]


def verdicts(variants: dict) -> tuple[list[dict], str]:
    """Each of `TARGETS` with its ``ratio`` (None: not measured) and ``met`` (True / False / None); the verdict line."""
    checks = [{"variant": v, "measure": key, "limit": limit, "ratio": variants.get(v, {}).get(key)}
              for v, key, limit in TARGETS]
    for c in checks:
        c["met"] = None if c["ratio"] is None else c["ratio"] <= c["limit"]
    missed = [f"{c['variant']} {c['measure']} {c['ratio']:.2f}x > {c['limit']}x" for c in checks if c["met"] is False]
    unmeasured = [f"{c['variant']} {c['measure']}" for c in checks if c["met"] is None]
    return checks, ("Verdict: NOT MET: " + ", ".join(missed) if missed else
                    "Verdict: incomplete, not measured: " + ", ".join(unmeasured) if unmeasured else
                    f"Verdict: all {len(checks)} targets met.")


def markdown(bench: dict) -> str:
    shape = next((r["shape"] for r in bench["variants"].values() if r.get("shape")), None)
    tokens = (f", prompts of {shape['prompt_tokens']} tokens + <= {shape['sequence_tokens'] - shape['prompt_tokens']}"
              " new" if shape else "")
    size = SIZES[bench["size"]]
    lines = [f"# PPO on real weights: {bench['model_name']}, --size {bench['size']} "
             f"({size['per_device_train_batch_size'] * size['gradient_accumulation_steps']} episodes x "
             f"{size['response_length']} new tokens per update, {bench['prompt_set']} prompts{tokens})", "",
             "| variant | micro-batches | updates (timed) | s / update | generation s | scoring s | optimisation s "
             "| peak RSS GB | s vs TRL | RSS vs TRL |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in bench["variants"].items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:100]} | | | | | | | | |")
            continue
        s = r["settings"]
        phases = " | ".join(f"{r[p]:.1f}" if r["generation"] > 0 else "-" for p in PHASES)
        ratios = " | ".join(f"{r[k]:.2f}x" if k in r else "-" for k in ("seconds_vs_plain_trl",
                                                                           "peak_rss_vs_plain_trl"))
        lines.append(f"| {name} | {s['per_device_train_batch_size']} x {s['gradient_accumulation_steps']} | "
                     f"{r['updates_run']} ({r['updates_timed']}) | {r['seconds_per_update']:.1f} | {phases} | "
                     f"{r['peak_rss_bytes'] / 1e9:.1f} | {ratios} |")
    lines += ["", "| target | measured | limit | met |", "|---|---|---|---|"]
    for c in bench["targets"]:
        measured = "-" if c["ratio"] is None else f"{c['ratio']:.2f}x"
        met = {True: "yes", False: "**no**", None: "-"}[c["met"]]
        lines.append(f"| {c['variant']} {c['measure']} | {measured} | <= {c['limit']}x | {met} |")
    lines += ["", bench["verdict"], "",
              "s / update: median over the timed updates (the first update a warm-up when more than one ran); phases: "
              "medians; peak RSS: the process's whole run. See benchmarks/bench_real.py."]
    return "\n".join(lines) + "\n"


def resolve_model(model: str | None) -> str:
    if model:
        return model
    if not FETCH.is_file():
        sys.exit(f"bench_real: no --model and no {FETCH}")
    proc = subprocess.run(["bash", str(FETCH)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable))
    if proc.returncode != 0:
        sys.exit(f"bench_real: {FETCH} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return proc.stdout.strip().splitlines()[-1]


def long_prompts(model: str, n: int = 64, min_tokens: int = 256) -> list[dict]:
    """Real zh prompts of at least ``min_tokens`` tokens (the last human turn of `LONG_PROMPTS`' rows), counted with
    the model's tokenizer; empty without ``../shared``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    texts = []
    for path in LONG_PROMPTS:
        if path.is_file():
            rows = json.load(open(path, encoding="utf-8")) if path.suffix == ".json" else \
                [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
            texts += [[c["value"] for c in r["conversations"] if c["from"] == "human"][-1] for r in rows]
    long = [t for t in texts if len(tok(f"问：{t}\n\n答：", add_special_tokens=False)["input_ids"]) >= min_tokens]
    return [{"instruction": t} for t in long[:n]]


def write_prompts(path: Path, prompt_set: str = "short", model: str | None = None, n: int = 64) -> str:
    """The benchmark's prompt file (``instruction`` rows); generated prompts without ``../shared``."""
    rows = long_prompts(model, n) if prompt_set == "long" else (
        [{"instruction": json.loads(line)["prompt"]} for line in open(PROMPTS, encoding="utf-8")][:n]
        if PROMPTS.is_file() else [])
    rows = rows or [{"instruction": f"请简单介绍一下第{i}个中国城市的历史和文化。" * (12 if prompt_set == "long" else 1)}
                    for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


TRL112_REQUIREMENTS = ["torch==2.13.0", "trl==1.12.0", "transformers>=5.24,<6", "peft>=0.21", "accelerate>=1.15",
                       "datasets>=5.2", "tokenizers>=0.22", "pyyaml", "pandas", "rich"]


def trl112_python(venv: Path) -> str:
    """The python of a venv holding trl 1.12.0 (the last release with PPOTrainer), built on first use (~2 min with
    the package registry reachable)."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import trl, sys; sys.exit(trl.__version__ != '1.12.0')"]
    if not (python.is_file() and subprocess.run(check, capture_output=True).returncode == 0):
        print(f"bench_real: building {venv} (trl==1.12.0) for the plain_trl variant ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL112_REQUIREMENTS], check=True)
    return str(python)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Qwen2 / Qwen2.5 directory (default: fetch the 0.5B Instruct)")
    p.add_argument("--output_dir", default="outputs/bench-real")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--prompt_set", choices=("short", "long"), help="default: long at --size issue, else short")
    p.add_argument("--updates", type=int, default=2, help="updates per variant (the first is a warm-up)")
    p.add_argument("--trl_updates", type=int, help="plain_trl's updates (default: --updates)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--trl_micro_batch", type=int, help="plain_trl: micro-batches of this many episodes")
    p.add_argument("--engine_micro_batch", type=int, help="the engine's variants: micro-batches of this many episodes")
    p.add_argument("--reuse", action="store_true", help="table a variant's saved <variant>.json instead of running it")
    p.add_argument("--trl112_venv", default=str(REPO / ".venv-trl112"), help="venv with trl==1.12.0, built if absent")
    for hidden in ("--child", "--settings", "--out"):  # a variant's own process
        p.add_argument(hidden, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        child(args.child, json.loads(args.settings), Path(args.out))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out_dir = Path(args.output_dir)
    model = resolve_model(args.model)
    prompt_set = args.prompt_set or ("long" if args.size == "issue" else "short")
    prompts = write_prompts(out_dir / "prompts.jsonl", prompt_set, model)
    bench = {"model": model, "model_name": os.path.basename(model.rstrip("/")), "size": args.size,
             "prompt_set": prompt_set, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
             "variants": {}}
    for variant in args.variants.split(","):
        size, updates = variant_run(args, variant)
        run_json, work = out_dir / f"{variant}.json", out_dir / "runs" / variant
        if args.reuse and run_json.is_file():
            print(f"bench_real: {variant}: reusing {run_json}", flush=True)
        else:
            python = trl112_python(Path(args.trl112_venv)) if variant == "plain_trl" else sys.executable
            settings = child_settings(model, prompts, str(work), size, updates, reward_copy(model, out_dir / "reward"))
            print(f"bench_real: {variant} ({updates} updates) ...", flush=True)
            run_json.unlink(missing_ok=True)
            with open(out_dir / f"{variant}.log", "w") as log:  # the run's output, to follow it with tail -f
                rc = subprocess.run([python, __file__, "--child", variant, "--settings", json.dumps(settings),
                                     "--out", str(run_json)], stdout=log, stderr=subprocess.STDOUT).returncode
            shutil.rmtree(work, ignore_errors=True)  # the merged policy and value model: ~4 GB, not needed
            if rc != 0:
                last = (out_dir / f"{variant}.log").read_text(errors="replace").strip().splitlines()[-1:]
                bench["variants"][variant] = {"error": "killed (out of memory?)" if rc in (-9, 137) else
                                              (last or [f"exit {rc}"])[0]}
                continue
        bench["variants"][variant] = summarise(json.load(open(run_json)))
    add_ratios(bench["variants"])
    bench["targets"], bench["verdict"] = verdicts(bench["variants"])
    (out_dir / "bench_real.json").write_text(json.dumps(bench, indent=2))
    (out_dir / "bench_real.md").write_text(markdown(bench))
    print(markdown(bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
