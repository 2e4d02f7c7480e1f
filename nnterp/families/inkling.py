"""Inkling (text): the Llama / mixture-of-experts block, each contribution through a short convolution.

The attention's output goes through ``attn_sconv`` and the MLP's through ``mlp_sconv`` before each is
added to the stream: a causal depthwise convolution over positions plus its own input, computed in
float32 and cast back. What the block adds is the convolution's output, so ``attention_output`` and
``mlp_output`` are read there (the attention's own output mixes positions once more before it joins
the stream). Its sliding-window layers (``hybrid_sliding``) have their own head count and size
(``swa_*``). Its MLP is a routed mixture (with shared experts) on the ``sparse`` layers of
``mlp_layer_types``. The model divides the last stream by ``logits_mup_width_multiplier`` before the
head and drops the logits past ``unpadded_vocab_size`` when the head is padded.
"""

import transformers

from .base import ROUTED, Family, output, pre_norm_block, qk_norms


def _block(config, i):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="post_attention_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        attention_output=output("attn_sconv"), mlp_output=output("mlp_sconv"),
        **({"mlp_activation": ROUTED, "mlp_neurons": ROUTED} if config.mlp_layer_types[i] == "sparse" else {}),
        **qk_norms())  # each head's queries and keys, [batch, seq, heads, head_dim]


def _unpadded(logits, config):
    size = config.get_text_config().unpadded_vocab_size
    return logits[..., :size] if size is not None and size < logits.shape[-1] else logits


INKLING = Family(
    name="Inkling", model_types=("inkling_text",), block=_block,
    # its sliding-window layers have their own head count
    heads=lambda config, i: (config.swa_num_attention_heads if config.layer_types[i] == "hybrid_sliding"
                             else config.num_attention_heads),
    head_input_transform=lambda normed, config: normed / config.get_text_config().logits_mup_width_multiplier,
    logits_transform=_unpadded,
    tiny_config=lambda: transformers.InklingTextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16, sliding_window_size=4,
        d_rel=4, rel_extent=16, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
        mlp_layer_types=["dense", "sparse", "sparse"], moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, vocab_size=128, unpadded_vocab_size=120,
        max_position_embeddings=64, logits_mup_width_multiplier=2.0),
)
