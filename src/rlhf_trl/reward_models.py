"""The reward model as PPO reads it (baseline-shifted, on the value model's weights, or offloaded between rollouts; the
'auto' baseline); each wrapper keeps ``base_model_prefix`` and ``score`` for `rlhf_trl.scoring.sequence_scores`. A
reward model of another tokenizer scores re-encoded text (`RewardTokens`, `reward_tokens`, `score_responses`): the one
scoring path of PPO, GRPO / RLOO, ``rlhf-trl eval`` and ``compare``."""

from __future__ import annotations

import glob
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .data import DataReport, Template, encode_response, prompt_features, response_eos_id
from .models import StageInputError, load_tokenizer
from .ppo_config import sampling_config
from .ppo_math import first_true_indices
from .scoring import generate_rollouts, preserved_rng, score_sequences, sequence_scores, truncate_at_eos

logger = logging.getLogger(__name__)

OFFLOAD_PREFIX = ".tmp-offload-"


def require_reward_model(path: str, train_hint: str | None = None) -> None:
    """Check that local ``path`` is a classifier with a trained ``score``. Raises `StageInputError`: it is not."""
    if not os.path.isdir(path):
        return
    kinds = json.loads(Path(path, "config.json").read_text(encoding="utf-8")).get("architectures") or []
    files = glob.glob(os.path.join(path, "*.safetensors"))  # shards included
    names = set().union(*(safe_open(file, "pt").keys() for file in files))  # the weight names: headers only
    if kinds and not any(k.endswith("ForSequenceClassification") for k in kinds):
        problem = f"is a {kinds[0]}, not a sequence-classification model"
    elif files and not any(n == "score.weight" or n.endswith(".score.weight") for n in names):
        problem = "has no score.weight in its weights (its score head would be newly initialised at random)"
    else:
        return
    raise StageInputError(f"reward_model_path '{path}' {problem}: a reward model needs a trained score head; train "
                          f"one with `{train_hint or 'make rm'}` and use its merged/ directory")


class SharedBaseRewardModel(nn.Module):
    """The reward model read off the value model's weights (``share_reward_value_base``): the value model (LoRA SEQ_CLS
    on the reward model, in place) with its adapter off, plus the reward model's frozen score head; not a submodule, so
    ``.eval()`` and device moves miss the adapter. Raises `ValueError`: no peft value model with a wrapped ``score``."""

    base_model_prefix = "backbone"

    def __init__(self, value_model):
        super().__init__()
        from peft import PeftModel

        if not isinstance(value_model, PeftModel):
            raise ValueError("share_reward_value_base needs the value model to be a LoRA (peft) model")
        inner = value_model.get_base_model()
        if not hasattr(head := getattr(inner, "score", None), "original_module"):  # None too
            raise ValueError("share_reward_value_base: the value model has no adapter-wrapped `score` head "
                             "(LoRA task_type must be SEQ_CLS)")
        object.__setattr__(self, "_value_model", value_model)  # not registered: see the class docstring
        object.__setattr__(self, "_backbone", getattr(inner, inner.base_model_prefix))
        self.score = head.original_module  # the reward model's own head, frozen
        self.config = inner.config

    def backbone(self, **kwargs):
        """The reward model's backbone forward: the shared transformer with the value model's adapter off."""
        with self._value_model.disable_adapter():
            return self._backbone(**kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Per-token reward logits ``[batch, seq_len, 1]`` (the score at the last real token is the reward)."""
        return self.score(self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state)


class OffloadedWeights:
    """A frozen module's weights kept on disk, back in ``loaded()``. Raises `ValueError`: quantized ones."""

    def __init__(self, module: nn.Module, path: str):
        self.module, self.path = module, path
        self.params = dict(module.named_parameters())  # remove_duplicate: a tied parameter once
        if bad := [n for n, p in self.params.items() if type(p) is not nn.Parameter or not p.is_floating_point()]:
            raise ValueError(f"offload_reward_model: the reward model has quantized or non-float weights ({bad[0]}); "
                             "set `offload_reward_model: false`")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save_file({n: p.detach().contiguous() for n, p in self.params.items()}, path)
        self.release()

    def release(self) -> None:
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def read(self) -> None:
        """Read the weights back from the file onto their devices."""
        for name, tensor in load_file(self.path).items():
            self.params[name].data = tensor.to(self.params[name].device)

    @contextmanager
    def loaded(self):
        self.read()
        try:
            yield self.module
        finally:
            self.release()

    def restore(self) -> None:
        """Read the weights back for good and delete the file (the module is an ordinary module again)."""
        self.read()
        os.remove(self.path)


@torch.no_grad()
def calibrate_reward_baseline(policy, reward_model, tokenizer, dataset, args, batches: int,
                              eos_ids: list[int] | None = None, tokens: RewardTokens | None = None) -> float:
    """Mean RM score (reward units) of PPO-sampled SFT rollouts on ``batches`` batches, RNG seeded and restored
    (``tokens``: a reward model of another tokenizer, `RewardTokens`; the dataset's ``row`` indexes its prompts)."""
    from transformers import DataCollatorWithPadding

    collator, eos_ids = DataCollatorWithPadding(tokenizer), eos_ids or [tokenizer.eos_token_id]
    gen = sampling_config(args, eos_ids, tokenizer.pad_token_id)
    size, scores = args.per_device_train_batch_size, []
    with preserved_rng():
        torch.manual_seed(args.seed)
        for start in range(0, min(len(dataset), batches * size), size):
            rows = range(start, min(len(dataset), start + size))
            query = collator([{"input_ids": dataset[i]["input_ids"]} for i in rows])["input_ids"].to(policy.device)
            qr, _ = generate_rollouts(policy, query, tokenizer.pad_token_id, gen, len(rows))
            response = truncate_at_eos(qr[:, query.shape[1]:], eos_ids, tokenizer.pad_token_id)
            if tokens is not None:
                scores.append(tokens.score_batch(reward_model, "train", [dataset[i]["row"] for i in rows], response,
                                                 eos_ids, tokenizer.pad_token_id).float().cpu())
                continue
            scores.append(sequence_scores(reward_model, torch.cat((query, response), 1), tokenizer.pad_token_id,
                                          query.shape[1]).float().cpu())
    value = float(torch.cat(scores).mean())
    logger.info("reward_baseline auto: mean RM score %.4f over %d SFT rollouts", value, sum(len(s) for s in scores))
    return value


def rm_template(rm_path: str, fallback: Template) -> tuple[Template, str]:
    """The template a reward model was trained with: the data keys of ``run_config.yaml`` in ``rm_path`` or its parent
    (the RM stage's output_dir above ``merged/``), else ``fallback`` (the running recipe's). Returns ``(template,
    where it came from)``. Raises `ValueError`: a bad template combination in that file (naming it)."""
    for folder in (rm_path, os.path.dirname(os.path.normpath(rm_path))):
        if not os.path.isfile(path := os.path.join(folder, "run_config.yaml")):
            continue
        saved = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if any(k in saved for k in ("prompt_template", "completion_template", "chat_template", "system_prompt")):
            try:
                return Template(prompt=saved.get("prompt_template") or Template.prompt,
                                completion=saved.get("completion_template") or Template.completion,
                                chat=bool(saved.get("chat_template")), system_prompt=saved.get("system_prompt")), path
            except ValueError as exc:
                raise ValueError(f"{path}: the reward model's template cannot be used: {exc}") from None
    return fallback, "this recipe (no run_config.yaml beside the reward model)"


class RewardTokens:
    """How a reward model of another tokenizer reads a policy's samples, as its training pairs were built: the prompt
    rendered from its record by the RM's tokenizer and template (`rlhf_trl.data.prompt_features`, not truncated), the
    response decoded to text (special tokens skipped) and encoded on its own by `rlhf_trl.data.encode_response`
    (``raw``: the sampled text as it is), ending with the RM's EOS (chat: its end-of-turn) where the policy's response
    ended with an EOS id. ``prompts``: split name -> the RM's prompt ids ``[num_records][prompt_len]`` (`add_prompts`).
    Raises `ValueError`: a chat template without an end-of-turn token (`response_eos_id`)."""

    def __init__(self, tokenizer, template: Template, policy_tokenizer, source: str):
        self.tokenizer, self.template, self.source = tokenizer, template, source
        self.policy_tokenizer, self.pad_token_id = policy_tokenizer, tokenizer.pad_token_id
        self.eos_id = response_eos_id(tokenizer, template)
        self.prompts: dict[str, list[list[int]]] = {}

    def add_prompts(self, split: str, records: list[dict]) -> None:
        """The RM's prompt ids of ``records`` (prompt records: question, history, system, ...) as ``prompts[split]``."""
        self.prompts[split] = prompt_features(records, self.tokenizer, self.template, 1 << 30,
                                              f"reward model {self.source}", DataReport("rm"), split)["input_ids"]

    def sequences(self, prompt_ids: list[list[int]], responses: list[list[int]], ended: list[bool]) -> list[list[int]]:
        """RM ids ``prompt ids + response ids (+ EOS)`` per row: ``prompt_ids`` the RM's, ``responses`` the policy's
        ids through the first EOS (kept when ``ended``), no pads."""
        texts = self.policy_tokenizer.batch_decode([list(r[:-1]) if e else list(r) for r, e in zip(responses, ended)],
                                                   skip_special_tokens=True)
        return [list(prompt) + encode_response(self.tokenizer, self.template, text, raw=True)[:None if e else -1]
                for prompt, text, e in zip(prompt_ids, texts, ended)]

    def score_batch(self, reward_model, split: str, rows, responses: torch.Tensor, eos_ids, pad_token_id: int,
                    batch_size: int = 16) -> torch.Tensor:
        """RM scores ``[b]`` (reward units, on ``responses.device``) of prompt records ``rows`` (indices into
        ``prompts[split]``) and the policy's ``responses [b, R]`` (cut after the first EOS, right-padded with the
        policy's ``pad_token_id``). Raises `ValueError`: no row indices (the prompt dataset lacks its ``row``)."""
        if rows is None:
            raise ValueError("a reward model of another tokenizer needs each prompt's record: the dataset has no 'row'")
        lengths = first_true_indices(responses == pad_token_id).tolist()  # each response ends at its first pad
        lists = [row[:n].tolist() for row, n in zip(responses.cpu(), lengths)]
        ended = [bool(r) and eos_ids is not None and r[-1] in eos_ids for r in lists]
        prompts = [self.prompts[split][int(i)] for i in (rows.tolist() if hasattr(rows, "tolist") else rows)]
        return score_responses(reward_model, prompts, lists, ended, pad_token_id, self, batch_size).to(responses.device)


def reward_tokens(rm_path: str | None, policy_tokenizer, fallback: Template,
                  trust_remote_code: bool = False) -> RewardTokens | None:
    """`RewardTokens` for the reward model at ``rm_path`` when its tokenizer (loaded from there) has another vocabulary
    than ``policy_tokenizer`` (``get_vocab()`` compared, not names); None when they match (the policy's ids are scored
    as they are), without a reward model, or when ``rm_path`` holds no tokenizer (warned). Raises `ValueError`: as
    `rm_template` / `RewardTokens`."""
    if not rm_path or not os.path.isdir(rm_path):
        return None
    try:
        tokenizer = load_tokenizer(rm_path, trust_remote_code=trust_remote_code)
    except StageInputError:
        logger.warning("reward model %s holds no tokenizer: its scores read the policy's token ids", rm_path)
        return None
    if tokenizer.get_vocab() == policy_tokenizer.get_vocab():
        return None
    template, where = rm_template(rm_path, fallback)
    tokens = RewardTokens(tokenizer, template, policy_tokenizer, rm_path)
    logger.info("reward model %s has another tokenizer (%d tokens) than the policy (%d): it scores the decoded text "
                "re-encoded with its own tokenizer and its %s template (from %s)", rm_path, len(tokenizer),
                len(policy_tokenizer), template.mode, where)
    return tokens


def score_responses(reward_model, prompts: list[list[int]], responses: list[list[int]], ended: list[bool],
                    pad_token_id: int, tokens: RewardTokens | None = None, batch_size: int = 16) -> torch.Tensor:
    """RM scores ``[num_rows]`` (float32, CPU, reward units) of policy ``responses`` (ids through the EOS, no pads) to
    ``prompts``: the same tokenizer (``tokens`` None): ``prompt ids + response ids`` of the policy as they are (no
    decode); another (`RewardTokens`): ``prompts`` are the RM's prompt ids and the responses are re-encoded. Raises
    `ValueError`: a row without any token."""
    if tokens is None:
        return score_sequences(reward_model, [list(p) + list(r) for p, r in zip(prompts, responses)], pad_token_id,
                               batch_size)
    return score_sequences(reward_model, tokens.sequences(prompts, responses, ended), tokens.pad_token_id, batch_size)
