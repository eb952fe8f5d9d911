"""The same three stages as rlhf_trl, written the way a blog-post script would: plain TRL, no rlhf_trl import.

    python benchmarks/plain_trl.py sft --config recipes/demo/sft.yaml [--key value ...]
    python benchmarks/plain_trl.py rm  --config recipes/demo/rm.yaml  [--key value ...]
    python benchmarks/plain_trl.py ppo --config recipes/demo/ppo.yaml [--key value ...]

The baseline of benchmarks/bench.py's overhead figures: read the jsonl, format ``问：{question}\\n\\n答：{answer}``,
tokenize (prompt ids + answer ids + EOS, as rlhf_trl does, so both sides train on the same token ids), build
`trl.SFTTrainer` / `trl.RewardTrainer` / `trl.experimental.ppo.PPOTrainer`, train, save the LoRA adapter (if any) and
the merged model (PPO: also the value model).

Hyperparameters come from the same recipe YAML and ``--key value`` overrides as the rlhf_trl run, so both sides use
the same TrainingArguments values: keys that are fields of the stage's TRL config class go to it, the model keys
(``model_name_or_path``, ``dtype``, ``use_peft``, ``lora_*``) and ``dataset_name`` / ``max_prompt_length`` /
``eval_split_size`` (PPO: the number of eval prompts) are read here, every other key is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import yaml

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse(argv: list[str]) -> tuple[str, dict]:
    stage, rest = argv[0], argv[1:]
    cfg: dict = {}
    overrides: dict = {}
    i = 0
    while i < len(rest):
        key, value = rest[i].lstrip("-"), rest[i + 1]
        if key == "config":
            with open(value, encoding="utf-8") as f:
                cfg.update(yaml.safe_load(f) or {})
        else:
            overrides[key] = value
        i += 2
    for key, value in overrides.items():
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        else:  # strings stay strings ("no" is a save strategy, not YAML's false)
            value = {"true": True, "false": False}.get(value.lower(), value)
        cfg[key] = value
    return stage, cfg


def config_for(cls, cfg: dict):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in cfg.items() if k in names})


def lora_config(cfg: dict, task_type: str):
    from peft import LoraConfig

    if not cfg.get("use_peft"):
        return None
    return LoraConfig(r=cfg.get("lora_r", 16), lora_alpha=cfg.get("lora_alpha", 32),
                      lora_dropout=cfg.get("lora_dropout", 0.0), target_modules=cfg.get("lora_target_modules"),
                      task_type=task_type)


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def question(row: dict) -> str:
    return row["instruction"] + ("\n" + row["input"] if row.get("input") else "")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def save(model, tok, out: str, peft: bool) -> None:
    if peft:
        model.save_pretrained(os.path.join(out, "adapter"))
        model = model.merge_and_unload()
    model.save_pretrained(os.path.join(out, "merged"))
    tok.save_pretrained(os.path.join(out, "merged"))


def dtype_of(cfg: dict):
    import torch

    name = cfg.get("dtype", "float32")
    return name if name in (None, "auto") else getattr(torch, name)


def sft(cfg: dict) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(cfg["model_name_or_path"])
    rows = []
    for row in read_jsonl(cfg["dataset_name"]):
        p = ids(tok, f"问：{question(row)}\n\n答：")
        c = ids(tok, row["output"]) + [tok.eos_token_id]
        rows.append({"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)})
    model = AutoModelForCausalLM.from_pretrained(cfg["model_name_or_path"], dtype=dtype_of(cfg))
    args = config_for(SFTConfig, cfg)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                         peft_config=lora_config(cfg, "CAUSAL_LM"))
    trainer.train()
    save(trainer.model, tok, args.output_dir, bool(cfg.get("use_peft")))


def rm(cfg: dict) -> None:
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tok = AutoTokenizer.from_pretrained(cfg["model_name_or_path"])
    rows = []
    for row in read_jsonl(cfg["dataset_name"]):  # ranked answers, best first -> every ordered pair
        p = ids(tok, f"问：{question(row)}\n\n答：")
        answers = [ids(tok, a) + [tok.eos_token_id] for a in row["output"]]
        for a in range(len(answers)):
            for b in range(a + 1, len(answers)):
                rows.append({"chosen_ids": p + answers[a], "rejected_ids": p + answers[b]})
    model = AutoModelForSequenceClassification.from_pretrained(cfg["model_name_or_path"], num_labels=1,
                                                               dtype=dtype_of(cfg))
    model.config.pad_token_id = tok.pad_token_id
    args = config_for(RewardConfig, cfg)
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                            peft_config=lora_config(cfg, "SEQ_CLS"))
    trainer.train()
    save(trainer.model, tok, args.output_dir, bool(cfg.get("use_peft")))


def ppo(cfg: dict) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    args = config_for(PPOConfig, cfg)
    tok = AutoTokenizer.from_pretrained(args.sft_model_path, padding_side="left")
    n = cfg.get("max_prompt_length", 32)
    prompts = [{"input_ids": ids(tok, f"问：{question(row)}\n\n答：")[-n:]} for row in read_jsonl(cfg["dataset_name"])]
    n_eval = int(cfg.get("eval_split_size", 16))
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=dtype_of(cfg))
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model_path, num_labels=1,
                                                                      dtype=dtype_of(cfg))
    value_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model_path, num_labels=1,
                                                                     dtype=dtype_of(cfg))
    for m in (policy, reward_model, value_model):
        m.config.pad_token_id = tok.pad_token_id
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None, reward_model=reward_model,
                         value_model=value_model, train_dataset=Dataset.from_list(prompts[n_eval:]),
                         eval_dataset=Dataset.from_list(prompts[:n_eval]), peft_config=lora_config(cfg, "CAUSAL_LM"),
                         callbacks=cfg.get("callbacks"))
    trainer.train()
    save(trainer.model.policy, tok, args.output_dir, bool(cfg.get("use_peft")))
    trainer.model.value_model.save_pretrained(os.path.join(args.output_dir, "value_model"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("sft", "rm", "ppo"):
        print("usage: plain_trl.py {sft,rm,ppo} --config RECIPE.yaml [--key value ...]", file=sys.stderr)
        return 2
    stage, cfg = parse(argv)
    {"sft": sft, "rm": rm, "ppo": ppo}[stage](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
