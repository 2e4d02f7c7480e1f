"""BioGPT and XGLM: OPT's pre-norm block, with the stream kept ``[batch, seq, hidden]``.

The MLP's layers are the block's own (``final_layer_norm``, ``fc1``, ``activation_fn``,
``fc2``), so ``layers[i].mlp`` is the block; ``final_layer_norm`` is the block's MLP norm.
The identity is the usual ``(x + a) + m``. BioGPT's blocks sit at ``biogpt.layers`` and its
head is ``output_projection``; XGLM's cross-attention (used only with an encoder) never runs
in a causal LM, and its self-attention is its own code, outside transformers' attention interface.
"""

import transformers

from .base import OWN_ATTENTION, Family, input, output, pre_norm_block


def _block(config, i):
    return pre_norm_block(
        input_norm="self_attn_layer_norm", attention="self_attn", o_proj="self_attn.out_proj",
        post_norm="final_layer_norm", mlp="fc1", act="activation_fn", down_proj="fc2",
        mlp_input=input("fc1"), mlp_output=output("fc2"),
    )


BIOGPT = Family(
    name="BioGPT", model_types=("biogpt",), layers="biogpt.layers", embed_tokens="biogpt.embed_tokens",
    ln_final="biogpt.layer_norm", lm_head="output_projection", attention="self_attn", mlp=None, block=_block,
    tiny_config=lambda: transformers.BioGptConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                                  num_attention_heads=4, vocab_size=128, max_position_embeddings=64),
)
XGLM = Family(
    name="XGLM", model_types=("xglm",), layers="model.layers", embed_tokens="model.embed_tokens",
    ln_final="model.layer_norm", attention="self_attn", mlp=None, block=_block, attention_internals=OWN_ATTENTION,
    tiny_config=lambda: transformers.XGLMConfig(d_model=64, ffn_dim=128, num_layers=3, attention_heads=4,
                                                vocab_size=128, max_position_embeddings=64),
)
