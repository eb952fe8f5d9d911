"""DeepSpeed / FSDP launches refused before anything is written: a mixed-precision clash between the accelerate config
and the recipe (the recipe decides precision), and FSDP on a machine without GPUs. Needs DeepSpeed (``make install``
installs it). The 2-process ZeRO-2 / ZeRO-3 training comparisons are not here yet (issue 45).
"""

import os

import pytest
import torch
from test_multiprocess import NPROC, RECIPES, REPO, launch

pytestmark = pytest.mark.slow
deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (make install installs it)")

CONFIGS = {name: os.path.join(REPO, "recipes", "accelerate_configs", f"{name}.yaml") for name in ("zero2", "fsdp")}


def sft_under(config: str, assets, out):
    """The demo SFT recipe under ``accelerate launch`` with ``config``, 2 processes, as ``make sft ACCEL=...`` runs it."""
    return launch("sft", ["--config", f"{RECIPES}/sft.yaml", "--dataset_name", assets["sft"], "--model_name_or_path",
                          assets["base_model"], "--output_dir", str(out)], NPROC, config=config, use_cpu_env=False,
                  check=False)


def test_mixed_precision_clash_is_one_line_before_anything_is_written(assets, tmp_path):
    config = tmp_path / "zero2_bf16.yaml"
    config.write_text(open(CONFIGS["zero2"]).read().replace("mixed_precision: 'no'", "mixed_precision: bf16"))
    out = tmp_path / "out"
    proc = sft_under(str(config), assets, out)
    assert proc.returncode != 0 and not out.exists()
    assert (f"{RECIPES}/sft.yaml: bf16: false, fp16: false, but the accelerate config says "
            "mixed_precision: bf16; the recipe decides precision") in proc.stderr


def test_fsdp_without_gpus_stops_in_one_line(assets, tmp_path):
    if torch.accelerator.is_available():
        pytest.skip("needs a machine without GPUs")
    out = tmp_path / "out"
    proc = sft_under(CONFIGS["fsdp"], assets, out)
    assert proc.returncode != 0 and not out.exists()
    assert ("ACCEL=fsdp: accelerate runs FSDP only on GPUs and this machine has none (it would "
            "run DDP instead); use ACCEL=zero3 (DeepSpeed ZeRO-3) or ACCEL=multi_cpu here") in proc.stderr
