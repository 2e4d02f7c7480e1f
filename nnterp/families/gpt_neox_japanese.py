"""GPT-NeoX-Japanese: GPT-NeoX's sequential block, whose last attention returns its projection's bias apart.

The last block's attention returns its output projection's bias apart (``dense_bias``), added to the projection's
output inside the residual add's helper function: there ``attention_output`` is that sum, read at the operation
inside the helper (``bias_dropout_add_0.x_0``); ``head_outputs`` sum to the projection's output, without the bias.
The attention computes its scores in its own code, so the values inside it are unavailable.
"""

import transformers

from .base import OWN_ATTENTION, Family, output, pre_norm_block, stream_and_none


def _neox_japanese_block(config, i):
    # only the last block's attention has a bias, returned apart and added in the block's helper: x = x + bias
    bias = {"attention_output": output("", op="bias_dropout_add_0.x_0")} if i == config.num_hidden_layers - 1 else {}
    return pre_norm_block(
        input_norm="input_layernorm", attention="attention", o_proj="attention.dense", post_norm="post_attention_layernorm",
        mlp="mlp", act="mlp.act", down_proj="mlp.dense_4h_to_h", **bias)


GPT_NEOX_JAPANESE = Family(
    name="GPT-NeoX-Japanese", model_types=("gpt_neox_japanese",), layers="gpt_neox_japanese.layers",
    embed_tokens="gpt_neox_japanese.embed_in", ln_final="gpt_neox_japanese.final_layer_norm", attention="attention",
    mlp="mlp", lm_head="embed_out", block=_neox_japanese_block, attention_internals=OWN_ATTENTION,
    skip_output=stream_and_none,  # its blocks return (hidden, attention weights) and the model reads [0]
    tiny_config=lambda: transformers.GPTNeoXJapaneseConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_multiple_size=2, vocab_size=128,
        max_position_embeddings=64),
)
