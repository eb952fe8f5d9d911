"""Tokenizer pad handling and stage-input checks."""

import pytest

from rlhf_trl.models import StageInputError, atomic_dir, load_tokenizer, require_model_dir


def test_pad_equal_to_eos_is_replaced(tokenizer, tmp_path):
    """Qwen base tokenizers use one token for pad and EOS; PPO needs them distinct."""
    tokenizer.save_pretrained(tmp_path)
    import json

    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pad_token"] = cfg["eos_token"]
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert tok.pad_token == "<|pad|>"  # an existing special token of the vocabulary, no resize needed
    assert len(tok) == len(tokenizer)


def test_explicit_pad_equal_to_eos_is_refused(assets):
    with pytest.raises(ValueError, match="equals the EOS token"):
        load_tokenizer(assets["tokenizer"], pad_token="<|endoftext|>")


def test_padding_side(assets):
    assert load_tokenizer(assets["tokenizer"], padding_side="left").padding_side == "left"


def test_require_model_dir(tmp_path, assets):
    assert require_model_dir(assets["base_model"], "base model") == assets["base_model"]
    assert require_model_dir("Qwen/Qwen2.5-0.5B", "base model") == "Qwen/Qwen2.5-0.5B"  # hub id passes through
    with pytest.raises(StageInputError, match="not found.*run `make sft`"):
        require_model_dir(str(tmp_path / "none"), "SFT model", "make sft")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(StageInputError, match="holds no weights"):
        require_model_dir(str(tmp_path / "empty"), "SFT model")


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(str(target)) as tmp:
            open(f"{tmp}/half", "w").write("x")
            raise RuntimeError("crash")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_dir(str(target)) as tmp:
        open(f"{tmp}/full", "w").write("x")
    assert (target / "full").exists()
