"""GPT-NeoX / Pythia, parallel (``use_parallel_residual=True``, Pythia's default) or sequential.

Parallel: ``y = (mlp_output + attention_output) + layer_input``; the attention reads
``input_layernorm(x)`` and the MLP ``post_attention_layernorm(x)``, two norms of the same
input, and there is no ``layer_mid``. Sequential: the usual ``(x + a) + m``.
"""

import transformers

from .base import Family, parallel_block, pre_norm_block

_MODULES = dict(attention="attention", o_proj="attention.dense", mlp="mlp", act="mlp.act",
                down_proj="mlp.dense_4h_to_h")


def _block(config, i):
    if config.use_parallel_residual:
        return parallel_block(input_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                              order="(m + a) + x", **_MODULES)
    return pre_norm_block(input_norm="input_layernorm", post_norm="post_attention_layernorm", **_MODULES)


GPT_NEOX = Family(
    name="GPT-NeoX",
    model_types=("gpt_neox",),
    layers="gpt_neox.layers",
    embed_tokens="gpt_neox.embed_in",
    ln_final="gpt_neox.final_layer_norm",
    attention="attention",
    mlp="mlp",
    block=_block,
    tiny_config=lambda: transformers.GPTNeoXConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=3, intermediate_size=128, vocab_size=128,
        max_position_embeddings=64, use_parallel_residual=True,
    ),
    variants=(("`use_parallel_residual=True`", {}), ("`use_parallel_residual=False`", {"use_parallel_residual": False})),
)
