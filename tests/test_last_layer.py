"""The last decoder layer formed only at the read positions (`rlhf_trl.last_layer`) and the scoring functions that
use it: the read positions' outputs and every gradient equal the full layer's, and the cut layer really works on
fewer rows."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2ForSequenceClassification)

from rlhf_trl.last_layer import last_decoder_layer, reads_from, supports_suffix
from rlhf_trl.scoring import model_inputs, response_values, sequence_scores, token_scores

PAD = 0
SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def padded_ids(seed: int = 0) -> torch.Tensor:
    """``[3, 14]`` ids: a left-padded prompt, a right-padded response, one row without padding."""
    ids = torch.randint(1, 97, (3, 14), generator=torch.Generator().manual_seed(seed))
    ids[0, :3] = PAD
    ids[1, -4:] = PAD
    return ids


def model(cls=Qwen2ForCausalLM, config=Qwen2Config, attn="sdpa", **kw):
    torch.manual_seed(0)
    return cls(config(**SHAPE, attn_implementation=attn, pad_token_id=PAD, **kw)).eval()


def rows_seen(module: torch.nn.Module, calls: list):
    return module.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[1]))


@pytest.mark.parametrize("cls,config", [(Qwen2ForCausalLM, Qwen2Config), (LlamaForCausalLM, LlamaConfig)])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("padding", [True, False])
def test_read_positions_and_gradients_equal_the_full_layer(cls, config, attn, padding):
    m = model(cls, config, attn)
    ids = padded_ids() if padding else torch.randint(1, 97, (3, 14))
    start, backbone = 9, m.model
    weights = [backbone.layers[0].mlp.up_proj.weight, backbone.layers[-1].self_attn.k_proj.weight,
               backbone.layers[-1].mlp.down_proj.weight]
    full = backbone(**model_inputs(ids, PAD)).last_hidden_state[:, start:]
    full_grads = torch.autograd.grad(full.square().sum(), weights)
    calls = []
    hook = rows_seen(backbone.layers[-1].self_attn.q_proj, calls)
    with reads_from(backbone, start):
        cut = backbone(**model_inputs(ids, PAD)).last_hidden_state[:, start:]
    hook.remove()
    assert calls == [14 - start]  # the last layer's queries at the read positions only
    torch.testing.assert_close(cut, full, rtol=1e-6, atol=1e-6)
    for g, want in zip(torch.autograd.grad(cut.square().sum(), weights), full_grads):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    assert "forward" not in vars(backbone.layers[-1])  # the layer is itself again after the block


def test_lora_adapters_and_gradient_checkpointing_go_through_the_cut_layer():
    m = model()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft = get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    peft.train()
    backbone, ids, start = peft.get_base_model().model, padded_ids(1), 10
    lora = [p for n, p in peft.named_parameters() if "lora_" in n and "layers.1." in n]
    calls = []
    hook = rows_seen(backbone.layers[-1].mlp, calls)
    full = backbone(**model_inputs(ids, PAD)).last_hidden_state[:, start:]
    want = torch.autograd.grad(full.sum(), lora)
    runs, calls[:] = len(calls), []
    with reads_from(backbone, start):
        cut = backbone(**model_inputs(ids, PAD)).last_hidden_state[:, start:]
    torch.testing.assert_close(cut, full, rtol=1e-6, atol=1e-6)
    for g, w in zip(torch.autograd.grad(cut.sum(), lora), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    hook.remove()
    assert calls == [4] * runs  # checkpointed as the whole layer is (any recompute after the block still cut)


def test_unsupported_layers_and_disabled_blocks_run_in_full():
    m = model()
    layer = last_decoder_layer(m.model)
    assert supports_suffix(layer)
    layer.self_attn.sliding_window = 4  # a sliding window: the mask is not a plain causal one
    assert not supports_suffix(layer)
    layer.self_attn.sliding_window = None
    calls = []
    hook = rows_seen(layer.self_attn.q_proj, calls)
    for enabled, start in ((False, 5), (True, 0)):
        with reads_from(m.model, start, enabled=enabled):
            m.model(**model_inputs(padded_ids(), PAD))
    hook.remove()
    assert calls == [14, 14]
    assert not supports_suffix(None) and not supports_suffix(torch.nn.Linear(2, 2))


def test_baichuan_layers_are_not_cut(tmp_path):
    from baichuan_fixture import write_tiny_baichuan
    from transformers import AutoModelForCausalLM

    path = write_tiny_baichuan(str(tmp_path / "baichuan"))
    m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    layer = last_decoder_layer(m.model)
    assert layer is not None and not supports_suffix(layer)  # W_pack attention: runs in full


def test_response_values_and_sequence_scores_read_what_token_scores_reads():
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(Qwen2Config(**SHAPE, num_labels=1, pad_token_id=PAD)).eval()
    ids, context = padded_ids(2), 8
    per_token = token_scores(rm, ids, PAD)
    torch.testing.assert_close(response_values(rm, ids, context, PAD), per_token[:, context - 1: -1],
                               rtol=1e-6, atol=1e-6)
    last = torch.tensor([13, 9, 13])  # the last non-pad response token of each row
    torch.testing.assert_close(sequence_scores(rm, ids, PAD, context), per_token[torch.arange(3), last],
                               rtol=1e-6, atol=1e-6)
    ended = ids.clone()
    ended[:, 11:] = PAD  # every response ended by position 10: the columns after it are not fed
    want = token_scores(rm, ended, PAD)[torch.arange(3), torch.tensor([10, 9, 10])]
    calls = []
    hook = rows_seen(rm.model.layers[-1].mlp, calls)
    got = sequence_scores(rm, ended, PAD, context)
    hook.remove()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert calls == [11 - 9]  # positions 9 and 10 of the 11 fed


def test_under_gradient_checkpointing_the_backward_recomputes_the_cut_layer_cut():
    m = model()
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    backbone, ids, start = m.model, padded_ids(3), 9
    weight = backbone.layers[-1].mlp.up_proj.weight
    calls = []
    hook = rows_seen(backbone.layers[-1].self_attn.q_proj, calls)
    full = backbone(**model_inputs(ids, PAD)).last_hidden_state[:, start:]
    want = torch.autograd.grad(full.sum(), weight)[0]
    assert calls == [14, 14]  # forward, then again in the backward
    calls.clear()
    with reads_from(backbone, start):
        cut = backbone(**model_inputs(ids, PAD)).last_hidden_state[:, start:]
    got = torch.autograd.grad(cut.sum(), weight)[0]  # after the block: the recompute is the cut layer's still
    hook.remove()
    assert calls == [5, 5]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
