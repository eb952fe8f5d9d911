"""benchmarks/gpu_check.sh in its tiny CPU shape: every stage runs the asked steps and reports positive numbers."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # every stage in a subprocess (~30 s)


def test_gpu_check_tiny_cpu(tmp_path):
    out = tmp_path / "result" / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--tiny", "--steps", "3", "--ppo_steps", "2",
         "--output", str(out), "--work_dir", str(tmp_path / "work")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())

    assert report["ok"] is True
    assert report["device_type"] == "cpu" and report["shape"] == "tiny" and report["dtype"] == "bfloat16"
    assert {"torch", "transformers", "trl", "peft"} <= set(report["versions"])
    model = report["model"]
    assert model["architecture"] == "Qwen2ForCausalLM" and model["tie_word_embeddings"] is True
    assert model["vocab_size"] > report["tokenizer_vocab"] and model["parameters"] > 0
    asked = {"sft": 3, "rm": 3, "ppo": 2}
    assert set(report["stages"]) == set(asked)
    for name, stage in report["stages"].items():
        assert stage["steps"] == stage["steps_requested"] == asked[name], (name, stage)
        assert len(stage["step_seconds"]) == asked[name] and all(s > 0 for s in stage["step_seconds"]), name
        assert stage["seconds_per_step_median"] > 0, name
        assert stage["tokens_per_step"] > 0 and stage["tokens_per_second"] > 0, name
        assert stage["peak_memory_gib"] > 0 and stage["memory_kind"] == "cpu_peak_rss", name
    assert report["stages"]["ppo"]["episodes_per_second"] > 0
    assert "loss" in report["stages"]["sft"]["last_log"] and "objective/scores" in report["stages"]["ppo"]["last_log"]
    # scratch models are removed; the work directory is only ours
    assert not (tmp_path / "work" / "base_model").exists()
