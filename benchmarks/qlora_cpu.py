"""QLoRA on the CPU: peak memory and SFT step time of a 4-bit NF4 base vs the fp32 base (issue 12, item 8).

Run: ``python benchmarks/qlora_cpu.py [--model DIR] [--steps 3] [--threads N]`` (needs bitsandbytes >= 0.50 for
the 4-bit side). Writes ``outputs/qlora-cpu/qlora_cpu.json`` (``--output_dir``) and prints a table.

Model: a stock Qwen2.5 Instruct directory (default: what ``../shared/models/fetch_qwen2.5-0.5b.sh`` built,
Qwen2.5-Coder-0.5B-Instruct, 630M parameters), loaded through `rlhf_trl.models.load_causal_lm` as the SFT stage
loads it, with LoRA as in recipes/qwen2.5-0.5b-cpu/sft.yaml (r 16, alpha 32, all seven linear layers of each block).
Each side runs in its own fresh process, so that its peak RSS is its own:

  fp32   the base in fp32, LoRA adapters in fp32 (the recipe as it is)
  nf4    the base's linear layers in 4-bit NF4 (bitsandbytes CPU backend, fp32 compute, no nested quantization),
         embeddings / LM head / norms in fp32; LoRA adapters cast to bf16 as TRL's SFTTrainer does for QLoRA

One SFT step = forward of 2 rows x 128 tokens (random token ids, seed 0; the content does not change the cost) with
the LM loss over every token, backward, AdamW step on the LoRA parameters. The first step is a warm-up; ``step_s``
is the median of the ``--steps`` steps after it. Recorded per side: ``load_s`` (from_pretrained, quantization
included), ``step_s`` and every step's seconds, ``rss_after_load_bytes`` (VmRSS once loaded; split into
``rss_anon_after_load_bytes``, tensors and allocator heap, and ``rss_file_after_load_bytes``, pages of the mapped
safetensors files), ``rss_anon_end_bytes`` (RssAnon after the last step), ``peak_rss_bytes``
(VmHWM of /proc/self/status at the end: the peak over the process's life, loading included), ``weight_bytes`` (the
distinct parameter and buffer storages of the model). ``threads``: torch intra-op threads (``--threads``, default
``OMP_NUM_THREADS`` or 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FETCH = REPO.parent / "shared" / "models" / "fetch_qwen2.5-0.5b.sh"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS, TOKENS = 2, 128


def status_bytes(key: str) -> int:
    """A ``/proc/self/status`` memory figure (``VmHWM``, ``VmRSS``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(side: str, model_dir: str, steps: int, threads: int) -> dict:
    """Load, wrap in LoRA, run ``steps + 1`` SFT steps; return the figures of this process."""
    import torch
    from accelerate import PartialState
    from peft import LoraConfig, get_peft_model

    from rlhf_trl.models import load_causal_lm

    torch.set_num_threads(threads)
    PartialState(cpu=True)  # the device a use_cpu: true stage sets up: a quantized model loads on "cpu"
    quant = None
    if side == "nf4":
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    t0 = time.perf_counter()
    model = load_causal_lm(model_dir, torch.float32, quantization_config=quant)
    load_s = time.perf_counter() - t0
    rss_after_load = {k: status_bytes(k) for k in ("VmRSS", "RssAnon", "RssFile")}
    seen, weight_bytes = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            weight_bytes += t.untyped_storage().nbytes()
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0,
                                             target_modules=LORA_TARGETS))
    if quant is not None:  # what TRL's SFTTrainer does to a quantized model's adapters
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {
        "side": side, "threads": threads, "load_s": round(load_s, 2), "warmup_step_s": round(times[0], 2),
        "step_s": round(statistics.median(times[1:]), 2), "steps_s": [round(t, 2) for t in times[1:]],
        "rss_after_load_bytes": rss_after_load["VmRSS"], "rss_anon_after_load_bytes": rss_after_load["RssAnon"],
        "rss_file_after_load_bytes": rss_after_load["RssFile"], "rss_anon_end_bytes": status_bytes("RssAnon"),
        "peak_rss_bytes": status_bytes("VmHWM"), "weight_bytes": weight_bytes,
        "loss": float(loss.detach()),
    }


def default_model() -> str:
    out = subprocess.run(["bash", str(FETCH)], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHON=sys.executable), cwd=REPO)
    return out.stdout.strip().splitlines()[-1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Qwen2.5 directory (default: the fetch script's)")
    parser.add_argument("--steps", type=int, default=3, help="timed SFT steps per side, after one warm-up step")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    parser.add_argument("--output_dir", default=str(REPO / "outputs" / "qlora-cpu"))
    parser.add_argument("--child", choices=["fp32", "nf4"], help=argparse.SUPPRESS)
    parser.add_argument("--child_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.child, args.model, args.steps, args.threads)
        Path(args.child_out).write_text(json.dumps(result))
        return result
    model = args.model or default_model()
    os.makedirs(args.output_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sides = {}
    for side in ("fp32", "nf4"):
        out = Path(args.output_dir) / f"{side}.json"
        subprocess.run([sys.executable, __file__, "--child", side, "--child_out", str(out), "--model", model,
                        "--steps", str(args.steps), "--threads", str(args.threads)], check=True, env=env)
        sides[side] = json.loads(out.read_text())
        out.unlink()
    import bitsandbytes
    import torch

    report = {
        "model": model, "rows": ROWS, "tokens": TOKENS, "lora_r": 16, "threads": args.threads,
        "torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__, "cpu": platform.processor() or
        platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "sides": sides,
        "peak_rss_ratio_nf4_over_fp32": round(sides["nf4"]["peak_rss_bytes"] / sides["fp32"]["peak_rss_bytes"], 3),
        "step_time_ratio_nf4_over_fp32": round(sides["nf4"]["step_s"] / sides["fp32"]["step_s"], 3),
    }
    path = Path(args.output_dir) / "qlora_cpu.json"
    path.write_text(json.dumps(report, indent=2))
    gib = 1024 ** 3
    print(f"SFT step, {ROWS} rows x {TOKENS} tokens, LoRA r16, {args.threads} thread(s), {model}")
    print(f"{'side':6} {'load s':>7} {'step s':>7} {'weights GiB':>12} {'RSS loaded GiB (anon+file)':>27} "
          f"{'anon end GiB':>13} {'peak RSS GiB':>13}")
    for name, s in sides.items():
        loaded = (f"{s['rss_after_load_bytes'] / gib:.2f} ({s['rss_anon_after_load_bytes'] / gib:.2f}+"
                  f"{s['rss_file_after_load_bytes'] / gib:.2f})")
        print(f"{name:6} {s['load_s']:7.1f} {s['step_s']:7.2f} {s['weight_bytes'] / gib:12.2f} {loaded:>27} "
              f"{s['rss_anon_end_bytes'] / gib:13.2f} {s['peak_rss_bytes'] / gib:13.2f}")
    print(f"nf4 / fp32: peak RSS x{report['peak_rss_ratio_nf4_over_fp32']}, step time "
          f"x{report['step_time_ratio_nf4_over_fp32']}  -> {path}")
    return report


if __name__ == "__main__":
    main()
