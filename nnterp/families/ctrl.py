"""CTRL: GPT-2's sequential pre-norm block under other names.

``layernorm1``, ``multi_head_attention``, ``layernorm2`` and an ``ffn`` that is a
``Sequential`` (``ffn.0`` up, ``ffn.1`` ReLU, ``ffn.2`` down); each contribution passes a
dropout (``dropout1``, ``dropout2``) before its add, so it is read there. The attention is
CTRL's own code, outside transformers' attention interface. Block 0's input is the scaled
embedding plus sinusoidal positions.
"""

import transformers

from .base import OWN_ATTENTION, Family, output, pre_norm_block

CTRL = Family(
    name="CTRL",
    model_types=("ctrl",),
    layers="transformer.h",
    embed_tokens="transformer.w",
    ln_final="transformer.layernorm",
    attention="multi_head_attention",
    mlp="ffn",
    attention_internals=OWN_ATTENTION,
    block=lambda config, i: pre_norm_block(
        input_norm="layernorm1", attention="multi_head_attention", o_proj="multi_head_attention.dense",
        post_norm="layernorm2", mlp="ffn", act="ffn.1", down_proj="ffn.2",
        attention_output=output("dropout1"), mlp_output=output("dropout2"),
    ),
    tiny_config=lambda: transformers.CTRLConfig(n_layer=3, n_embd=64, n_head=4, dff=128, vocab_size=128,
                                                n_positions=64),
)
