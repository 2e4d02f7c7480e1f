"""Phi-3: sequential pre-norm with fused projections and named residual dropouts.

The contributions are the outputs of ``resid_attn_dropout`` and ``resid_mlp_dropout``
(the attention and MLP outputs in eval mode, and still exact in training). The MLP's
activation module is ``activation_fn`` on the gate half of ``gate_up_proj``.
"""

import transformers

from ..spec.views import Half
from .base import At, Family, output, pre_norm_block

PHI3 = Family(
    name="Phi-3",
    model_types=("phi3",),
    block=lambda config, i: pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.activation_fn", down_proj="mlp.down_proj",
        up=At("mlp.gate_up_proj", "output", views=(Half(1),)),  # [gate | up], chunked
        attention_output=output("resid_attn_dropout"), mlp_output=output("resid_mlp_dropout"),
    ),
    tiny_config=lambda: transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, pad_token_id=0),
)
