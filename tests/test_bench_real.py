"""benchmarks/bench_real.py's arithmetic: parameter counts, per-phase matmul work, the summary figures."""

import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_real  # noqa: E402

QWEN_05B = {"hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864, "vocab_size": 151936,
            "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": False}


def test_param_counts_of_qwen2_5_0_5b(tmp_path):
    json.dump(QWEN_05B, open(tmp_path / "config.json", "w"))
    n = bench_real.param_counts(bench_real.model_config(str(tmp_path)))
    # per layer: q, o 896x896; k, v 896x128; gate, up, down 896x4864 (biases and norms left out)
    assert n["body"] == 24 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864) == 357826560
    assert n["head"] == 151936 * 896 and n["total"] == 357826560 + 2 * 151936 * 896  # untied: 630M, as loaded
    assert n["cut"] == 2 * 896 * 896 + 3 * 896 * 4864  # one layer's q, o, gate, up, down


def test_phase_flops_by_hand():
    n = {"body": 10, "head": 3}
    shape = {"rows": 2, "prompt_tokens": 4, "sequence_tokens": 6}  # 2 new tokens per row
    flops = bench_real.phase_flops(n, shape, {}, lean=False)
    assert flops["generation"] == 2 * 10 * 2 * 6 + 2 * 3 * 2 * 2  # body over every token, head for new tokens
    assert flops["scoring"] == 2 * 13 * 2 * 6 + 4 * 10 * 2 * 6  # reference with head; value + reward without
    assert flops["optimisation"] == 4 * 13 * 2 * 6 + 6 * 10 * 2 * 6  # LoRA policy fwd+bwd, full value fwd+bwd
    assert bench_real.phase_flops(n, shape, {}, lean=True)["optimisation"] == 4 * 13 * 12 + 4 * 10 * 12
    # read_cut (the engine's last layer at the read positions): 5 of 6 tokens fed, the last layer's 4 "cut"
    # parameters at the 2 read positions only: (10 x 5 - 4 x 3) x 2 rows; the reward model (10 x 6 - 4 x 5) x 2
    cut = bench_real.phase_flops(dict(n, cut=4), shape, {}, lean=False, full_head=False, read_cut=True)
    assert cut["scoring"] == 2 * 76 + 2 * 3 * 2 * 2 + 2 * 80 + 2 * 76
    assert cut["optimisation"] == 4 * 76 + 4 * 3 * 2 * 2 + 6 * 76


def test_summary_skips_the_warm_up_and_rates_against_the_probe():
    update = {f"{p}_{k}": v for p in ("generation", "scoring", "optimisation")
              for k, v in (("seconds", 1.0), ("peak_rss_bytes", 4), ("largest_logits_bytes", 8))}
    warm = dict(update, generation_seconds=100.0)
    run = {"variant": "rlhf_trl", "updates": [warm, update, update], "shape": {"rows": 2, "prompt_tokens": 4,
           "sequence_tokens": 6}, "threads": 2, "peak_rss_bytes": 8}
    n = {"body": 10, "head": 3}
    out = bench_real.summarise(run, n, {}, probe=100.0, base_bytes=2)
    assert out["updates_timed"] == 2 and out["seconds_per_update"] == pytest.approx(3.0)
    assert out["generation"]["gflop_per_second"] == pytest.approx(264 / 1e9)
    assert out["generation"]["fraction_of_matmul_rate"] == pytest.approx(264 / 100.0)
    assert out["peak_rss_model_copies"] == 4 and out["optimisation"]["peak_rss_model_copies"] == 2


def test_each_variant_is_rated_against_its_own_lm_head_work():
    """TRL 1.12 forms the policy's and reference's logits at every position, the engine at the response positions
    only: each variant's matmul work is its own."""
    n = {"body": 10, "head": 3}
    shape = {"rows": 2, "prompt_tokens": 4, "sequence_tokens": 6}
    flops = bench_real.phase_flops(n, shape, {}, lean=False, full_head=False)
    assert flops["generation"] == 2 * 10 * 2 * 6 + 2 * 3 * 2 * 2
    assert flops["scoring"] == 2 * 10 * 2 * 6 + 2 * 3 * 2 * 2 + 4 * 10 * 2 * 6
    assert flops["optimisation"] == 4 * 10 * 2 * 6 + 4 * 3 * 2 * 2 + 6 * 10 * 2 * 6
    # single_value_forward: the value model's training forward gives the values: scoring loses the value forward
    single = bench_real.phase_flops(n, shape, {}, lean=False, full_head=False, single_value_forward=True)
    assert single["scoring"] == 2 * 10 * 2 * 6 + 2 * 3 * 2 * 2 + 2 * 10 * 2 * 6
    assert single["generation"] == flops["generation"] and single["optimisation"] == flops["optimisation"]


def test_summary_rates_against_the_faster_of_the_two_probes():
    update = {f"{p}_{k}": v for p in ("generation", "scoring", "optimisation")
              for k, v in (("seconds", 1.0), ("peak_rss_bytes", 4), ("largest_logits_bytes", 8))}
    run = {"variant": "plain_trl", "updates": [update], "threads": 2, "peak_rss_bytes": 8, "matmul_probe_flops": 400.0,
           "shape": {"rows": 2, "prompt_tokens": 4, "sequence_tokens": 6}}
    out = bench_real.summarise(run, {"body": 10, "head": 3}, {}, probe=100.0, base_bytes=2)
    assert out["matmul_probe_gflop_per_second"] == 400.0 / 1e9  # the run's own probe was the faster one
    assert out["generation"]["fraction_of_matmul_rate"] == pytest.approx(264 / 400.0)
    assert bench_real.summarise(dict(run, matmul_probe_flops=50.0), {"body": 10, "head": 3}, {}, probe=100.0,
                                base_bytes=2)["matmul_probe_gflop_per_second"] == 100.0 / 1e9


def test_trl_micro_batch_keeps_the_episodes_per_update():
    size = bench_real.SIZES["issue"]
    assert bench_real.trl_size(size, 4) == dict(size, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(SystemExit, match=r"micro-batch 3 \(--trl_micro_batch / --engine_micro_batch\) does not "
                                         "divide the batch of 8 episodes"):
        bench_real.trl_size(size, 3)


def test_each_side_takes_its_own_micro_batch_option():
    from types import SimpleNamespace

    args = SimpleNamespace(trl_micro_batch=4, engine_micro_batch=None)
    assert bench_real.micro_batch(args, "plain_trl") == 4 and bench_real.micro_batch(args, "rlhf_trl_fast") is None
    args.engine_micro_batch = 2
    assert bench_real.micro_batch(args, "rlhf_trl_lean") == 2


def test_a_reused_run_keeps_the_micro_batches_it_ran_with():
    size = bench_real.SIZES["issue"]
    ran = bench_real.trl_size(size, 4)
    # reused by a command without --trl_micro_batch: the run's own micro-batches of 4 give its floor, not the size's 8
    assert bench_real.run_settings({"settings": ran}, size, None) == ran
    assert bench_real.run_settings({"settings": ran}, size, 2) == ran
    # a run saved before runs recorded their settings: this command's flags, as before
    assert bench_real.run_settings({}, size, 4) == ran
    assert bench_real.run_settings({}, size, None) == size


def test_the_engine_runs_on_huge_pages_as_the_command_does_and_trl_as_a_plain_script():
    assert bench_real.child_env("rlhf_trl_fast")["THP_MEM_ALLOC_ENABLE"] == "1"
    assert bench_real.child_env("plain_trl")["THP_MEM_ALLOC_ENABLE"] == "0"
    assert bench_real.child_env("plain_trl", trl_huge_pages=True)["THP_MEM_ALLOC_ENABLE"] == "1"
    run = {"variant": "plain_trl", "updates": [{f"{p}_{k}": 1.0 for p in ("generation", "scoring", "optimisation")
                                                for k in ("seconds", "peak_rss_bytes", "largest_logits_bytes")}],
           "threads": 2, "peak_rss_bytes": 8, "huge_pages": True,
           "shape": {"rows": 2, "prompt_tokens": 4, "sequence_tokens": 6}}
    assert bench_real.summarise(run, {"body": 10, "head": 3}, {}, probe=100.0, base_bytes=2)["huge_pages"] is True


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


def _gemm_flops(products: dict) -> int:
    return sum(2 * m * k * n * count for (m, k, n), count in products.items())


@pytest.mark.parametrize("svf,lean,full_head,cut", [(True, False, False, False), (False, False, True, False),
                                                     (True, True, False, False), (True, False, False, True),
                                                     (False, True, False, True)])
def test_the_floor_runs_the_products_whose_flops_phase_flops_counts(tmp_path, svf, lean, full_head, cut):
    """`update_gemms` lists the update's layer and LM-head products at their real shapes; their FLOPs are
    `phase_flops`'s (generation: one token per row fewer, the last sampled token is never fed back)."""
    json.dump(QWEN_05B, open(tmp_path / "config.json", "w"))
    n = bench_real.param_counts(bench_real.model_config(str(tmp_path)))
    shape = {"rows": 8, "prompt_tokens": 256, "sequence_tokens": 320}
    settings = dict(bench_real.SIZES["issue"], per_device_train_batch_size=4, gradient_accumulation_steps=2)
    gemms = bench_real.update_gemms(QWEN_05B, shape, settings, lean, full_head, svf, read_cut=cut)
    flops = bench_real.phase_flops(n, shape, settings, lean, full_head, svf, read_cut=cut)
    assert _gemm_flops(gemms["scoring"]) == flops["scoring"]
    assert _gemm_flops(gemms["optimisation"]) == flops["optimisation"]
    assert _gemm_flops(gemms["generation"]) == flops["generation"] - 2 * n["body"] * 8
    # shapes: decoding multiplies 8 rows (one per sequence) by the LM head 64 times; a micro-batch of 4 x 320 tokens
    assert gemms["generation"][(8, 896, 151936)] == 64 and gemms["generation"][(8, 896, 4864)] == 2 * 63 * 24
    if not cut:
        # gate and up forwards and down's input gradient, policy and value, 2 micro-batches of 4 x 320 tokens
        assert gemms["optimisation"][(1280, 896, 4864)] == 3 * 2 * 2 * 24
        assert gemms["optimisation"].get((4864, 1280, 896), 0) == (0 if lean else 2 * 2 * 24)  # value weight grads
        return
    # the engine: 4 x 319 tokens fed; the last layer's gate / up / down at the 4 x 64 read positions only, its k and
    # v at all of them; the reward model's last layer at one position per row
    assert gemms["optimisation"][(1276, 896, 4864)] == 3 * 2 * 2 * 23
    assert gemms["optimisation"][(256, 896, 4864)] == 3 * 2 * 2
    assert gemms["optimisation"][(1276, 896, 128)] == 2 * 24 * 2 * 2  # k and v forwards, policy and value, 2 micro
    assert (1280, 896, 4864) not in gemms["optimisation"]
    assert gemms["scoring"][(2560, 896, 4864)] == 2 * 23 and gemms["scoring"][(8, 896, 4864)] == 2  # reward model
    assert gemms["scoring"][(2552, 896, 4864)] == 2 * 23 * (1 if svf else 2)  # reference (, value)
    assert flops["optimisation"] < bench_real.phase_flops(n, shape, settings, lean, full_head, svf)["optimisation"]


def _product_flops(products: dict) -> float:
    return sum(2 * b * m * k * n * count for (b, m, k, n), count in products.items())


def test_the_floor_of_all_products_adds_attention_lora_and_recomputed_forwards():
    """`other_gemms` at the issue's setting (8 rows of 256 + 64 tokens, micro-batches of 4, 24 layers, 14 heads of
    64): counted by hand."""
    shape = {"rows": 8, "prompt_tokens": 256, "sequence_tokens": 320}
    settings = dict(bench_real.SIZES["issue"], per_device_train_batch_size=4, gradient_accumulation_steps=2)
    fast = bench_real.other_gemms(QWEN_05B, shape, settings, lean=False, full_head=False, single_value_forward=True,
                                  fused_lora=True)
    gen, opt = fast["generation"], fast["optimisation"]
    assert gen[(8 * 14, 256, 64, 256)] == 0.5 * 24  # prefill's Q K^T: half of the causal square, 24 layers
    assert gen[(8 * 14, 1, 64, 257)] == gen[(8 * 14, 1, 319, 64)] == 24  # decoding steps 1 and 63 against the cache
    assert (8 * 14, 1, 64, 320) not in gen  # the last sampled token is never fed back
    assert gen[(1, 4864, 16, 896)] == 2 * 24  # fused LoRA: gate's and up's B @ A, once per generate call
    assert (1, 2048, 896, 16) not in gen  # no adapter products per token
    assert fast["scoring"] == {(8 * 14, 320, 64, 320): 0.5 * 24 * 2, (8 * 14, 320, 320, 64): 0.5 * 24 * 2}
    # training, policy and value, 2 micro-batches: QK^T and dP = dO V^T; PV, dV, dQ, dK
    assert opt[(4 * 14, 320, 64, 320)] == 2 * 2 * 24 * 2 * 0.5
    assert opt[(4 * 14, 320, 320, 64)] == 2 * 2 * 24 * 4 * 0.5
    # the policy's adapters: x A^T on 896 inputs (all but down's), dY B on 896 outputs (q, o, down)
    assert opt[(1, 1280, 896, 16)] == (6 + 3) * 24 * 2
    assert opt[(1, 16, 1280, 4864)] == 24 * 2  # down's dA
    assert (1, 1280, 896, 4864) not in opt  # no recomputed forward
    lean = bench_real.other_gemms(QWEN_05B, shape, settings, lean=True, full_head=False, single_value_forward=True,
                                  fused_lora=True, recompute=True)
    assert lean["optimisation"][(1, 1280, 896, 4864)] == 2 * 24 * 2 * 2  # gate and up recomputed, both models
    assert lean["optimisation"][(4 * 14, 320, 64, 320)] == opt[(4 * 14, 320, 64, 320)] + 2 * 24 * 2 * 0.5
    body = sum(i * o for i, o in bench_real.layer_linears(QWEN_05B)) * 24
    value_lora = 16 * (896 + 896) + 16 * (896 + 128)  # q_proj and v_proj, rank 16
    assert _product_flops(lean["optimisation"]) - _product_flops(opt) == pytest.approx(
        2 * 2 * body * 1280 * 2  # recomputed body forwards
        + 2 * 2 * 24 * (2 * 0.5) * 2 * 56 * 320 * 64 * 320  # recomputed QK^T and PV
        + 24 * 2 * 2 * 4 * value_lora * 1280  # the value adapter: forward + backward (3 forwards' work) + recompute
        + 24 * 2 * 2 * 16 * 22912 * 1280)  # the policy adapter's recomputed forward (rank 16 x sum of in + out)
    trl = bench_real.other_gemms(QWEN_05B, shape, settings, lean=False, full_head=True)
    assert trl["generation"][(1, 8, 896, 16)] == 6 * 24 * 63  # peft's adapters at every decoding step
    assert len(trl["scoring"]) == 2 and trl["scoring"][(8 * 14, 320, 64, 320)] == 0.5 * 24 * 3  # + value forward


def test_product_seconds_times_batched_products_and_plain_ones():
    assert 0 < bench_real.product_seconds(4, 16, 8, 16, repeats=1) < 1
    assert 0 < bench_real.product_seconds(1, 16, 8, 16, repeats=1) < 1
    assert 0 < bench_real.product_seconds(128, 8, 16, repeats=1) < 1  # `update_gemms`' (m, k, n)


def test_the_floor_times_each_shape_once_and_counts_it(tmp_path):
    gemms = {"generation": {(8, 4, 2): 3}, "scoring": {(8, 4, 2): 1, (16, 4, 2): 2}, "optimisation": {}}
    calls = []

    def timer(m, k, n):
        calls.append((m, k, n))
        return m / 8

    timings = {}
    assert bench_real.matmul_floor(gemms, timings, timer) == {"generation": 3.0, "scoring": 5.0, "optimisation": 0}
    bench_real.matmul_floor(gemms, timings, timer)
    assert calls == [(8, 4, 2), (16, 4, 2)]  # cached across phases and variants


def test_decoding_products_are_timed_on_weights_the_cache_does_not_hold(monkeypatch):
    """At most 64 rows: the runs cycle through distinct weights holding ``cold_bytes`` together (each layout its own
    set), every one touched before the timed runs; more rows: one weight."""
    import torch

    assert bench_real.cold_weight_copies(4864, 896) == 62  # 62 x 17.4 MB >= 1 GiB
    assert bench_real.cold_weight_copies(151936, 896) == 2  # the LM head: 545 MB, at least 2
    made, seen, randn = [], [], torch.randn

    def counting_randn(*shape):
        t = randn(*shape)
        if shape == (32, 32):  # a weight (the inputs are [rows, 32])
            made.append(t.data_ptr())
        return t

    monkeypatch.setattr(torch, "randn", counting_randn)
    monkeypatch.setattr(bench_real, "_timed", lambda fn: seen.append(fn) or 1e-3)
    copies = bench_real.cold_weight_copies(32, 32, cold_bytes=1 << 16)
    assert copies == 16
    assert bench_real.gemm_seconds(8, 32, 32, repeats=3, cold_bytes=1 << 16) == 1e-3
    layouts = 3 if torch.backends.mkldnn.is_available() else 2
    assert len(made) == layouts * copies and len(seen) == 3 * layouts
    assert all(len(set(made[i * copies:(i + 1) * copies])) == copies for i in range(layouts))  # live together
    made.clear()
    bench_real.gemm_seconds(128, 32, 32, repeats=1, cold_bytes=1 << 16)
    assert len(made) == 2  # one weight per layout past 64 rows


def test_gemm_seconds_scales_rows_past_the_timed_slab():
    small = bench_real.gemm_seconds(8, 32, 32, repeats=1)
    assert 0 < small < 1
    assert bench_real.gemm_seconds(4096, 32, 32, repeats=1, slab=(128, 32, 16)) > 0


def test_the_report_puts_each_variant_beside_its_floor_and_trl(tmp_path):
    update = {f"{p}_{k}": v for p in ("generation", "scoring", "optimisation")
              for k, v in (("seconds", 10.0), ("peak_rss_bytes", 4), ("largest_logits_bytes", 8))}
    shape = {"rows": 2, "prompt_tokens": 4, "sequence_tokens": 6}
    cfg = dict(QWEN_05B, num_hidden_layers=1, hidden_size=8, intermediate_size=16, vocab_size=32, num_attention_heads=2,
               num_key_value_heads=1)
    bench = {"model_name": "m", "size": "issue", "settings": {}, "matmul_gflop_per_second": 1.0,
             "base_model_bytes": 2, "variants": {}}
    timings = {}
    for variant, seconds in (("plain_trl", 20.0), ("rlhf_trl_fast", 10.0)):
        run = {"variant": variant, "updates": [dict(update, optimisation_seconds=seconds)],
               "threads": 2, "peak_rss_bytes": 8, "shape": shape}
        out = bench_real.summarise(run, {"body": 10, "head": 3}, {}, probe=100.0, base_bytes=2)
        bench_real.add_floor(out, run, cfg, {}, timings, timer=lambda *key: 0.01)
        bench["variants"][variant] = out
    fast, trl = bench["variants"]["rlhf_trl_fast"], bench["variants"]["plain_trl"]
    assert fast["matmul_floor_seconds"]["total"] == pytest.approx(0.01 * sum(
        sum(p.values()) for p in bench_real.update_gemms(cfg, shape, {}, False, False).values()))
    assert fast["seconds_vs_matmul_floor"] == pytest.approx(30.0 / fast["matmul_floor_seconds"]["total"])
    others = bench_real.other_gemms(cfg, shape, {}, False, False, fused_lora=True)  # rlhf_trl_fast: fused LoRA
    assert fast["matmul_floor_all_seconds"]["total"] == pytest.approx(
        fast["matmul_floor_seconds"]["total"] + 0.01 * sum(sum(p.values()) for p in others.values()))
    assert fast["seconds_vs_matmul_floor_all"] == pytest.approx(30.0 / fast["matmul_floor_all_seconds"]["total"])
    for r in bench["variants"].values():
        r["seconds_vs_plain_trl"] = r["seconds_per_update"] / trl["seconds_per_update"]
        r["peak_rss_vs_plain_trl"] = 1.0
    bench_real.write_markdown(bench, tmp_path / "b.md")
    text = (tmp_path / "b.md").read_text()
    floor = fast["matmul_floor_seconds"]["total"]
    assert "| rlhf_trl_fast | 30.0 |" in text and f"{floor:.1f} ({30.0 / floor:.2f}) |" in text
    every = fast["matmul_floor_all_seconds"]["total"]
    assert f"{floor:.1f} ({30.0 / floor:.2f}) | {every:.1f} ({30.0 / every:.2f}) |" in text
    assert f"rlhf_trl_fast {floor:.1f} s ({floor / 40.0:.2f}x)" in text and "rlhf_trl_fast 0.75x s" in text


def test_the_report_has_no_trl_line_without_an_engine_variant(tmp_path):
    update = {f"{p}_{k}": v for p in ("generation", "scoring", "optimisation")
              for k, v in (("seconds", 10.0), ("peak_rss_bytes", 4), ("largest_logits_bytes", 8))}
    run = {"variant": "plain_trl", "updates": [update], "threads": 2, "peak_rss_bytes": 8,
           "shape": {"rows": 2, "prompt_tokens": 4, "sequence_tokens": 6}}
    trl = bench_real.summarise(run, {"body": 10, "head": 3}, {}, probe=100.0, base_bytes=2)
    trl.update(seconds_vs_plain_trl=1.0, peak_rss_vs_plain_trl=1.0)
    bench = {"model_name": "m", "size": "issue", "settings": {}, "matmul_gflop_per_second": 1.0,
             "base_model_bytes": 2, "variants": {"plain_trl": trl}}
    bench_real.write_markdown(bench, tmp_path / "b.md")
    text = (tmp_path / "b.md").read_text()
    assert "| plain_trl | 30.0 |" in text and "vs plain_trl" not in text


def test_floor_timings_round_trip(tmp_path):
    path = tmp_path / "matmul_floor_timings.json"
    assert bench_real.load_timings(path) == {}
    bench_real.save_timings(path, {(8, 896, 151936): 0.05, (1280, 896, 4864): 0.07, (56, 320, 64, 320): 0.002})
    assert bench_real.load_timings(path) == {(8, 896, 151936): 0.05, (1280, 896, 4864): 0.07,
                                             (56, 320, 64, 320): 0.002}


def test_the_meter_times_the_canary_around_each_phase_outside_its_clock(monkeypatch):
    """Each phase's end times the canary product, after the phase's clock stopped: the phase's seconds exclude it,
    and ``<phase>_canary_seconds`` holds the canary before the phase began and the one after it ended."""
    import time

    ticks = iter(range(1, 100))

    def canary(self):
        time.sleep(0.05)  # a canary takes time; none of it may land in a phase
        return float(next(ticks))

    monkeypatch.setattr(bench_real.PhaseMeter, "_measure_canary", canary)
    meter = bench_real.PhaseMeter(canary=False)  # canary 1: at the start
    meter.enter("generation")
    meter.enter("scoring")  # canary 2: generation ended
    meter.enter("optimisation")  # canary 3
    meter.enter("optimisation")  # the same phase again: no canary
    meter.end_update()  # canary 4
    u = meter.updates[0]
    assert u["generation_canary_seconds"] == [1.0, 2.0] and u["scoring_canary_seconds"] == [2.0, 3.0]
    assert u["optimisation_canary_seconds"] == [3.0, 4.0]
    assert [len(u[f"{p}_canary_piece_seconds"]) for p in ("generation", "scoring", "optimisation")] == [1, 1, 1]
    assert u["generation_canary_piece_seconds"] == [u["generation_seconds"]]
    assert all(u[f"{p}_seconds"] < 0.04 for p in ("generation", "scoring", "optimisation"))


def test_the_real_canary_is_the_product_the_parent_times():
    meter = bench_real.PhaseMeter()
    assert 0 < meter.last_canary < 10 and tuple(meter._canary[0].shape) == bench_real.CANARY[:3]
    assert tuple(meter._canary[1].shape) == (1, *bench_real.CANARY[2:])
    assert meter._empty()["scoring_canary_seconds"] == []


def test_run_speed_puts_each_phase_at_the_speed_its_canaries_ran(tmp_path):
    """Per phase: each piece's faster canary, weighted by the piece's seconds, over the best; the median over the
    timed updates (the warm-up left out); the floor at run speed scales each phase's floor; the comparison with TRL
    divides each side by its own speed."""
    assert bench_real.phase_canary([2.0, 2.0, 1.5, 1.6], [0.01, 60.0]) == pytest.approx((0.02 + 90.0) / 60.01)
    assert bench_real.phase_canary([2.0, 2.0, 1.5, 1.6], None) == pytest.approx(1.75)  # saved without pieces
    assert bench_real.phase_canary([1.0, 3.0], [5.0]) == 1.0  # a stall at one end does not count

    def update(gen, score, opt, pieces=None):
        u = {"generation_seconds": 10.0, "scoring_seconds": 10.0, "optimisation_seconds": 20.0,
             "generation_canary_seconds": gen, "scoring_canary_seconds": score, "optimisation_canary_seconds": opt}
        return dict(u, optimisation_canary_piece_seconds=pieces) if pieces else u

    warm = update([9.0, 9.0], [9.0, 9.0], [9.0, 9.0])
    run = {"updates": [warm, update([1.2, 1.4], [1.0, 3.0], [2.0, 2.0, 1.5, 1.6], [0.01, 60.0]),
                       update([1.1, 1.1], [1.0, 1.0], [1.5, 1.5], [60.0]),
                       update([1.3, 1.3], [1.2, 1.2], [1.5, 1.5])]}
    assert bench_real.canaries(run)[:2] == [9.0, 9.0] and len(bench_real.canaries(run)) == 26
    speed = bench_real.run_speed(run, canary_best=1.0)
    assert speed == pytest.approx({"generation": 1.2, "scoring": 1.0, "optimisation": 1.5})
    assert bench_real.run_speed({"updates": [{"generation_seconds": 1.0}]}, 1.0) is None  # saved before canaries

    out = {"seconds_per_update": 40.0, "peak_rss_bytes": 2,
           "matmul_floor_all_seconds": {"generation": 8.0, "scoring": 8.0, "optimisation": 16.0, "total": 32.0}}
    bench_real.add_run_speed(out, speed)
    at_speed = 8.0 * 1.2 + 8.0 + 16.0 * 1.5
    assert out["matmul_floor_all_at_run_speed_seconds"]["total"] == pytest.approx(at_speed)
    assert out["seconds_vs_matmul_floor_all_at_run_speed"] == pytest.approx(40.0 / at_speed)
    assert out["run_speed"]["update"] == pytest.approx(at_speed / 32.0)

    trl = {"seconds_per_update": 100.0, "peak_rss_bytes": 4, "run_speed": {"update": 1.0}}
    variants = {"plain_trl": trl, "rlhf_trl_fast": out, "old": {"seconds_per_update": 50.0, "peak_rss_bytes": 1}}
    bench_real.add_trl_ratios(variants)
    assert out["seconds_vs_plain_trl"] == pytest.approx(0.4) and out["peak_rss_vs_plain_trl"] == 0.5
    assert out["seconds_vs_plain_trl_at_run_speed"] == pytest.approx(40.0 / (at_speed / 32.0) / 100.0)
    assert "seconds_vs_plain_trl_at_run_speed" not in variants["old"]  # no canaries: no figure at run speed

    bench = {"model_name": "m", "size": "issue", "settings": {}, "matmul_gflop_per_second": 1.0,
             "base_model_bytes": 2, "canary_best_seconds": 0.025, "variants": {}}
    bench_real.write_markdown(bench, tmp_path / "b.md")  # no run with canaries: no table for them
    assert "run speed" not in (tmp_path / "b.md").read_text()
    for name, r in variants.items():
        r.update(updates_timed=1, shape={"rows": 2, "prompt_tokens": 4, "sequence_tokens": 6}, seconds_vs_matmul_work=1,
                 peak_rss_model_copies=1, **{p: {"seconds": 1.0, "fraction_of_matmul_rate": 1.0,
                                                "peak_rss_model_copies": 1, "largest_logits_bytes": 1}
                                             for p in ("generation", "scoring", "optimisation")})
    out["seconds_vs_matmul_floor_all"] = 40.0 / 32.0
    trl.update(run_speed={"generation": 1.0, "scoring": 1.0, "optimisation": 1.0, "update": 1.0},
               matmul_floor_all_at_run_speed_seconds={"total": 50.0}, seconds_vs_matmul_floor_all_at_run_speed=2.0)
    bench["variants"] = variants
    bench_real.write_markdown(bench, tmp_path / "b.md")
    text = (tmp_path / "b.md").read_text()
    assert "its best: 25.0 ms" in text
    ratio = 40.0 / (at_speed / 32.0) / 100.0
    assert (f"| rlhf_trl_fast | 1.20 / 1.00 / 1.50 / {at_speed / 32:.2f} | {at_speed:.1f} ({40.0 / at_speed:.2f}) | "
            f"{ratio:.2f}x |") in text
    assert "| plain_trl | 1.00 / 1.00 / 1.00 / 1.00 | 50.0 (2.00) | 1.00x |" in text and "| old | 1.00" not in text
