"""Granite: Llama's block with a residual multiplier ``r`` on both contributions.

``layer_mid = layer_input + attention_output * r`` and
``layer_output = layer_mid + mlp_output * r`` with ``r = config.residual_multiplier``:
the products are not at any module boundary, so the values are the sublayers' own
outputs and the identity carries ``r``. (Block 0's input is the embedding times
``embedding_multiplier``, and the logits are ``lm_head`` divided by ``logits_scaling``.)
"""

from transformers import GraniteConfig

from .base import MODEL_LAYERS, Family, pre_norm_block


def _block(config, i):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        formula="layer_output = (layer_input + attention_output * r) + mlp_output * r, r = residual_multiplier",
        combine=lambda t, block: (t["layer_input"] + t["attention_output"] * block.residual_multiplier)
        + t["mlp_output"] * block.residual_multiplier,
    )


GRANITE = Family(
    name="Granite",
    model_types=("granite",),
    **MODEL_LAYERS,
    block=_block,
    logits_transform=lambda logits, config: logits / config.logits_scaling,
    tiny_config=lambda: GraniteConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0625, logits_scaling=8.0,
    ),
)
