"""benchmarks/bench_real.py: its presets, the variants' settings, the phase timers, the table and the targets' verdict."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_real  # noqa: E402

# PPOConfig keys of the CPU-only measures the thin engine dropped: no variant may set one
DELETED_KEYS = {"onednn_decoding", "rollout_sampler", "fused_lora", "fused_kernels", "malloc_mmap_threshold",
                "tensor_cache", "tensor_cache_headroom_mb"}


def _args(**kw):
    return SimpleNamespace(**{"size": "issue", "trl_micro_batch": None, "engine_micro_batch": None,
                              "trl_updates": None, "updates": 4, **kw})


def test_the_presets():
    issue, small = bench_real.SIZES["issue"], bench_real.SIZES["small"]
    assert issue["per_device_train_batch_size"] * issue["gradient_accumulation_steps"] == 8
    assert issue["response_length"] == 64 and issue["local_rollout_forward_batch_size"] == 8
    assert small["per_device_train_batch_size"] * small["gradient_accumulation_steps"] == 4
    assert small["response_length"] == 32
    assert bench_real.VARIANTS == ("plain_trl", "rlhf_trl", "rlhf_trl_lean")
    args = bench_real.parser().parse_args(["--size", "issue"])
    assert args.updates == 2 and args.trl_updates is None and args.variants == "plain_trl,rlhf_trl,rlhf_trl_lean"


def test_each_side_takes_its_micro_batch_and_updates_with_the_same_episodes():
    args = _args(trl_micro_batch=4, trl_updates=1)
    size, updates = bench_real.variant_run(args, "plain_trl")
    assert size == dict(bench_real.SIZES["issue"], per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert updates == 1
    assert bench_real.variant_run(args, "rlhf_trl") == (bench_real.SIZES["issue"], 4)  # the size's own
    size, updates = bench_real.variant_run(_args(engine_micro_batch=2), "rlhf_trl_lean")
    assert (size["per_device_train_batch_size"], size["gradient_accumulation_steps"], updates) == (2, 4, 4)
    assert bench_real.variant_run(_args(engine_micro_batch=2), "plain_trl")[0] == bench_real.SIZES["issue"]
    with pytest.raises(SystemExit, match="micro-batch 3 does not divide the batch of 8 episodes"):
        bench_real.variant_run(_args(trl_micro_batch=3), "plain_trl")
    assert bench_real.SIZES["issue"]["per_device_train_batch_size"] == 8  # the preset itself is left alone


def _settings(tmp_path, variant="rlhf_trl", updates=3):
    size, _ = bench_real.variant_run(_args(engine_micro_batch=4), variant)
    return bench_real.child_settings("MODEL", "prompts.jsonl", str(tmp_path / variant), size, updates)


def test_the_settings_hold_no_deleted_key(tmp_path):
    settings = _settings(tmp_path)
    assert settings["total_episodes"] == 3 * 8 and settings["seed"] == 42
    assert not DELETED_KEYS & set(settings)
    for variant in ("rlhf_trl", "rlhf_trl_lean"):
        argv = bench_real.engine_argv(variant, settings)
        assert not DELETED_KEYS & {a[2:] for a in argv if a.startswith("--")}, variant
    recipe = yaml.safe_load(open(bench_real.RECIPE, encoding="utf-8"))  # the engine's variants start from it
    assert not DELETED_KEYS & set(recipe)


def test_the_engine_variants_parse_as_rlhf_trl_ppo_recipes(tmp_path):
    """Each engine variant's arguments are what `rlhf-trl ppo` accepts, with the same settings plain_trl gets."""
    from rlhf_trl.config import parse_recipe
    from rlhf_trl.ppo import recipe_types

    settings = _settings(tmp_path)
    parsed = {}
    for variant in ("rlhf_trl", "rlhf_trl_lean"):
        recipe = parse_recipe(recipe_types(), bench_real.engine_argv(variant, settings), "ppo")
        data, script, config, model = recipe.data, recipe.script, recipe.training, recipe.model
        assert recipe.path == str(bench_real.RECIPE)
        assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (4, 2)
        assert (config.local_rollout_forward_batch_size, config.response_length) == (8, 64)
        assert config.total_episodes == 24 and config.num_ppo_epochs == 1 and config.learning_rate == 1e-5
        assert config.seed == 42 and config.temperature == 0.7 and config.kl_coef == 0.05
        assert model.lora_target_modules == settings["lora_target_modules"] and model.lora_r == 16
        assert data.dataset_name == "prompts.jsonl" and data.max_prompt_length == 256
        parsed[variant] = (script, config)
    full, lean = parsed["rlhf_trl"], parsed["rlhf_trl_lean"]
    assert not full[0].value_use_peft and not full[0].share_reward_value_base and not full[1].gradient_checkpointing
    assert lean[0].value_use_peft and lean[0].share_reward_value_base and lean[1].gradient_checkpointing


def test_the_meter_splits_each_update_into_its_phases(monkeypatch):
    clock = iter([0.0, 1.0, 4.0, 6.0, 10.0, 10.5, 12.0, 15.0])
    monkeypatch.setattr(bench_real.time, "perf_counter", lambda: next(clock))
    meter = bench_real.PhaseMeter()
    meter.enter("optimisation")  # train begins (0)
    meter.enter("generation")  # 1
    shape = SimpleNamespace(shape=(8, 256))
    meter.rolled_out((None, shape), (SimpleNamespace(shape=(8, 320)),))  # 4: scoring starts
    meter.enter("optimisation")  # 6
    meter.end_update()  # 10
    meter.enter("generation")  # 10.5: the half second counts as the second update's optimisation
    meter.enter("scoring")  # 12
    meter.end_update()  # 15: scoring ran to the update's end
    assert meter.updates == [{"generation": 3.0, "scoring": 2.0, "optimisation": 5.0},
                             {"generation": 1.5, "scoring": 3.0, "optimisation": 0.5}]
    assert meter.shape == {"rows": 8, "prompt_tokens": 256, "sequence_tokens": 320}


def test_wrap_calls_before_and_after_around_the_original(capsys):
    calls = []
    owner = SimpleNamespace(__name__="owner", f=lambda x, y=0: calls.append(("f", x, y)) or x + y)
    bench_real._wrap(owner, "f", lambda: calls.append("before"), lambda args, out: calls.append(("after", args, out)))
    assert owner.f(1, y=2) == 3
    assert calls == ["before", ("f", 1, 2), ("after", (1,), 3)]
    bench_real._wrap(owner, "missing", lambda: None)
    assert "no owner.missing" in capsys.readouterr().err and not hasattr(owner, "missing")


def _run(updates, peak=10e9, settings=None):
    return {"variant": "x", "updates": updates, "peak_rss_bytes": peak, "threads": 2, "shape": {},
            "settings": settings or {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}}


def _update(g, s, o):
    return {"generation": g, "scoring": s, "optimisation": o}


def test_the_summary_skips_the_warm_up_and_takes_medians():
    r = bench_real.summarise(_run([_update(50, 50, 50), _update(10, 20, 30), _update(12, 18, 40), _update(9, 21, 31)]))
    assert (r["updates_run"], r["updates_timed"]) == (4, 3)
    assert r["update_seconds"] == [60, 70, 61] and r["seconds_per_update"] == 61
    assert (r["generation"], r["scoring"], r["optimisation"]) == (10, 20, 31)
    one = bench_real.summarise(_run([_update(1, 2, 3)]))  # a single update is its own figure
    assert (one["updates_timed"], one["seconds_per_update"]) == (1, 6)
    two = bench_real.summarise(_run([_update(9, 9, 9), _update(1, 2, 3), _update(2, 2, 4)]))
    assert two["seconds_per_update"] == 7.0  # an even count: the mean of the middle two
    assert bench_real.summarise(_run([])) == {"error": "no update finished"}


def _bench(trl=(100.0, 20e9), full=(80.0, 15e9), lean=(90.0, 7e9)):
    variants = {name: bench_real.summarise(_run([_update(0, 0, 0), _update(s * 0.2, s * 0.3, s * 0.5)], peak=rss))
                for name, (s, rss) in (("plain_trl", trl), ("rlhf_trl", full), ("rlhf_trl_lean", lean)) if s}
    bench_real.add_ratios(variants)
    bench = {"model_name": "qwen", "size": "issue", "prompt_set": "long", "variants": variants}
    bench["targets"], bench["verdict"] = bench_real.verdicts(variants)
    return bench


def test_ratios_against_plain_trl_and_the_verdict():
    bench = _bench()
    full = bench["variants"]["rlhf_trl"]
    assert full["seconds_vs_plain_trl"] == pytest.approx(0.8) and full["peak_rss_vs_plain_trl"] == pytest.approx(0.75)
    assert bench["variants"]["plain_trl"]["seconds_vs_plain_trl"] == 1.0
    assert [c["met"] for c in bench["targets"]] == [True, True, True]
    assert bench["verdict"] == "Verdict: all 3 targets met."
    slow = _bench(full=(90.0, 15e9), lean=(90.0, 9e9))
    assert [c["met"] for c in slow["targets"]] == [False, True, False]
    assert slow["verdict"] == ("Verdict: NOT MET: rlhf_trl seconds_vs_plain_trl 0.90x > 0.85x, "
                               "rlhf_trl_lean peak_rss_vs_plain_trl 0.45x > 0.4x")
    edge = _bench(full=(85.0, 16e9), lean=(90.0, 8e9))  # exactly at the limits: met
    assert [c["met"] for c in edge["targets"]] == [True, True, True]
    no_trl = _bench(trl=(None, None))
    assert all(c["met"] is None and c["ratio"] is None for c in no_trl["targets"])
    assert no_trl["verdict"].startswith("Verdict: incomplete, not measured: rlhf_trl seconds_vs_plain_trl")
    assert "seconds_vs_plain_trl" not in no_trl["variants"]["rlhf_trl"]


def test_the_table_shows_every_variant_its_ratios_and_the_verdict():
    bench = _bench(full=(90.0, 15e9))
    bench["variants"]["rlhf_trl_lean"] = {"error": "killed (out of memory?)"}
    bench["targets"], bench["verdict"] = bench_real.verdicts(bench["variants"])
    md = bench_real.markdown(bench)
    assert md.startswith("# PPO on real weights: qwen, --size issue (8 episodes x 64 new tokens per update, long")
    assert "| plain_trl | 4 x 2 | 2 (1) | 100.0 | 20.0 | 30.0 | 50.0 | 20.0 | 1.00x | 1.00x |" in md
    assert "| rlhf_trl | 4 x 2 | 2 (1) | 90.0 | 18.0 | 27.0 | 45.0 | 15.0 | 0.90x | 0.75x |" in md
    assert "| rlhf_trl_lean | failed: killed (out of memory?) |" in md
    assert "| rlhf_trl seconds_vs_plain_trl | 0.90x | <= 0.85x | **no** |" in md
    assert "| rlhf_trl peak_rss_vs_plain_trl | 0.75x | <= 0.8x | yes |" in md
    assert "| rlhf_trl_lean peak_rss_vs_plain_trl | - | <= 0.4x | - |" in md
    assert "Verdict: NOT MET: rlhf_trl seconds_vs_plain_trl 0.90x > 0.85x" in md
    # phases not split (a hook found nothing to wrap): dashes, the update's seconds still shown
    bench["variants"]["rlhf_trl"] = bench_real.summarise(_run([_update(0, 0, 70)]))
    assert "| rlhf_trl | 4 x 2 | 1 (1) | 70.0 | - | - | - | 10.0 | - | - |" in bench_real.markdown(bench)


def test_generated_prompts_without_shared(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_real, "PROMPTS", tmp_path / "absent.jsonl")
    path = bench_real.write_prompts(tmp_path / "p.jsonl", "short", n=5)
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert len(rows) == 5 and all(set(r) == {"instruction"} for r in rows)


@pytest.mark.skipif(not (bench_real.SHARED / "tokenizers" / "qwen2").is_dir()
                    or not all(p.is_file() for p in bench_real.LONG_PROMPTS),
                    reason="../shared/tokenizers/qwen2 or ../shared/data/zh/{dpo_zh_demo.json,reward_dpo_zh_500.jsonl} "
                           "absent (see ../shared/data/SOURCES.md)")
def test_long_prompts_fill_the_256_token_limit(tmp_path):
    from transformers import AutoTokenizer

    qwen2 = str(bench_real.SHARED / "tokenizers" / "qwen2")
    path = bench_real.write_prompts(tmp_path / "prompts.jsonl", "long", qwen2, n=20)
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    tok = AutoTokenizer.from_pretrained(qwen2)
    assert len(rows) == 20
    assert all(len(tok(f"问：{r['instruction']}\n\n答：", add_special_tokens=False)["input_ids"]) >= 256 for r in rows)


def _trl112_venv() -> bool:
    python = REPO / ".venv-trl112" / "bin" / "python"
    return python.is_file() and subprocess.run(
        [str(python), "-c", "import trl, sys; sys.exit(trl.__version__ != '1.12.0')"], capture_output=True).returncode == 0


@pytest.mark.slow  # three tiny PPO runs of 2 updates, each in its own process (~1-2 min)
def test_the_whole_script_on_a_tiny_model(assets, tmp_path):
    variants = ("plain_trl," if _trl112_venv() else "") + "rlhf_trl,rlhf_trl_lean"
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_real.py"), "--model", assets["base_model"],
                           "--output_dir", str(out), "--updates", "2", "--variants", variants],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench = json.load(open(out / "bench_real.json"))
    assert list(bench["variants"]) == variants.split(","), [(out / f"{v}.log").read_text()[-2000:]
                                                            for v in variants.split(",")]
    for name, r in bench["variants"].items():
        assert "error" not in r, (name, (out / f"{name}.log").read_text()[-3000:])
        assert (r["updates_run"], r["updates_timed"]) == (2, 1)
        assert r["generation"] > 0 and r["scoring"] > 0 and r["optimisation"] > 0, name
        assert r["peak_rss_bytes"] > 0 and r["shape"]["rows"] == 4
        assert r["settings"]["per_device_train_batch_size"] == 4
        assert not (out / "runs" / name).exists()  # its merged models are removed
    md = (out / "bench_real.md").read_text()
    assert "| rlhf_trl_lean | 4 x 1 | 2 (1) |" in md and "Verdict:" in md
    if "plain_trl" in bench["variants"]:
        assert bench["targets"][0]["ratio"] == pytest.approx(bench["variants"]["rlhf_trl"]["seconds_vs_plain_trl"])
