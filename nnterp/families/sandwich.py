"""Norms after the sublayers: Gemma-2, Gemma-3 (text, and inside ``Gemma3ForConditionalGeneration``), OLMo-2, OLMo-3.

A contribution is the output of the norm after its sublayer (``post_attention_layernorm``,
``post_feedforward_layernorm``), not the sublayer's own return; the identity is the usual
``(x + a) + m``. Gemma-2/3 also norm before each sublayer (the MLP's in
``pre_feedforward_layernorm``). OLMo-2/3 have no norm before either sublayer: the attention
reads ``layer_input`` and the MLP reads ``layer_mid``.
"""

from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig, Olmo2Config, Olmo3Config, SiglipVisionConfig

from .base import MODEL_LAYERS, Family, Unavailable, input, output, pre_norm_block, softcap_logits

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _gemma_block(config, i):
    return pre_norm_block(
        input_norm="input_layernorm", attention="self_attn", o_proj="self_attn.o_proj",
        post_norm="pre_feedforward_layernorm", mlp="mlp", act="mlp.act_fn", down_proj="mlp.down_proj",
        attention_output=output("post_attention_layernorm"), mlp_output=output("post_feedforward_layernorm"),
    )


def _olmo2_block(config, i):
    return pre_norm_block(
        input_norm="", attention="self_attn", o_proj="self_attn.o_proj", post_norm="", mlp="mlp",
        act="mlp.act_fn", down_proj="mlp.down_proj",
        attention_norm_output=Unavailable("no norm before the attention: it reads layer_input (the block norms "
                                          "the attention's output instead, in post_attention_layernorm)"),
        mlp_norm_output=Unavailable("no norm before the MLP: it reads layer_mid (the block norms the MLP's "
                                    "output instead, in post_feedforward_layernorm)"),
        # the stream the MLP reads is also the residual: edits of what the MLP receives go to a copy
        layer_mid=input("mlp", shared=True), mlp_input=input("mlp", copy=True),
        attention_output=output("post_attention_layernorm"), mlp_output=output("post_feedforward_layernorm"),
    )


def _family(name, model_type, block, tiny_config, **readout):
    return Family(
        name=name, model_types=(model_type,), **MODEL_LAYERS, block=block, tiny_config=tiny_config, **readout,
    )


GEMMA2 = _family("Gemma-2", "gemma2", _gemma_block, lambda: Gemma2Config(
    **_SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0), logits_transform=softcap_logits)
GEMMA3 = _family("Gemma-3", "gemma3_text", _gemma_block, lambda: Gemma3TextConfig(
    **_SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, layer_types=_LAYER_TYPES,
    final_logit_softcapping=30.0), logits_transform=softcap_logits)
# Gemma-3 checkpoints of 4B and more are image-text models: the same blocks, under model.language_model.
GEMMA3_MULTIMODAL = Family(
    name="Gemma-3 (image-text)", model_types=("gemma3",), layers="model.language_model.layers",
    embed_tokens="model.language_model.embed_tokens", ln_final="model.language_model.norm",
    attention="self_attn", mlp="mlp", block=_gemma_block,  # no final softcapping in this class
    tiny_config=lambda: Gemma3Config(
        text_config=GEMMA3.tiny_config().to_dict(), mm_tokens_per_image=16,
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=32, patch_size=8).to_dict()),
)
OLMO2 = _family("OLMo-2", "olmo2", _olmo2_block, lambda: Olmo2Config(**_SMALL))
OLMO3 = _family("OLMo-3", "olmo3", _olmo2_block, lambda: Olmo3Config(**_SMALL, sliding_window=4,
                                                                      layer_types=_LAYER_TYPES))
