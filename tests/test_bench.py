"""`benchmarks/bench.py --quick` runs end to end and writes every key (CI keeps the benchmark from rotting).

Checks the keys and files, not the figures (timings on a shared CI machine mean nothing).
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

TOP_KEYS = {
    "mode", "repeats", "overhead_ratio", "train_runtime_ratio", "overhead", "ppo_breakdown", "rollout_vs_generate",
    "memory", "ppo_model_copies", "ppo_base_weight_copies", "scaling", "targets", "targets_met", "machine",
    "versions", "seconds", "failures", "reencode", "reencode_ratio",
}
OVERHEAD_KEYS = {
    "steps", "step_unit", "overhead_ratio", "train_runtime_ratio", "setup_ratio",
    *(f"{side}_{k}" for side in ("rlhf_trl", "plain") for k in (
        "wall_seconds", "wall_median", "train_seconds_median", "setup_seconds_median", "peak_rss_mb")),
}
BREAKDOWN_KEYS = {
    "seconds_per_update", "generation_seconds", "scoring_seconds", "optimisation_seconds",
    "generation_tokens_per_second", "scoring_tokens_per_second", "optimisation_tokens_per_second",
    "plain_generate_tokens_per_second", "rollout_vs_generate", "per_update",
}


@pytest.mark.slow
def test_bench_quick_writes_every_key(tmp_path):
    out = tmp_path / "bench"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench.py"), "--quick", "--output_dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    bench = json.loads((out / "bench.json").read_text())
    assert TOP_KEYS <= set(bench), TOP_KEYS - set(bench)
    assert bench["mode"] == "quick" and bench["failures"] == []
    assert set(bench["overhead_ratio"]) == {"sft", "rm"}  # PPO is the project's engine: see test_ppo_oracle
    for stage in ("sft", "rm"):
        entry = bench["overhead"][stage]
        assert OVERHEAD_KEYS <= set(entry), (stage, OVERHEAD_KEYS - set(entry))
        assert entry["overhead_ratio"] is not None and entry["train_runtime_ratio"] is not None
    assert BREAKDOWN_KEYS <= set(bench["ppo_breakdown"]), BREAKDOWN_KEYS - set(bench["ppo_breakdown"])
    assert bench["rollout_vs_generate"] is not None
    # a reward model of another tokenizer: the re-encoding time as a ratio of the PPO update time
    if (REPO.parent / "shared" / "tokenizers" / "qwen2").is_dir():
        assert bench["reencode_ratio"] >= 1.0 and bench["reencode"]["reencode_seconds_per_update"] > 0
        assert bench["reencode"]["rm_tokens"] > 0

    memory = bench["memory"]
    assert {"model", "stages", "peak_rss_mb", "ppo_model_copies_by_layout", "ppo_base_weight_copies_by_layout"} <= set(
        memory)
    assert {"parameters", "weight_bytes"} <= set(memory["model"])
    for stage in ("sft", "rm"):
        assert memory["stages"][stage]["peak_rss_mb"] > 0
    layouts = memory["stages"]["ppo"]["layouts"]
    assert set(layouts) == {"trl_default", "lora_value", "shared", "value_head"}
    for name in ("trl_default", "lora_value", "value_head"):
        assert layouts[name]["model_copies"] is not None and layouts[name]["peak_rss_mb"] > 0
    # the value as a head on the policy: no value model, so one base copy fewer than a separate value model
    copies = memory["ppo_base_weight_copies_by_layout"]
    assert copies["value_head"] == pytest.approx(copies["lora_value"] - 1, abs=0.05)
    # the shared layout runs once src/rlhf_trl/ppo.py has `share_reward_value_base`; else null with a reason
    assert layouts["shared"]["model_copies"] is not None or layouts["shared"].get("reason")
    assert bench["ppo_model_copies"] == layouts["shared"]["model_copies"]
    assert bench["ppo_base_weight_copies"] == layouts["shared"]["base_weight_copies"]

    points = bench["scaling"]["points"]
    assert len(points) >= 2
    for p in points:
        assert {"response_length", "batch", "seconds_per_update", "peak_rss_mb"} <= set(p)
        assert p["seconds_per_update"] is not None and p["peak_rss_mb"] is not None
    assert set(bench["targets_met"]) == {"overhead_ratio", "rollout_vs_generate", "ppo_base_weight_copies",
                                          "ppo_model_copies", "seconds", "reencode_ratio"}
    assert {"cpu_count", "torch_threads"} <= set(bench["machine"])

    png = (out / "scaling.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    md = (out / "bench.md").read_text(encoding="utf-8")
    assert "overhead_ratio" in md and "rollout_vs_generate" in md and "ppo_model_copies" in md and "reencode_ratio" in md
