"""Falcon-H1: a Mamba-2 mixer and attention side by side on the same normed stream, then the MLP.

Each mixer's output is scaled (``ssm_out_multiplier``, ``attention_out_multiplier``) and the two summed before the
residual add; then the MLP, whose output carries its own ``down_multiplier``. ``mixer_output`` is that sum and
``attention_output`` the attention's scaled output, both read at the block's own operations (nnsight's ``.source``
names them); the Mamba half is the module ``layers[i].mamba`` times ``ssm_out_multiplier``. The attention is called
with ``attention_norm_output * attention_in_multiplier``, and ``head_outputs`` sum to its output projection's
output, before ``attention_out_multiplier``. The embedding is multiplied by ``embedding_multiplier`` before block 0,
and the logits by ``lm_head_multiplier``.
"""

from dataclasses import replace

import transformers

from ..spec.identity import A, M, Name, Sum, X
from .base import Family, output, pre_norm_block

# the sum in the inner parentheses is mixer_output, the mixers' outputs the model adds before the residual add
_FALCON_H1 = Sum((X + (Name("mamba") * "ssm_out_multiplier" + A)) + M, note="(the inner sum: mixer_output)")


def _falcon_h1_block(config, i):
    block = pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj", post_norm="pre_ff_layernorm",
        mlp="feed_forward", act="feed_forward.act_fn", down_proj="feed_forward.down_proj", identity=_FALCON_H1,
        attention_output=output("", op="attention_hidden_states_0"),  # self_attn(...)[0] * attn_out_multiplier
        mixer_output=output("", op="hidden_states_1"),  # mamba_hidden_states + attention_hidden_states
    )
    return replace(block, extra={"mamba": output("mamba")})


FALCON_H1 = Family(
    name="Falcon-H1", model_types=("falcon_h1",), layers="model.layers", embed_tokens="model.embed_tokens",
    ln_final="model.final_layernorm", attention="self_attn", mlp="feed_forward", block=_falcon_h1_block,
    skip_output=lambda stream, block: (stream,),  # its blocks return (hidden,) and the model reads [0]
    logits_transform=lambda logits, config: logits * config.lm_head_multiplier,
    # every multiplier off 1, so a missing factor shows
    tiny_config=lambda: transformers.FalconH1Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=8, mamba_chunk_size=16, embedding_multiplier=3.0, lm_head_multiplier=0.375,
        attention_in_multiplier=0.7, attention_out_multiplier=0.3, ssm_in_multiplier=1.3, ssm_out_multiplier=0.6,
        key_multiplier=0.9, mlp_multipliers=[1.25, 0.55], ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.95]),
)
