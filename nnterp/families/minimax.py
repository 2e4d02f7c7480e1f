"""MiniMax (MiniMax-Text-01): lightning attention (a linear attention) or softmax attention at ``self_attn``, a routed
mixture of experts at ``mlp``, and residual adds that start from the normed stream, each side scaled by a factor.

    n1 = input_layernorm(layer_input)                    (attention_norm_output)
    layer_mid = n1 · α_a + self_attn(n1) · β_a           (attention_output = self_attn(n1) · β_a)
    n2 = post_attention_layernorm(layer_mid)             (mlp_norm_output; mlp_input, a copy the MLP alone reads)
    layer_output = n2 · α_m + mlp(n2) · β_m              (mlp_output = mlp(n2) · β_m)

The residual of each add is the norm's output, not the stream the block received: ``layer_input`` is in the
identity only through ``input_layernorm``. α_a, β_a are ``attn_alpha_factor`` and ``attn_beta_factor`` of the block
(the config's ``full_attn_*`` or ``linear_attn_*`` factors, by ``layer_types``); α_m, β_m are ``mlp_alpha_factor`` and
``mlp_beta_factor``. The contributions are what the block adds, the sublayers' outputs times β (computed as the
block computes them and handed back through β: ``nnterp.spec.views.Times``). On a linear-attention block the lightning attention's output is ``mixer_output`` and the
attention's values are unavailable, as on the other hybrids.
"""

import dataclasses

import transformers

from ..spec.identity import Custom
from .base import ROUTED, Family, input, native, pre_norm_block, router, times
from .hybrid import is_attention, mixer_block

FORMULA = ("layer_output = n2·α_m + mlp_output, n2 = norm2(layer_mid), "
           "layer_mid = n1·α_a + attention_output, n1 = norm1(layer_input) "
           "(RMS norms: input_layernorm, post_attention_layernorm; α_a: attn_alpha_factor, α_m: mlp_alpha_factor; "
           "the contributions are the sublayers' outputs times attn_beta_factor and mlp_beta_factor)")


def _scaled_adds(t, block):
    n1 = native(block.input_layernorm, t["layer_input"])
    mid = n1 * block.attn_alpha_factor + t["attention_output"]
    n2 = native(block.post_attention_layernorm, mid)
    return n2 * block.mlp_alpha_factor + t["mlp_output"]


def _attention_factors(config, i) -> tuple[float, float]:
    """(α_a, β_a) of block ``i``, as the block takes them from the config."""
    if config.layer_types[i] == "linear_attention":
        return config.linear_attn_alpha_factor, config.linear_attn_beta_factor
    return config.full_attn_alpha_factor, config.full_attn_beta_factor


def _minimax_block(config, i):
    attention = is_attention(config, i)
    block = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj" if attention else "",
        post_norm="post_attention_layernorm", mlp="mlp", act="", down_proj="", identity=Custom(FORMULA, _scaled_adds, reads=("layer_input", "attention_output", "mlp_output")),
        mlp_activation=ROUTED, mlp_neurons=ROUTED, **router("mlp.gate"),
        # the MLP's input is also the residual of the MLP add: read as a copy swapped in for the MLP alone, so an
        # edit of mlp_input is the MLP's (an edit of mlp_norm_output reaches both)
        mlp_input=input("mlp", copy=True),
    )
    if not attention:
        block = mixer_block(block, i, "self_attn", "lightning attention (a linear attention)")
    alpha, _ = _attention_factors(config, i)
    # the stream after the token mixer's add, from the values alone: the proof checks layer_mid is placed there
    identity = dataclasses.replace(block.identity, mid=lambda v, _: v["attention_norm_output"] * alpha + v["mixer_output"])
    return dataclasses.replace(times(block, attention_output="attn_beta_factor", mixer_output="attn_beta_factor",
                                     mlp_output="mlp_beta_factor"), identity=identity)


MINIMAX = Family(
    name="MiniMax", model_types=("minimax",), block=_minimax_block,
    # blocks 0 and 2 softmax attention, 1 and 3 lightning attention; every factor off 1 and distinct, so a missing
    # one shows; a block of 4 positions so the lightning attention carries its state across blocks
    tiny_config=lambda: transformers.MiniMaxConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=4,
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
        full_attn_alpha_factor=0.7, full_attn_beta_factor=1.3, linear_attn_alpha_factor=0.6,
        linear_attn_beta_factor=1.6, mlp_alpha_factor=0.8, mlp_beta_factor=1.2, pad_token_id=0),
)
