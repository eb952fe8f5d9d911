"""The last decoder layer computed only at the positions a caller reads.

A decoder's last layer feeds nothing but the final norm and the head. At a position whose output nobody reads, its
keys and values are still needed (the read positions attend to them), but its queries, attention, output projection
and MLP are wasted work. PPO reads few positions of a ``[b, T]`` sequence: the policy's and reference's log-probs and
the value model's estimates at the response's ``R + 1`` contexts, the reward model's score at one token per row. With
``T = 320`` and ``R = 64`` the last layer's queries, ``o_proj`` and MLP then run on 65 positions of 320 (one for the
reward model): about 3% of every forward and backward of a 24-layer model (the last layer is 1/24 of its body's
products, and those are ~95% of the layer).

`reads_from(backbone, start)` makes, for the block, the backbone's last layer compute its output only at positions
``>= start`` (every earlier layer runs unchanged); it returns a ``[b, T, hidden]`` tensor whose positions ``< start``
hold the layer's *input* there, not its output: whoever reads them reads the wrong values, so only the code that
chose ``start`` should call the backbone inside the block. The read positions' output equals the full layer's up to
fp32 rounding (the same products on fewer rows).

Applies to the Llama-style decoder layers transformers ships for Qwen2, Llama and Mistral (`SUPPORTED`), with SDPA
or eager attention, no sliding window, no KV cache; any other layer (Baichuan's ``W_pack``, flash attention's
packed sequences, a sliding window) runs in full, unchanged.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from torch import nn

SUPPORTED = ("Qwen2DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer")
ATTENTION = ("sdpa", "eager")


def last_decoder_layer(backbone: nn.Module) -> nn.Module | None:
    """The backbone's (``Qwen2Model``, ``LlamaModel``, ...) last decoder layer, or None without a ``layers`` list."""
    layers = getattr(backbone, "layers", None)
    return layers[-1] if isinstance(layers, nn.ModuleList) and len(layers) else None


def supports_suffix(layer: nn.Module | None) -> bool:
    """Whether `reads_from` can cut ``layer``: a `SUPPORTED` decoder layer with SDPA or eager attention and no sliding
    window."""
    attn = getattr(layer, "self_attn", None)
    config = getattr(attn, "config", None)
    return (layer is not None and type(layer).__name__ in SUPPORTED and attn is not None
            and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
            and getattr(attn, "sliding_window", None) is None
            and getattr(config, "_attn_implementation", None) in ATTENTION
            and all(hasattr(sys.modules[type(attn).__module__], f)
                    for f in ("apply_rotary_pos_emb", "eager_attention_forward", "ALL_ATTENTION_FUNCTIONS")))


def suffix_forward(layer: nn.Module, start: int, hidden_states: torch.Tensor, attention_mask=None,
                   position_embeddings=None, **kwargs) -> torch.Tensor:
    """The decoder layer's forward with its output formed only at positions ``start ..T-1``.

    ``hidden_states [b, T, hidden]`` -> ``[b, T, hidden]``: positions ``>= start`` the layer's output, positions
    ``< start`` its input (see the module docstring). Keys and values at every position; queries, attention,
    ``o_proj``, residuals and MLP at the ``n = T - start`` read positions only; the causal (and padding) mask's rows of
    those positions. Falls back to the whole layer where ``start <= 0`` or a KV cache is in use. Under gradient
    checkpointing (the layer's ``gradient_checkpointing`` in training) the cut layer is checkpointed as the layer
    would be.
    """
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    b, T, _ = hidden_states.shape
    if start <= 0 or start >= T or cache is not None or position_embeddings is None or not (
            attention_mask is None or isinstance(attention_mask, torch.Tensor)):
        return type(layer).forward(layer, hidden_states, attention_mask=attention_mask,
                                   position_embeddings=position_embeddings, **kwargs)

    def run(hidden_states):
        return _suffix(layer, start, hidden_states, attention_mask, position_embeddings)

    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        return layer._gradient_checkpointing_func(run, hidden_states)  # recomputed in the backward, as the layer is
    return run(hidden_states)


def _suffix(layer: nn.Module, start: int, hidden_states: torch.Tensor, attention_mask, position_embeddings):
    """`suffix_forward`'s computation (what gradient checkpointing runs again in the backward)."""
    b, T, _ = hidden_states.shape
    attn, n = layer.self_attn, T - start
    module = sys.modules[type(attn).__module__]  # the model's own rotary and attention helpers
    x = layer.input_layernorm(hidden_states)
    q = attn.q_proj(x[:, start:]).view(b, n, -1, attn.head_dim).transpose(1, 2)  # [b, heads, n, head_dim]
    k = attn.k_proj(x).view(b, T, -1, attn.head_dim).transpose(1, 2)  # [b, kv_heads, T, head_dim]
    v = attn.v_proj(x).view(b, T, -1, attn.head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    q, _ = module.apply_rotary_pos_emb(q, q[:, :1], cos[:, start:], sin[:, start:])
    _, k = module.apply_rotary_pos_emb(k[:, :, :1], k, cos, sin)
    eager = attn.config._attn_implementation == "eager"
    if attention_mask is None:  # causal, no padding: query i (position start + i) sees keys <= start + i
        mask = torch.ones(n, T, dtype=torch.bool, device=x.device).tril(start)[None, None]
        if eager:  # eager attention adds its mask
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=x.device).masked_fill(~mask, torch.finfo(q.dtype).min)
    else:  # [b, 1, T, T] (bool, or additive floats for eager): the read positions' rows
        mask = attention_mask[:, :, -n:, :]
    interface = module.eager_attention_forward if eager else module.ALL_ATTENTION_FUNCTIONS["sdpa"]
    out, _ = interface(attn, q, k, v, mask, dropout=0.0 if not attn.training else attn.attention_dropout,
                       scaling=attn.scaling, sliding_window=None)
    h = hidden_states[:, start:] + attn.o_proj(out.reshape(b, n, -1).contiguous())
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return torch.cat((hidden_states[:, :start], h), 1)


@contextmanager
def reads_from(backbone: nn.Module, start: int, enabled: bool = True):
    """For the block, the backbone's last decoder layer forms its output only at positions ``>= start`` (a token
    index of the ``[b, T]`` input; see the module docstring: earlier positions of ``last_hidden_state`` are not the
    model's output). Does nothing where ``enabled`` is false or the layer is not `supports_suffix`'s (it then runs
    in full). Gradients, gradient checkpointing, LoRA adapters and fused kernels go through the layer's own modules.
    """
    layer = last_decoder_layer(backbone)
    if not enabled or start <= 0 or not supports_suffix(layer):
        yield
        return
    own = layer.__dict__.get("forward")  # an instance-level forward someone set before: put back on exit

    def forward(hidden_states, *args, **kwargs):
        if args:  # the backbones in `SUPPORTED` pass all but the hidden states by keyword
            return (own or type(layer).forward.__get__(layer))(hidden_states, *args, **kwargs)
        return suffix_forward(layer, start, hidden_states, **kwargs)

    layer.forward = forward
    try:
        yield
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own
