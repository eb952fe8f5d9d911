"""The cost of scoring with a reward model of another tokenizer (`rlhf_trl.reward_models.RewardTokens`), for
``bench.py``: one PPO update's rollouts (the demo policy's responses to the demo prompts, ``DEMO_PPO_BATCH`` rows of at
most ``response_length`` tokens) decoded and re-encoded with the Qwen2 tokenizer (../shared/tokenizers/qwen2), timed
(median of ``repeats``) against the PPO update time measured by ``ppo_breakdown`` on the same machine.

``reencode_ratio`` = (seconds per update + re-encoding seconds per update) / seconds per update (target <= 1.05):
what a PPO update costs with the re-encoding added. The reward model's forward runs either way (on ids of its own
tokenizer) and is not counted; the prompts' RM ids are encoded once per run (``prompt_encode_seconds``, not per
update)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

QWEN2 = Path(__file__).resolve().parents[1].parent / "shared" / "tokenizers" / "qwen2"


def reencode_cost(paths: dict, seconds_per_update: float | None, rows: int, response_length: int,
                  repeats: int = 5) -> dict:
    """``{"reencode_seconds_per_update", "prompt_encode_seconds", "rows", "response_tokens", "rm_tokens",
    "seconds_per_update", "reencode_ratio", "rm_tokenizer"}``; ``reencode_ratio`` None (with ``skipped``) without
    the Qwen2 tokenizer or an update time."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_trl.data import DataArguments, Template, read_records
    from rlhf_trl.models import eos_token_ids, load_tokenizer
    from rlhf_trl.reward_models import RewardTokens
    from rlhf_trl.scoring import sample

    out = {"rm_tokenizer": str(QWEN2), "rows": rows, "seconds_per_update": seconds_per_update,
           "reencode_ratio": None}
    if not QWEN2.is_dir() or not seconds_per_update:
        return {**out, "skipped": f"no tokenizer at {QWEN2}" if not QWEN2.is_dir() else "no PPO update time"}
    policy_tok = load_tokenizer(paths["tokenizer"], padding_side="left")
    records = read_records(DataArguments(dataset_name=paths["prompts"], dataset_format="prompt"), "prompts")[:rows]
    records = (records * (rows // max(1, len(records)) + 1))[:rows]
    tokens = RewardTokens(load_tokenizer(str(QWEN2)), Template(), policy_tok, str(QWEN2))
    t = time.perf_counter()
    tokens.add_prompts("train", records)
    prompt_seconds = time.perf_counter() - t
    from rlhf_trl.data import encode_prompt

    prompts = [encode_prompt(policy_tok, Template(), r["question"]) for r in records]
    model = AutoModelForCausalLM.from_pretrained(paths["base_model"]).eval()
    eos = eos_token_ids(policy_tok, paths["base_model"])
    with torch.no_grad():
        sampled = sample(model, prompts, policy_tok.pad_token_id, eos, response_length, 0.7, seed=0)
    responses, ended = [r for r, _ in sampled], [e for _, e in sampled]
    times, ids = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        ids = tokens.sequences(tokens.prompts["train"], responses, ended)
        times.append(time.perf_counter() - t)
    seconds = statistics.median(times)
    return {**out, "reencode_seconds_per_update": seconds, "prompt_encode_seconds": prompt_seconds,
            "response_tokens": sum(len(r) for r in responses), "rm_tokens": sum(len(s) for s in ids),
            "reencode_ratio": (seconds_per_update + seconds) / seconds_per_update}
